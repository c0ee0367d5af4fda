"""`TreePackedSeqParams`: tree metadata that rides through Megatron-Core's ``packed_seq_params``.

Megatron hands ``packed_seq_params`` to every attention / GDN / Mamba module, on every pipeline
stage and again during activation recomputation, so the layout (and later the CP plan) reaches
every module without mutable module state. ``qkv_format`` stays ``"sbhd"``: inputs keep Megatron's
[s, b=1, ...] shape and stock RoPE/attention code takes its ordinary (non-THD) paths.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from ..tree.layout import TreeLayout
from ..tree.loss_map import LossMap


@dataclass
class TreePackedSeqParams(PackedSeqParams):
    """PackedSeqParams carrying a tree.

    layout             `TreeLayout` of the whole microbatch (on the compute device), on every rank
    loss_map           `LossMap` (on the compute device), or None on stages that compute no loss.
                       Under CP it holds this rank's occurrences only, with ``source_rows`` as
                       *local* row indices (the rows whose outputs this rank computes)
    cp_plan            `megatron_tree.cp.CPPlan` (None without CP); every CP rank holds the same plan
    cp_rank            this rank's index in the CP group (0 without CP)
    local_rows         [n] global rows this CP rank holds, in its local order (None without CP)
    num_local_padding  rows appended after ``local_rows`` (pad token, depth 0, attend to nothing)
                       so that the local sequence divides by the TP size under sequence parallelism
    gdn_plan           second `CPPlan` of the same microbatch for GDN layout islands (None: no islands;
                       the GDN layers then run on ``cp_plan``): consecutive non-attention layers with a
                       GDN layer run on this ownership (`island_view`), identical on every CP rank
    gdn_local_rows     [n_g] global rows this rank owns under ``gdn_plan`` (ascending)
    gdn_num_local_padding  padding rows after them (the TP size divides ``n_g + padding`` under SP)
    row_samples        [N] float64 (global rows, or None): samples whose path passes through each row
    row_inv_length     [N] float64 (or None): sum of ``1 / len(s)`` over those samples. Both come from
                       the microbatch (`TreeMicrobatch.row_sample_stats`) and weight per-row terms that
                       stock Megatron averages (or sums) over each sample's tokens: DSA's indexer loss
    sample_paths       [1 + 2S + 1 + F] int64 (or None): every path of the microbatch (global rows), its length as
                       stock divides by (`TreeMicrobatch.sample_paths`, `tree.microbatch.split_sample_paths`):
                       what per-sample statistics sum over (`megatron.moe_balance`'s per-sample seq aux loss)
    mtp_tail_index     [N] int64 (global rows, or None): j on the j-th MTP tail row after a sample (0 elsewhere)
    mtp_tail_inv_length [N] float64 (or None): ``1 / len(s)`` on sample s's tail rows. Both from
                       `TreeMicrobatch.mtp_tail_stats` (``pack(..., mtp_tail=K)``): the trailing positions
                       stock MTP depth k runs on, which an MTP layer's DSA indexer loss covers (`megatron.mtp`)
    step_weight_by_depth  [D] float64 (or None): the loss weights of the targets of the whole optimizer
                       step (all DP ranks) by source-row depth (`TreeMicrobatch.step_weight_by_depth`, from
                       the data pipeline), set by the Megatron-LM hooks' `get_batch` only: the MTP block
                       logs each depth's loss to stock's tracker against it and Megatron's microbatch
                       count, so that Megatron-LM's ``mtp_k loss`` is the step's per-token mean (None:
                       stock's per-microbatch mean; ``megatron-tree train`` logs from its reports)
    rope_positions     [3, N] int64 (global rows, or None): every row's multimodal RoPE (t, h, w) position
                       (`TreeMicrobatch.rope_positions`, records with images); an ``mrope`` model reads its
                       rows' through `mrope_position_ids` (the depth on every axis where it is None)
    images             `tree.images.ImageSlots` (or None): the image occurrences among the microbatch's own
                       rows, with their pixels, which `megatron.vision_language` encodes and scatters
    deepstack          list of [n, 1, h] (or None): Qwen3-VL's DeepStack feature rows of this view (zeros off the
                       image rows), set by `TreeVisionLanguageModel`; language-model layer k adds the k-th
    routes             [N, moe_layers, topk] int64 (global rows, or None): every row's MoE expert choices
                       for routing replay (``TreeMicrobatch.routes``, `megatron_tree.megatron.routing_replay`)
    return_entropy     True: the model's last stage returns ``(logprobs, entropy)``, both ``[M]`` per
                       occurrence (`vocab_parallel_logprobs_entropy`), instead of the log-probs alone
    return_topk        k > 0 (with ``return_entropy``): the last stage returns ``(logprobs, entropy,
                       topk_ids [M, k], topk_logprobs [M, k])``, the k most likely next tokens of every
                       occurrence under the full-vocabulary softmax (`vocab_parallel_topk`; scoring)
    occurrence_ids     ``fn(loss_map) -> [M, k]`` int64 (or None): vocabulary ids to read the log-probs of at every
                       occurrence of the (local) loss map, e.g. a teacher's top-k for distillation; the last
                       stage then also returns ``logprobs_at_ids [M, k]`` (differentiable, vocab-parallel) after
                       ``(logprobs, entropy)``. A function of the loss map, so CP and carry views read their own
    carry              `cp.execution.carry.CarryView` of a carry microbatch (`megatron.carry.carry_view`):
                       the modules run on its own rows (``local_rows``) and read carried rows' state
                       from the step's store; None otherwise
    in_island          True on the island view itself: ``cp_plan`` / ``local_rows`` / ``num_local_padding``
                       are then the GDN ownership's, ``loss_map`` is None, and ``attention_view`` is
                       the attention-ownership view it was made from

    Without CP the modules see all ``layout.num_rows`` rows; under CP they see
    ``num_local_rows = len(local_rows) + num_local_padding`` rows: ``input_ids`` / ``position_ids``
    give the rank's view in both cases.
    """

    layout: Optional[TreeLayout] = None
    loss_map: Optional[LossMap] = None
    cp_plan: Any = None
    cp_rank: int = 0
    local_rows: Optional[torch.Tensor] = None
    num_local_padding: int = 0
    gdn_plan: Any = None
    gdn_local_rows: Optional[torch.Tensor] = None
    gdn_num_local_padding: int = 0
    row_samples: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False, compare=False)
    row_inv_length: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False, compare=False)
    sample_paths: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False, compare=False)
    mtp_tail_index: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False, compare=False)
    mtp_tail_inv_length: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False, compare=False)
    step_weight_by_depth: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False, compare=False)
    in_island: bool = False
    return_entropy: bool = False
    return_topk: int = 0
    occurrence_ids: Any = dataclasses.field(default=None, repr=False, compare=False)
    routes: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False, compare=False)
    rope_positions: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False, compare=False)
    images: Any = dataclasses.field(default=None, repr=False, compare=False)
    deepstack: Any = dataclasses.field(default=None, repr=False, compare=False)
    attention_view: Any = dataclasses.field(default=None, repr=False, compare=False)
    carry: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.qkv_format is None:
            self.qkv_format = "sbhd"
        if self.qkv_format != "sbhd":
            raise ValueError("TreePackedSeqParams keeps Megatron's [s, b, ...] layout: qkv_format must be 'sbhd'")
        if self.layout is not None and self.max_seqlen_q is None:
            # Megatron sizes its rotary table from these; every row of the tree is one position slot
            self.max_seqlen_q = self.max_seqlen_kv = self.layout.num_rows

    @property
    def is_context_parallel(self) -> bool:
        return self.cp_plan is not None and self.cp_plan.cp_size > 1

    @property
    def num_local_rows(self) -> int:
        """Rows the modules of this rank see (all rows without CP)."""
        if self.local_rows is None:
            return self.layout.num_rows
        return int(self.local_rows.shape[0]) + self.num_local_padding

    @property
    def has_islands(self) -> bool:
        """True when this (attention-ownership) view carries a GDN island ownership."""
        return self.gdn_plan is not None and self.gdn_local_rows is not None and not self.in_island

    def island_view(self) -> "TreePackedSeqParams":
        """The GDN-ownership view of this rank (what the layers inside a GDN island receive).

        Same layout; ``cp_plan`` = ``gdn_plan``, ``local_rows`` = ``gdn_local_rows``,
        ``num_local_padding`` = ``gdn_num_local_padding``; no loss map (the loss always sees the
        attention ownership). Made once per microbatch view and reused by every island layer, by
        recomputation and by every island of the stage. The island view of an island view is itself.
        """
        if self.in_island:
            return self
        if not self.has_islands:
            raise ValueError("island_view: these packed_seq_params carry no GDN island plan (gdn_plan): build them "
                             "with megatron_tree.megatron.forward_step.context_parallel_params(psp, model) for a model "
                             "with GDN islands")
        view = self.__dict__.get("_island_view")
        if view is None:
            view = dataclasses.replace(self, loss_map=None, cp_plan=self.gdn_plan, local_rows=self.gdn_local_rows,
                                       num_local_padding=self.gdn_num_local_padding, in_island=True,
                                       attention_view=self)
            view.max_seqlen_q, view.max_seqlen_kv = self.max_seqlen_q, self.max_seqlen_kv
            self.__dict__["_island_view"] = view
        return view

    def cp_owned_rows(self, seq_len: int, who: str) -> int:
        """Number of owned rows of this CP rank, after checking the plan is there and the module's
        input covers ``num_local_rows`` (owned rows first, then padding)."""
        if self.cp_plan is None or self.local_rows is None:
            raise ValueError(f"{who}: context_parallel_size > 1 needs a CP plan in packed_seq_params: build it with "
                             "tree_packed_seq_params(mb, cp_plan=megatron_tree.cp.plan_context_parallel(mb.layout, "
                             "cp_size), cp_rank=...) or let tree_forward_step plan it")
        n = int(self.local_rows.shape[0])
        if seq_len != self.num_local_rows:
            raise ValueError(f"{who}: the input covers {seq_len} rows but this CP rank holds {self.num_local_rows} "
                             f"({n} owned + {self.num_local_padding} padding)")
        return n

    def _local(self, full: torch.Tensor, pad_value: int) -> torch.Tensor:
        if self.local_rows is None:
            return full
        return torch.cat([full[self.local_rows], full.new_full((self.num_local_padding,), pad_value)])

    @property
    def input_ids(self) -> torch.Tensor:
        """[num_local_rows] tokens this rank embeds."""
        return self._local(self.layout.input_ids, 0)

    @property
    def position_ids(self) -> torch.Tensor:
        """[num_local_rows] depth of every row this rank holds (what RoPE is indexed by)."""
        return self._local(self.layout.position_ids, 0)

    @property
    def mrope_position_ids(self) -> torch.Tensor:
        """[3, num_local_rows] multimodal RoPE position of every row this rank holds: ``rope_positions``, or
        the depth on all three axes (a text-only batch: what HF's ``get_rope_index`` gives text)."""
        if self.rope_positions is None:
            return self.position_ids.unsqueeze(0).expand(3, -1)
        return torch.stack([self._local(p, 0) for p in self.rope_positions])

    def local_index(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keep, local)``: which of the global ``rows`` this rank holds, and their local indices."""
        if self.local_rows is None:
            return torch.ones_like(rows, dtype=torch.bool), rows
        at = torch.searchsorted(self.local_rows, rows).clamp(max=max(len(self.local_rows) - 1, 0))
        keep = self.local_rows[at] == rows if len(self.local_rows) else torch.zeros_like(rows, dtype=torch.bool)
        return keep, at[keep]


def get_tree_layout(packed_seq_params) -> TreeLayout:
    """The layout of a `TreePackedSeqParams`; a clear error for anything else."""
    if not isinstance(packed_seq_params, TreePackedSeqParams) or packed_seq_params.layout is None:
        raise ValueError(
            "tree modules need packed_seq_params=TreePackedSeqParams(layout=...) "
            f"(got {type(packed_seq_params).__name__}); build it with megatron_tree.megatron.packed_seq.tree_packed_seq_params(mb)")
    return packed_seq_params.layout


def local_loss_map(loss_map: LossMap, owner: torch.Tensor, local_rows: torch.Tensor, rank: int) -> LossMap:
    """The occurrences whose source row ``rank`` owns, with ``source_rows`` as local indices.

    owner [N] rank of every global row; local_rows [n] this rank's rows in local order (ascending).
    Order of the kept occurrences is unchanged; every occurrence lands on exactly one rank.
    """
    keep = owner[loss_map.source_rows] == rank
    kept = {f.name: (None if getattr(loss_map, f.name) is None else getattr(loss_map, f.name)[keep])
            for f in dataclasses.fields(loss_map)}
    kept["source_rows"] = torch.searchsorted(local_rows, kept["source_rows"])
    return LossMap(**kept)


def tree_packed_seq_params(mb, device=None, *, cp_plan=None, cp_rank: int = 0,
                           pad_to_multiple_of: int = 1, gdn_plan=None,
                           return_entropy: bool = False, return_topk: int = 0,
                           occurrence_ids=None) -> TreePackedSeqParams:
    """`TreePackedSeqParams` for a `TreeMicrobatch`, moved to ``device``; with a ``cp_plan`` of more
    than one rank, CP rank ``cp_rank``'s view of it (`context_parallel_view`, with the GDN island
    ownership ``gdn_plan`` when given). ``return_entropy``: the model returns ``(logprobs, entropy)``;
    ``return_topk`` k > 0: also each occurrence's top-k ids and log-probs; ``occurrence_ids``: see
    `TreePackedSeqParams`."""
    layout, loss_map = mb.layout, mb.loss_map
    if device is not None:
        layout, loss_map = layout.to(device), loss_map.to(device)
    count, inv = mb.row_sample_stats()
    routes = getattr(mb, "routes", None)
    tail_index, tail_inv = mb.mtp_tail_stats() if getattr(mb, "mtp_tail", 0) else (None, None)
    to = lambda t: None if t is None else t.to(layout.device)
    paths = mb.sample_paths() if hasattr(mb, "sample_paths") else None
    psp = TreePackedSeqParams(layout=layout, loss_map=loss_map, cp_plan=cp_plan, row_samples=to(count),
                              row_inv_length=to(inv), sample_paths=to(paths),
                              return_entropy=return_entropy or return_topk > 0 or occurrence_ids is not None,
                              return_topk=return_topk, occurrence_ids=occurrence_ids, routes=to(routes),
                              mtp_tail_index=to(tail_index), mtp_tail_inv_length=to(tail_inv),
                              rope_positions=to(getattr(mb, "rope_positions", None)),
                              images=None if getattr(mb, "image_slots", None) is None else mb.image_slots.to(
                                  layout.device))
    if cp_plan is None or cp_plan.cp_size == 1:
        return psp
    return context_parallel_view(psp, cp_plan, cp_rank, pad_to_multiple_of=pad_to_multiple_of, gdn_plan=gdn_plan)


def _padding(n: int, multiple: int) -> int:
    """Rows to append to ``n`` owned rows so the TP size divides them (one slot per TP rank when n = 0)."""
    multiple = max(1, multiple)
    return (-n) % multiple or (multiple if n == 0 else 0)


def context_parallel_view(psp: TreePackedSeqParams, cp_plan, cp_rank: int, *,
                          pad_to_multiple_of: int = 1, gdn_plan=None) -> TreePackedSeqParams:
    """CP rank ``cp_rank``'s view of a whole-microbatch ``psp``.

    Its owned rows (``cp_plan.owner_rows(cp_rank)``), padded up to a multiple of ``pad_to_multiple_of``
    (the TP size under sequence parallelism; a rank that owns nothing still gets one padded slot per
    TP rank, since Megatron's modules cannot run on an empty sequence), and the loss map of the
    occurrences it computes. The layout stays whole: every rank sees the tree.

    ``gdn_plan`` (optional): the GDN island ownership of the same microbatch (same ``cp_size`` and
    rows); the view then also carries this rank's rows under it (padded the same way), and
    `TreePackedSeqParams.island_view` gives the view the island layers run on.
    """
    layout, loss_map = psp.layout, psp.loss_map
    if cp_plan.num_rows != layout.num_rows:
        raise ValueError(f"the CP plan covers {cp_plan.num_rows} rows but the microbatch has {layout.num_rows}: "
                         "plan each microbatch with megatron_tree.cp.plan_context_parallel(mb.layout, cp_size)")
    if not 0 <= cp_rank < cp_plan.cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside the plan's CP group of size {cp_plan.cp_size}")
    dev = layout.device
    rows = torch.from_numpy(cp_plan.owner_rows(cp_rank)).to(dev)
    owner = torch.from_numpy(cp_plan.owner.astype("int64")).to(dev)
    pad = _padding(int(rows.shape[0]), pad_to_multiple_of)
    local_lm = None if loss_map is None else local_loss_map(loss_map, owner, rows, cp_rank)
    g_rows, g_pad = None, 0
    if gdn_plan is not None:
        if gdn_plan.num_rows != layout.num_rows or gdn_plan.cp_size != cp_plan.cp_size:
            raise ValueError(f"the GDN island plan covers {gdn_plan.num_rows} rows for {gdn_plan.cp_size} CP ranks but "
                             f"the attention plan {layout.num_rows} rows for {cp_plan.cp_size}: plan both for the same "
                             "microbatch and CP size")
        g_rows = torch.from_numpy(gdn_plan.owner_rows(cp_rank)).to(dev)
        g_pad = _padding(int(g_rows.shape[0]), pad_to_multiple_of)
    out = TreePackedSeqParams(layout=layout, loss_map=local_lm, cp_plan=cp_plan, cp_rank=cp_rank, local_rows=rows,
                              num_local_padding=pad, gdn_plan=gdn_plan, gdn_local_rows=g_rows,
                              gdn_num_local_padding=g_pad, row_samples=psp.row_samples,
                              row_inv_length=psp.row_inv_length, sample_paths=psp.sample_paths,
                              return_entropy=psp.return_entropy, return_topk=psp.return_topk,
                              occurrence_ids=psp.occurrence_ids, routes=psp.routes,
                              mtp_tail_index=psp.mtp_tail_index, mtp_tail_inv_length=psp.mtp_tail_inv_length,
                              step_weight_by_depth=psp.step_weight_by_depth, rope_positions=psp.rope_positions,
                              images=psp.images)
    # Megatron's GPTModel builds (and TreeGPTModel then replaces) a rotary table of max_seqlen_q rows,
    # zigzag-sliced over CP ranks, which needs a multiple of 2 * cp
    out.max_seqlen_q = out.max_seqlen_kv = -(-layout.num_rows // (2 * cp_plan.cp_size)) * 2 * cp_plan.cp_size
    return out
