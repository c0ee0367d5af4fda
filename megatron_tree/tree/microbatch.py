"""`TreeMicrobatch` (layout + loss map + sample paths) and its sharing statistics."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from .layout import TreeLayout
from .loss_map import LossMap
from .routes import padding_routes


@dataclass(frozen=True)
class MicrobatchStats:
    """Sharing statistics of one microbatch.

    tree_token_ratio = flat_tokens / tree_tokens: how many rows per-sample packing would run per
    row the tree runs (>= 1; padding excluded from both).
    attention pairs: visible (query, key) pairs of causal attention, per-sample
    (sum L(L+1)/2) vs tree (sum over real rows of ``visible_until[k] - k``).
    fill = tree_tokens / max_tokens_per_mb.
    """

    num_samples: int
    num_trees: int
    num_segments: int
    num_targets: int
    flat_tokens: int
    tree_tokens: int
    padding_tokens: int
    flat_attention_pairs: int
    tree_attention_pairs: int
    max_tokens_per_mb: int

    @property
    def tree_token_ratio(self) -> float:
        return self.flat_tokens / max(self.tree_tokens, 1)

    @property
    def attention_pair_ratio(self) -> float:
        return self.flat_attention_pairs / max(self.tree_attention_pairs, 1)

    @property
    def fill(self) -> float:
        return self.tree_tokens / self.max_tokens_per_mb

    def __getitem__(self, key: str):
        """``stats["tree_token_ratio"]`` as well as ``stats.tree_token_ratio``."""
        return self.as_dict()[key]

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(tree_token_ratio=self.tree_token_ratio, attention_pair_ratio=self.attention_pair_ratio,
                 fill=self.fill)
        return d


@dataclass(frozen=True, eq=False)
class TreeMicrobatch:
    """One packed microbatch.

    layout      the `TreeLayout` of its rows
    loss_map    per-occurrence targets (`LossMap`)
    sample_ids  [n] indices (into the list given to `pack`) of the samples it holds, ascending
    stats       `MicrobatchStats`
    sample_rows(sample_id) -> [L] int64 physical rows of that sample in path order; gathering any
    token-wise op output at these rows equals running the op on the sample alone (the test oracle).
    With carry: the prefix of the sample's path inside this layout, for every id in ``carry.path_sample_ids``.
    owned_rows  rows the microbatch computes (all rows without carry; carried rows excluded with it)
    carry       `tree.carry.CarryInfo` (``pack(..., carry=True)``): the rows it reads from earlier
                microbatches of the step and the rows later ones read from it; None otherwise
    routes      [N, moe_layers, topk] int64 expert choices of every physical row (routing replay), or
                None: set by ``pack(..., route_aware=True)``, where rows are shared only where tokens
                and routes agree, so ``routes[sample_rows(i)]`` is sample i's ``routed_experts``;
                padding rows hold a valid route (experts 0..topk-1)
    mtp_tail    rows appended after each sample's last token by ``pack(..., mtp_tail=K)`` (K per sample,
                0 without): the trailing positions stock multi-token prediction runs its depth-k layer
                on (token 0, stock's rolled-in id), never shared, in no sample's ``sample_rows`` and
                no loss map; ``tail_rows(i)`` [K] gives sample i's, `mtp_tail_stats` their weights
    rope_positions  [3, N] int64 multimodal RoPE ``(t, h, w)`` position of every row (0 on padding), or
                None: set by `pack` when a sample has ``images`` (`tree.images.row_rope_positions`)
    image_slots `tree.images.ImageSlots` or None: the distinct image occurrences among the rows this
                microbatch computes (what its vision encoder runs on)
    step_weight_by_depth  [D] float64 or None: the loss weights of every target of the optimizer step this
                microbatch belongs to (all DP ranks), by source-row depth; set by the data pipeline
                (`TreeStep.target_weight_by_depth`) so that a step-wide mean (Megatron-LM's logged MTP
                losses) can be formed from any one microbatch, replays included
    """

    layout: TreeLayout
    loss_map: LossMap
    sample_ids: tuple[int, ...]
    stats: MicrobatchStats
    _path_rows: np.ndarray  # concatenated sample paths, in ``sample_ids`` order
    _path_offsets: np.ndarray  # [n+1]
    routes: torch.Tensor | None = None
    _tail_rows: np.ndarray | None = None  # [n, K] each sample's MTP tail rows, in ``sample_ids`` order
    step_weight_by_depth: np.ndarray | None = None
    carry: "object | None" = None  # `tree.carry.CarryInfo` of a ``pack(..., carry=True)`` microbatch
    _path_ids: tuple[int, ...] | None = None  # carry: the samples ``sample_rows`` knows (else ``sample_ids``)
    rope_positions: torch.Tensor | None = None  # [3, N] multimodal (t, h, w) positions (records with images)
    image_slots: "object | None" = None  # `tree.images.ImageSlots`: the image occurrences its own rows hold

    @property
    def owned_rows(self) -> int:
        """Rows this microbatch computes: every layout row but the carried ones (padding included)."""
        return self.layout.num_rows - (0 if self.carry is None else len(self.carry.carried))

    @property
    def mtp_tail(self) -> int:
        return 0 if self._tail_rows is None else int(self._tail_rows.shape[1])

    def tail_rows(self, sample_id: int) -> torch.Tensor:
        """[mtp_tail] physical rows of sample ``sample_id``'s MTP tail (its j-th row is the j-th after its
        last token: stock's anchor ``len(s) - 1 + j - k`` at MTP depth k >= j)."""
        if self._tail_rows is None:
            return torch.zeros(0, dtype=torch.int64)
        return torch.from_numpy(self._tail_rows[self._slot(sample_id)])

    def mtp_tail_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tail_index, tail_inv_length)``, [N] int64 and [N] float64: ``j`` on the j-th tail row of a
        sample (0 on every other row) and ``1 / len(s)`` on sample s's tail rows (0 elsewhere): the rows
        and weights of the positions stock's MTP depth k >= j adds after a sample (`megatron.mtp.mtp_view`)."""
        n = self.layout.num_rows
        index, inv = np.zeros(n, np.int64), np.zeros(n, np.float64)
        if self._tail_rows is not None and self._tail_rows.size:
            rows = self._tail_rows
            index[rows] = np.arange(1, rows.shape[1] + 1)
            inv[rows] = (1.0 / np.maximum(np.diff(self._path_offsets), 1))[:, None]
        return torch.from_numpy(index), torch.from_numpy(inv)

    def sample_paths(self) -> torch.Tensor:
        """``[1 + S+1 + S + F]`` int64, one tensor (it is broadcast as one): S, the path offsets ``[S+1]`` of
        this layout's S paths (``sample_ids`` order), their lengths as stock divides by ``[S]`` (under carry
        the sample's whole length), then the F rows of every path concatenated (`split_sample_paths`). The
        per-sample statistics of a layer (a per-sample sequence aux loss) sum over them."""
        lens = np.diff(self._path_offsets) if self.carry is None else np.asarray(self.carry.path_sample_lengths)
        n = len(self._path_offsets) - 1
        return torch.from_numpy(np.concatenate([[n], self._path_offsets, lens, self._path_rows]).astype(np.int64))

    def sample_rows(self, sample_id: int) -> torch.Tensor:
        i = self._slot(sample_id)
        return torch.from_numpy(self._path_rows[self._path_offsets[i]: self._path_offsets[i + 1]])

    def _slot(self, sample_id: int) -> int:
        ids = self.sample_ids if self._path_ids is None else self._path_ids
        i = int(np.searchsorted(ids, sample_id))
        if i >= len(ids) or ids[i] != sample_id:
            raise KeyError(f"sample {sample_id} is not in this microbatch (it holds {len(ids)} samples)")
        return i

    def row_sample_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(count, inverse_length)``, both [N] float64 over the layout's rows: the number of samples
        whose path passes through each row, and the sum of ``1 / len(s)`` over those samples (0 on
        padding rows). Per-row weights of losses that stock Megatron averages over each sample's
        tokens (e.g. DSA's indexer loss): summing ``inverse_length[i] * term(i)`` over physical rows
        equals summing the per-sample means. Under carry ``len(s)`` is the sample's whole length, and
        each row's terms are summed in the microbatch that owns it."""
        n = self.layout.num_rows
        lens = np.diff(self._path_offsets)  # each path inside this layout
        whole = lens if self.carry is None else np.asarray(self.carry.path_sample_lengths, np.int64)  # carry: a
        # path here may be a prefix of its sample, whose whole length is the one stock divides by
        count = np.bincount(self._path_rows, minlength=n).astype(np.float64)
        inv = np.bincount(self._path_rows, weights=np.repeat(1.0 / np.maximum(whole, 1), lens), minlength=n)
        return torch.from_numpy(count), torch.from_numpy(inv.astype(np.float64))

    @property
    def num_rows(self) -> int:
        return self.layout.num_rows

    def to(self, device) -> "TreeMicrobatch":
        return TreeMicrobatch(self.layout.to(device), self.loss_map.to(device), self.sample_ids, self.stats,
                              self._path_rows, self._path_offsets,
                              None if self.routes is None else self.routes.to(device), self._tail_rows,
                              self.step_weight_by_depth, self.carry, self._path_ids,
                              None if self.rope_positions is None else self.rope_positions.to(device),
                              None if self.image_slots is None else self.image_slots.to(device))

    def __repr__(self) -> str:
        s = self.stats
        return (f"TreeMicrobatch(samples={s.num_samples}, rows={self.num_rows}, tree_tokens={s.tree_tokens}, "
                f"flat_tokens={s.flat_tokens}, ratio={s.tree_token_ratio:.2f})")


def padding_microbatch(max_tokens_per_mb: int, *, num_rows: int = 1, pad_id: int = 0,
                       float_fields=(), route_shape=None) -> TreeMicrobatch:
    """A microbatch of ``num_rows`` padding rows and no samples: zero loss, zero gradient.

    Used to give every data-parallel rank the same number of microbatches (collectives such as the
    MoE all-to-all run once per microbatch on every rank). Each padding row is its own one-row root
    segment, so every op runs on it without special cases. The `LossMap` has M = 0 occurrences;
    ``float_fields`` names optional per-occurrence fields ("advantages", "old_logprobs",
    "ref_logprobs") to create as empty float64 tensors, matching the real microbatches of a run.
    ``route_shape`` ``(moe_layers, topk)``: give the rows valid routes (routing replay runs every row
    through the experts it names), as the real microbatches of a route-aware run carry.
    """
    if not 1 <= num_rows <= max_tokens_per_mb:
        raise ValueError(f"num_rows={num_rows} must lie in [1, max_tokens_per_mb={max_tokens_per_mb}]")
    optional = ("advantages", "old_logprobs", "ref_logprobs")
    unknown = set(float_fields) - set(optional)
    if unknown:
        raise ValueError(f"unknown loss-map fields {sorted(unknown)}")
    empty = np.zeros(0, np.int64)
    layout = TreeLayout.from_segments(empty, empty, empty, num_padding=num_rows, pad_id=pad_id)
    empty_l = lambda: torch.zeros(0, dtype=torch.int64)
    empty_f = lambda: torch.zeros(0, dtype=torch.float64)
    loss_map = LossMap(source_rows=empty_l(), targets=empty_l(), sample_index=empty_l(), positions=empty_l(),
                       weights=empty_f(), **{f: (empty_f() if f in float_fields else None) for f in optional})
    stats = MicrobatchStats(num_samples=0, num_trees=0, num_segments=0, num_targets=0, flat_tokens=0, tree_tokens=0,
                            padding_tokens=num_rows, flat_attention_pairs=0, tree_attention_pairs=0,
                            max_tokens_per_mb=max_tokens_per_mb)
    routes = None
    if route_shape is not None:
        routes = torch.from_numpy(padding_routes(num_rows, *route_shape))
    return TreeMicrobatch(layout=layout, loss_map=loss_map, sample_ids=(), stats=stats,
                          _path_rows=np.zeros(0, np.int64), _path_offsets=np.zeros(1, np.int64), routes=routes)


def summarize(microbatches) -> dict:
    """Totals over microbatches (ratios recomputed from totals, not averaged)."""
    keys = ("num_samples", "num_trees", "num_segments", "num_targets", "flat_tokens", "tree_tokens",
            "padding_tokens", "flat_attention_pairs", "tree_attention_pairs")
    tot = {k: int(sum(getattr(mb.stats, k) for mb in microbatches)) for k in keys}
    budget = sum(mb.stats.max_tokens_per_mb for mb in microbatches)
    tot["num_microbatches"] = len(microbatches)
    tot["tree_token_ratio"] = tot["flat_tokens"] / max(tot["tree_tokens"], 1)
    tot["attention_pair_ratio"] = tot["flat_attention_pairs"] / max(tot["tree_attention_pairs"], 1)
    tot["fill"] = tot["tree_tokens"] / max(budget, 1)
    return tot


def split_sample_paths(paths: torch.Tensor) -> tuple:
    """``(offsets [S+1], lengths [S], rows [F])`` of `TreeMicrobatch.sample_paths`' one tensor."""
    n = int(paths[0])
    return paths[1: n + 2], paths[n + 2: 2 * n + 2], paths[2 * n + 2:]
