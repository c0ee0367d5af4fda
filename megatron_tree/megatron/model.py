"""`TreeGPTModel` / `TreeMambaModel`: Megatron's ``GPTModel`` / ``MambaModel`` with depth RoPE and
per-occurrence log-prob output.

Two things a model must do differently on a tree, both confined here (`TreeLanguageModelMixin`,
shared by both models; everything else, including the module tree, is the stock model's):

* **Depth RoPE.** ``GPTModel`` builds rotary embeddings for physical rows 0..s-1. On a tree a row's
  position is its depth on its root path (``layout.position_ids``): the rotary table is built with
  Megatron's own ``RotaryEmbedding`` and indexed by depth. This happens in ``_preprocess``
  (``TreeGPTModel``) or ``forward`` (``TreeMambaModel``, whose stock ``forward`` has no such hook),
  on every pipeline stage (and the table is an input, so recomputation reuses it). Learned
  absolute position embeddings get depth ``position_ids`` from the caller.
* **Loss rows.** With a `TreePackedSeqParams` carrying a loss map (and no ``labels``), the last
  stage returns per-occurrence target log-probs ``[M]`` instead of logits (float32, or float64 when
  the model runs in float64: softmax is never taken in a lower precision than float32): the output
  layer runs on the distinct source rows only, and `vocab_parallel_logprobs` handles the TP vocab
  shards. Without a loss map it returns ordinary logits for every row. With
  ``packed_seq_params.return_entropy`` it returns ``(logprobs, entropy)``: the entropy of each
  occurrence's next-token distribution, computed once per distinct source row, vocab-parallel
  (`vocab_parallel_logprobs_entropy`), same dtype rule.

A third thing only matters under context parallelism: **GDN layout islands**. Each maximal run of
consecutive non-attention layers of a pipeline stage (GDN 'G', Mamba-2 'M', MLP '-', MoE 'E') that
holds at least one GDN layer is an island (`gdn_island_spans`). The hidden states move from the
attention ownership (``packed_seq_params.cp_plan``) to a GDN-friendly one (``gdn_plan``) at the
island's entry and back at its exit (`megatron_tree.cp.execution.redistribute.redistribute_rows`, a
differentiable all-to-all over the CP group), so the residual stream, norms, MLP / MoE and the GDN
recurrences inside the island run on the GDN ownership, where a chain is cut into few cross-rank
pieces. The moves are forward pre-/post-hooks on the island's first / last layer module (the residual
add is inside the layer, outside the mixer), installed once at construction: Megatron's full
recomputation calls the same layer modules again and so redoes the same (deterministic) moves, and
pipeline stage boundaries always see attention ownership (an island never spans a stage). Under TP
sequence parallelism a move gathers the SP shards (all-gather over TP), moves the rows over CP and
scatters them again: every TP rank then moves all rows of its CP rank (TP-fold duplicated CP traffic
and one extra all-gather per move), simple and exact. The loss and logits always see the attention
ownership. Islands need ``gdn_plan`` in the params (`megatron_tree.megatron.forward_step
.context_parallel_params` adds it when `gdn_islands` is on, the default); CUDA-graphed layers bypass
module hooks and are not supported with islands.
"""
from __future__ import annotations

import dataclasses
import os
from functools import partial

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.mamba.mamba_model import MambaModel
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

from ..cp.execution.redistribute import redistribute_rows
from .loss import vocab_parallel_logprobs, vocab_parallel_logprobs_entropy, vocab_parallel_topk
from .moe_balance import install_moe_balancing
from .output_path import output_logits
from .packed_seq import TreePackedSeqParams


def unwrap_model(model):
    """The model inside Megatron's wrappers (DDP, Float16Module: each holds it as ``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model


# Test-only fault switch (None in normal use): "skip_exit" leaves the hidden states in GDN ownership
# after an island; "attention_rows" runs the island layers on the attention view while the hidden
# states are in GDN ownership.
_FAULT = None


def _islands_default() -> bool:
    """GDN layout islands are on unless ``$MEGATRON_TREE_GDN_ISLANDS`` is 0 / off / false."""
    return os.environ.get("MEGATRON_TREE_GDN_ISLANDS", "1").strip().lower() not in ("0", "off", "false", "no")


def layer_kind(layer) -> str:
    """Letter of a decoder layer: 'G' (holds a `TreeGatedDeltaNet`), 'M' (a tree Mamba-2 mixer),
    '*' (attention: any Megatron ``Attention`` or any other sequence mixer, which may depend on the
    ownership), '-' (token-local only: MLP, MoE, identity mixer)."""
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.identity_op import IdentityOp

    from .gdn import TreeGatedDeltaNet
    from .mamba import _TreeMambaMixerImpl

    mods = list(layer.modules())
    if any(isinstance(m, TreeGatedDeltaNet) for m in mods):
        return "G"
    if any(isinstance(m, _TreeMambaMixerImpl) for m in mods):
        return "M"
    if any(isinstance(m, Attention) for m in mods):
        return "*"
    for name in ("self_attention", "mixer", "cross_attention"):
        sub = getattr(layer, name, None)
        if sub is not None and not isinstance(sub, IdentityOp):
            return "*"  # an unknown sequence mixer: conservatively a boundary
    return "-"


def gdn_island_spans(kinds: str) -> list:
    """[(start, stop)] half-open layer ranges of the islands of a layer-kind string: maximal runs of
    non-attention letters that contain a 'G'. ``"GG-G*GG"`` -> ``[(0, 4), (5, 7)]``."""
    spans, start = [], None
    for i, k in enumerate(kinds + "*"):
        if k != "*" and start is None:
            start = i
        elif k == "*" and start is not None:
            if "G" in kinds[start:i]:
                spans.append((start, i))
            start = None
    return spans


class _IslandHooks:
    """Forward hooks of the island layers of one model chunk (holds no per-microbatch state: the
    plans come in each call's ``packed_seq_params``)."""

    def __init__(self, model):
        self.config, self.pg = model.config, model.pg_collection

    def move(self, hidden: torch.Tensor, src, dst) -> torch.Tensor:
        """Hidden states [s, 1, h] from ``src``'s ownership to ``dst``'s (both TreePackedSeqParams views)."""
        sp = self.config.sequence_parallel and self.pg.tp.size() > 1
        if sp:  # backward: this TP rank's slice of the (TP-identical) gradient
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=self.pg.tp)
        out = redistribute_rows(hidden, src.cp_plan, dst.cp_plan, self.pg.cp, src_padding=src.num_local_padding,
                                dst_padding=dst.num_local_padding)
        if sp:  # backward: all-gather of the TP slices' gradients
            out = scatter_to_sequence_parallel_region(out, group=self.pg.tp)
        return out

    def pre(self, entry: bool, module, args, kwargs):
        psp = kwargs.get("packed_seq_params")
        if not (isinstance(psp, TreePackedSeqParams) and psp.has_islands):
            return None  # islands off for this microbatch: the layer runs on the attention ownership
        view = psp.island_view()
        kwargs = dict(kwargs, packed_seq_params=psp if _FAULT == "attention_rows" else view)
        if entry:
            if kwargs.get("padding_mask") is not None:
                raise ValueError("GDN islands: a padding_mask cannot follow the rows across ownerships (tree "
                                 "microbatches carry none)")
            if "hidden_states" in kwargs:
                kwargs["hidden_states"] = self.move(kwargs["hidden_states"], psp, view)
            else:
                args = (self.move(args[0], psp, view),) + tuple(args[1:])
        return args, kwargs

    def post(self, module, args, kwargs, output):
        view = kwargs.get("packed_seq_params")
        if _FAULT == "attention_rows" and isinstance(view, TreePackedSeqParams) and view.has_islands:
            view = view.island_view()
        if not (isinstance(view, TreePackedSeqParams) and view.in_island) or _FAULT == "skip_exit":
            return None
        if isinstance(output, tuple):
            return (self.move(output[0], view, view.attention_view),) + tuple(output[1:])
        return self.move(output, view, view.attention_view)


class _OneRank:
    """A one-rank stand-in for the CP group a rotary module slices its table over: a tree view hands it
    this rank's own rows already, which stock's zigzag slicing must not cut again."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


_ONE_RANK = _OneRank()


def _is_tree(psp) -> bool:
    return isinstance(psp, TreePackedSeqParams) and psp.layout is not None


class TreeLanguageModelMixin:
    """What a tree changes in a Megatron language model, for `TreeGPTModel` and `TreeMambaModel`.

    Mixed in before the stock model class; uses only attributes every Megatron ``LanguageModule``
    language model has (``config``, ``pg_collection``, ``post_process``, ``position_embedding_type``,
    ``rotary_pos_emb``, ``output_layer``, ``share_embeddings_and_output_weights``).

    GDN layout islands (`install_gdn_islands`, called by both models' constructors):
    ``gdn_layer_kinds`` (one `layer_kind` letter per layer of this chunk), ``gdn_island_spans``
    (`gdn_island_spans` of them), ``gdn_island_geometry`` (what the island planner prices: ``heads``,
    the `megatron_tree.cp.GDNHeads` of the first GDN layer on this TP rank, ``hidden_size``,
    ``act_bytes``, ``gdn_layers`` per island) and the switch ``gdn_islands`` (default on, off with
    ``$MEGATRON_TREE_GDN_ISLANDS=0``; read when the params are built, so set it before training).
    """

    gdn_islands: bool = True
    gdn_island_spans: list = []
    gdn_layer_kinds: str = ""
    gdn_island_geometry: dict = {}

    def install_gdn_islands(self) -> None:
        """Find this chunk's islands and hook their first / last layers (once, at construction)."""
        layers = list(getattr(getattr(self, "decoder", None), "layers", None) or [])
        self.gdn_layer_kinds = "".join(layer_kind(layer) for layer in layers)
        self.gdn_island_spans = gdn_island_spans(self.gdn_layer_kinds)
        self.gdn_islands = _islands_default()
        self.gdn_island_geometry = {}
        if not self.gdn_island_spans:
            return
        from ..cp import GDNHeads
        from .gdn import TreeGatedDeltaNet

        # what the island planner prices: the first GDN layer's heads on this TP rank, the width and
        # element size of the rows moved at a boundary, GDN layers per island (boundaries are paid
        # once per island, the GDN work once per layer)
        m = next(m for layer in layers for m in layer.modules() if isinstance(m, TreeGatedDeltaNet))
        n_gdn = self.gdn_layer_kinds.count("G")
        self.gdn_island_geometry = dict(
            heads=GDNHeads(m.num_key_heads // m.tp_size, m.num_value_heads // m.tp_size, m.key_head_dim,
                           m.value_head_dim, int(m.conv1d.weight.shape[-1])),
            hidden_size=int(self.config.hidden_size),
            act_bytes=torch.empty((), dtype=self.config.params_dtype).element_size(),
            gdn_layers=max(1, round(n_gdn / len(self.gdn_island_spans))))
        hooks = _IslandHooks(self)
        for start, stop in self.gdn_island_spans:
            for i in range(start, stop):
                # every island layer gets the island view; the first one also moves the rows in
                layers[i].register_forward_pre_hook(partial(hooks.pre, i == start), with_kwargs=True)
            layers[stop - 1].register_forward_hook(hooks.post, with_kwargs=True)

    def tree_rotary_pos_emb(self, packed_seq_params) -> "torch.Tensor | None":
        """Rotary table ``[n, 1, 1, dim]`` indexed by the depth of each of this rank's ``n`` rows
        (``packed_seq_params.position_ids``); None for learned-absolute or no position embedding
        (learned absolute embeddings get depth ``position_ids`` from the caller)."""
        if getattr(self.config, "multi_latent_attention", False):
            return None  # MLA builds its rotary inside attention: TreeMLASelfAttention indexes it by depth
        if self.position_embedding_type == "mrope":
            # multimodal RoPE: Megatron's MultimodalRotaryEmbedding of each row's (t, h, w) position on its
            # path (records with images, `tree.images`), [n, 1, 1, dim]; the rows are this rank's already
            pos = packed_seq_params.mrope_position_ids.unsqueeze(1)  # [3, 1, n]
            return self.rotary_pos_emb(pos, self.mrope_section, cp_group=_ONE_RANK)
        if self.position_embedding_type in ("rope", "yarn"):
            # depth < number of rows, so a table of num_rows positions covers every depth; under CP
            # the rank's rows are indexed by their own depths (no zigzag slicing of the table)
            table = self.rotary_pos_emb(packed_seq_params.layout.num_rows, packed_seq=True)  # [N, 1, 1, dim]
            if self.position_embedding_type == "yarn":
                # YarnRotaryEmbedding returns (table, mscale); stock's attention applies the mscale to
                # q and k itself (from the config), as it does for the flat table
                table = table[0]
            if table.dim() == 5:
                # one table per layer kind stacked in front, [kinds, N, 1, 1, dim] (Gemma 3's local and
                # global rotary tables): each layer's attention picks its own, indexed by depth here
                return table[:, packed_seq_params.position_ids]
            return table[packed_seq_params.position_ids]
        if self.position_embedding_type in ("learned_absolute", "none"):
            return None
        raise ValueError(f"tree training supports rope, yarn, mrope, learned_absolute or none position embeddings, "
                         f"not {self.position_embedding_type!r}")

    def tree_embedding(self, input_ids, position_ids) -> torch.Tensor:
        """The first stage's decoder input for a tree's rows (a family that scales its embeddings, Falcon-H1's
        ``embedding_multiplier``, overrides this)."""
        return self.embedding(input_ids=input_ids, position_ids=position_ids)

    def tree_stack_forward(self, input_ids, position_ids, attention_mask, psp, *, decoder_input=None, labels=None,
                           runtime_gather_output=None, **decoder_kwargs):
        """A layer stack's model (`TreeMambaModel`, Falcon-H1's) on a tree: embedding, the stack with the
        rotary table by depth and ``packed_seq_params``, then (last stage) `_tree_postprocess`."""
        if decoder_input is None and self.pre_process:
            decoder_input = self.tree_embedding(input_ids, position_ids)
        # (a later pipeline stage passes None: the stack reads the tensor set by set_input_tensor)
        hidden_states = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                                     rotary_pos_emb=self.tree_rotary_pos_emb(psp), packed_seq_params=psp,
                                     **decoder_kwargs)
        if not self.post_process:
            if getattr(self, "mtp_process", False):
                raise ValueError("tree MTP needs every MTP layer on the last pipeline stage")
            return hidden_states
        return self._tree_postprocess(hidden_states, psp, input_ids=input_ids, position_ids=position_ids,
                                      labels=labels, runtime_gather_output=runtime_gather_output)

    def _tree_postprocess(self, hidden_states, psp, *, input_ids, position_ids, labels=None,
                          runtime_gather_output=None):
        """Last stage on a tree: MTP layers (megatron-core >= 0.19's hybrid MTP, `megatron.mtp`) when
        there is a loss map, then the main head: per-occurrence log-probs, or logits / loss as stock (the
        model's ``_scale_logits`` applied where it has one)."""
        if self.wants_tree_logprobs(psp, labels):
            if getattr(self, "mtp_process", False):  # their losses ride on hidden_states, as in TreeGPTModel
                from .mtp import tree_mtp_postprocess

                hidden_states = tree_mtp_postprocess(self, hidden_states, psp, input_ids=input_ids,
                                                     position_ids=position_ids)
            return self.tree_logprobs(hidden_states, psp.loss_map, return_entropy=psp.return_entropy,
                                      return_topk=psp.return_topk, occurrence_ids=psp.occurrence_ids)
        if getattr(self, "mtp_process", False) and labels is not None:
            raise ValueError(f"{type(self).__name__} with MTP layers on a tree: give the targets as the packed-seq "
                             "params' loss map, not labels (the MTP targets follow the tree, not a rolled label tensor)")
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output)
        scale = getattr(self, "_scale_logits", None)
        if scale is not None:
            logits = scale(logits)
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [s, b, v] -> [b, s, v], as stock
        return self.compute_language_model_loss(labels, logits)

    def wants_tree_logprobs(self, packed_seq_params, labels=None) -> bool:
        """True when this (last) stage must return per-occurrence log-probs instead of logits/loss."""
        return (self.post_process and _is_tree(packed_seq_params) and packed_seq_params.loss_map is not None
                and labels is None)

    def tree_logprobs(self, hidden_states: torch.Tensor, loss_map, *, return_entropy: bool = False,
                      return_topk: int = 0, occurrence_ids=None):
        """[M] log-probs of every loss occurrence from final hidden states [s(/tp), 1, h]; with
        ``return_entropy`` the pair ``(logprobs, entropy)`` (both [M], differentiable); with
        ``return_topk`` k > 0 also ``topk_ids [M, k]`` and ``topk_logprobs [M, k]`` (no gradient); with
        ``occurrence_ids`` (``fn(loss_map) -> [M, k]`` ids) ``(logprobs, entropy, logprobs_at_ids [M, k])``, the
        last differentiable (the closed-form vocab-parallel backward, one target per (occurrence, id)).

        float64 for a float64 model, float32 otherwise (bf16 / fp16 / fp32 logits are upcast).

        A value model (`value_head.add_value_head`) returns its [M] values at the occurrences' source rows in
        place of the log-probs (and zeros for the entropy): the critic of PPO reads ``V(s_t)`` there.
        """
        if getattr(self, "value_head", None) is not None:
            from .value_head import occurrence_values

            if return_topk or occurrence_ids is not None:
                raise ValueError("a value model returns values, not top-k log-probs or log-probs at given ids")
            values = occurrence_values(self, hidden_states, loss_map)
            return (values, torch.zeros_like(values)) if return_entropy else values
        tp_group = self.pg_collection.tp
        if self.config.sequence_parallel:
            # backward: reduce-scatter = sum of every rank's partial (vocab-shard) input gradient
            h = gather_from_sequence_parallel_region(hidden_states, group=tp_group)
        else:
            # backward: all-reduce of the partial input gradients, as ColumnParallelLinear does
            h = copy_to_tensor_model_parallel_region(hidden_states, group=tp_group)
        rows, inverse = torch.unique(loss_map.source_rows, return_inverse=True)
        h_u = h[rows, 0]
        weight = (self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights
                  else self.output_layer.weight)
        logits = output_logits(self, h_u, weight)  # stock's output path: soft-cap and MuP scaling included
        v_local = weight.shape[0]
        fn = vocab_parallel_logprobs_entropy if return_entropy or return_topk else vocab_parallel_logprobs
        group = tp_group if tp_group.size() > 1 else None
        out = fn(logits, inverse, loss_map.targets, vocab_start=tp_group.rank() * v_local, group=group)
        if occurrence_ids is not None:
            if return_topk:
                raise ValueError("occurrence_ids and return_topk go to different callers: ask for one")
            ids = occurrence_ids(loss_map).to(device=logits.device, dtype=torch.int64)  # [M, k]
            k = ids.shape[1] if ids.dim() == 2 else -1
            if ids.shape != (len(inverse), k):
                raise ValueError(f"occurrence_ids gave ids of shape {tuple(ids.shape)} for {len(inverse)} occurrences")
            at = vocab_parallel_logprobs(logits, inverse[:, None].expand(-1, k).reshape(-1), ids.reshape(-1),
                                         vocab_start=tp_group.rank() * v_local, group=group).view(-1, k)
            return (*(out if isinstance(out, tuple) else (out,)), at)
        if not return_topk:
            return out
        ids, logp = vocab_parallel_topk(logits, return_topk, vocab_start=tp_group.rank() * v_local, group=group)
        return (*out, ids[inverse], logp[inverse])


class TreeGPTModel(TreeLanguageModelMixin, GPTModel):
    """``GPTModel`` for tree microbatches (identical to ``GPTModel`` for any other input)."""

    def __init__(self, config, transformer_layer_spec, *args, **kwargs):
        super().__init__(config, transformer_layer_spec, *args, **kwargs)
        self._non_homogeneous_layers = bool(getattr(transformer_layer_spec, "non_homogeneous_layers", False))
        self.install_gdn_islands()
        install_moe_balancing(self)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Megatron's sharded state dict; hybrid stacks are always keyed per layer (a Mamba layer
        and an attention layer cannot be stacked into one tensor)."""
        if self._non_homogeneous_layers:
            metadata = dict(metadata or {}, non_homogeneous_layers=True)
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):
        psp = packed_seq_params
        if _is_tree(psp) and self.position_embedding_type == "mrope":
            # stock builds its multimodal table from 3-D position_ids, zigzag-sliced over CP ranks: give it
            # the rows' own positions and no slicing (the table is replaced below all the same)
            position_ids = psp.mrope_position_ids.unsqueeze(1)
            psp = dataclasses.replace(psp, cp_group=_ONE_RANK)
        out = super()._preprocess(input_ids=input_ids, position_ids=position_ids, decoder_input=decoder_input,
                                  inference_context=inference_context, packed_seq_params=psp,
                                  padding_mask=padding_mask)
        if _is_tree(packed_seq_params):
            rotary = self.tree_rotary_pos_emb(packed_seq_params)
            if rotary is not None:
                out = (out[0], rotary) + tuple(out[2:])
        return out

    def _postprocess(self, hidden_states, **kwargs):
        psp = kwargs.get("packed_seq_params")
        if self.wants_tree_logprobs(psp, kwargs.get("labels")) and kwargs.get("mtp_in_postprocess"):
            from .mtp import tree_mtp_postprocess  # MTP layers on the tree; their losses ride on hidden_states

            hidden_states = tree_mtp_postprocess(self, hidden_states, psp, input_ids=kwargs.get("input_ids"),
                                                 position_ids=kwargs.get("position_ids"),
                                                 attention_mask=kwargs.get("attention_mask"))
            kwargs = dict(kwargs, mtp_in_postprocess=False)
        elif _is_tree(psp) and kwargs.get("mtp_in_postprocess") and self.post_process and kwargs.get("labels") is None:
            from .mtp import logits_without_mtp  # no loss map: every row's logits, no MTP targets

            return logits_without_mtp(self, hidden_states, kwargs.get("runtime_gather_output"))
        if self.wants_tree_logprobs(psp, kwargs.get("labels")) and not kwargs.get("mtp_in_postprocess"):
            return self.tree_logprobs(hidden_states, psp.loss_map, return_entropy=psp.return_entropy,
                                      return_topk=psp.return_topk, occurrence_ids=psp.occurrence_ids)
        return super()._postprocess(hidden_states=hidden_states, **kwargs)


class TreeMambaModel(TreeLanguageModelMixin, MambaModel):
    """Megatron's ``MambaModel`` (the Nemotron-H family: Mamba-2 / attention / MLP / MoE layers of
    ``hybrid_override_pattern``) for tree microbatches.

    Same constructor, module tree, parameter names and sharded state dict as ``MambaModel``; build
    it with `get_tree_mamba_stack_spec` in place of ``mamba_stack_spec``. With a
    `TreePackedSeqParams` input the attention layers get the rotary table indexed by depth, and the
    last stage returns ``[M]`` per-occurrence log-probs when the params carry a loss map (and no
    ``labels``), else logits ``[1, N, V/tp]`` (or the loss with ``labels``), as ``MambaModel``.
    MTP depths of a ``main/mtp/...`` pattern (megatron-core >= 0.19) run on the tree as in
    `TreeGPTModel` (`megatron.mtp`). Any other input runs ``MambaModel.forward`` unchanged.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.install_gdn_islands()
        install_moe_balancing(self)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, runtime_gather_output=None, *, inference_params=None,
                packed_seq_params=None, padding_mask=None):
        if not _is_tree(packed_seq_params):
            return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels,
                                   inference_context=inference_context, runtime_gather_output=runtime_gather_output,
                                   inference_params=inference_params, packed_seq_params=packed_seq_params,
                                   padding_mask=padding_mask)
        if inference_context is not None or inference_params is not None:
            raise ValueError("TreeMambaModel is a training model: inference over a tree is not supported")
        return self.tree_stack_forward(input_ids, position_ids, attention_mask, packed_seq_params,
                                       decoder_input=decoder_input, labels=labels,
                                       runtime_gather_output=runtime_gather_output, padding_mask=padding_mask)
