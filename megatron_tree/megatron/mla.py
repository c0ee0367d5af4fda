"""`TreeMLASelfAttention`: Megatron's Multi-Latent Attention with rotary by tree depth.

Megatron's ``MLASelfAttention`` (DeepSeek-V2/V3, Kimi K2, GLM: ``multi_latent_attention=True``,
``MLATransformerConfig``) builds its rotary table *inside* the attention module, for physical rows
``0..s-1``, and takes no table from the model. On a packed tree a row's position is its depth on its
root path, so this subclass changes exactly one thing: the table it looks up is indexed by
``packed_seq_params.position_ids`` (the depths of the rows this rank computes, context-parallel
aware). Everything else is the stock module running its own code: the low-rank projections, the
q / kv layernorms, TP and SP communication, the split into a no-position part (``qk_head_dim``) and a
rotary part (``qk_pos_emb_head_dim``), plain RoPE or YaRN with its concentration factor (``mscale``
on cos / sin) and its softmax scale, the fused YaRN kernels on GPU, and the ``mla_up_proj``
recomputation. Same parameters and the same sharded state dict as the stock module, so stock
checkpoints load unchanged (and back).

The core attention is `TreeDotProductAttention`, which MLA builds with ``k_channels = qk_head_dim +
qk_pos_emb_head_dim`` and ``v_channels = v_head_dim``: query/key heads of one width, value heads of
another (``ops.tree_attention`` takes ``Dv != D``).

How the depth table reaches stock code: while ``get_query_key_value_tensors`` runs on a tree, the
module's rotary embedding (re-classed at construction to `TreeRotaryEmbedding` /
`TreeYarnRotaryEmbedding`, same object and state) returns, for any requested length, the table
``table[depths]`` with one row per local row ``[s, 1, 1, dim]``; stock code then takes its ordinary
unpacked ``sbhd`` path (it is called with ``packed_seq_params=None``: stock MLA reads
``packed_seq_params`` only for THD packing and its RoPE length, and a tree keeps ``sbhd``), whose
``table[:s]`` is the whole depth table. The depths are set for the duration of that call only: the
module keeps no per-batch state, and recomputation (full, or MLA's own ``mla_up_proj`` checkpoint,
which reuses the table tensor) sees the same depths.

DeepSeek sparse attention (``experimental_attention_variant="dsa"``): MLA passes its hidden states and
query latent to the core attention, which is then `megatron_tree.megatron.dsa.TreeDSAttention` (its
indexer `TreeDSAIndexer` has its own depth-indexed rotary); see `megatron_tree.megatron.dsa`.

Not supported on a tree (clear errors): inference contexts / MLA latent caching.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from megatron.core.models.common.embeddings import RotaryEmbedding, YarnRotaryEmbedding
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from ..compat.mixers import stock_kwargs
from .packed_seq import TreePackedSeqParams


def _is_tree(psp) -> bool:
    return isinstance(psp, TreePackedSeqParams) and psp.layout is not None


class _DepthIndexedRotary:
    """Mixin for Megatron's rotary embeddings: inside `at_depths`, tables are looked up by depth.

    ``depths`` [s] int64 (any device the table lives on), ``table_rows`` > max(depths): the full
    table (no context-parallel slicing: the depths already name this rank's rows) is built for
    ``table_rows`` positions and row ``r`` of the result is position ``depths[r]``. Outside
    `at_depths` the module is exactly the stock one.
    """

    _tree_depths: Optional[torch.Tensor] = None
    _tree_table_rows: int = 0

    @contextlib.contextmanager
    def at_depths(self, depths: torch.Tensor, table_rows: int):
        if self._tree_depths is not None:
            raise RuntimeError("rotary depths are already set: at_depths() does not nest")
        self._tree_depths, self._tree_table_rows = depths, int(table_rows)
        try:
            yield self
        finally:
            self._tree_depths, self._tree_table_rows = None, 0

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        depths = self._tree_depths
        if depths is None:
            return super().forward(max_seq_len, offset, packed_seq, cp_group)
        # packed_seq=True: the whole table, not the stock zigzag CP slice of it
        out = super().forward(self._tree_table_rows, 0, True)
        if isinstance(out, tuple):  # YaRN: (emb [T,1,1,d], concentration factor)
            return out[0][depths], out[1]
        return out[depths]

    def get_cached_cos_sin(self, seq_len, offset=0, dtype=torch.float32, packed_seq=False):
        """YaRN's fused path: ``(cos, sin)`` [s,1,1,d], row r at depth ``depths[r]`` (mscale folded in)."""
        depths, rows = self._tree_depths, self._tree_table_rows
        if depths is None:
            return super().get_cached_cos_sin(seq_len, offset, dtype, packed_seq)
        # the stock cache is filled through self.forward: build it from the undecorated table
        self._tree_depths = None
        try:
            cos, sin = super().get_cached_cos_sin(rows, 0, dtype, True)
        finally:
            self._tree_depths = depths
        return cos[depths].contiguous(), sin[depths].contiguous()


class TreeRotaryEmbedding(_DepthIndexedRotary, RotaryEmbedding):
    """Megatron's ``RotaryEmbedding`` that can be indexed by tree depth (`_DepthIndexedRotary`)."""


class TreeYarnRotaryEmbedding(_DepthIndexedRotary, YarnRotaryEmbedding):
    """Megatron's ``YarnRotaryEmbedding`` that can be indexed by tree depth (`_DepthIndexedRotary`)."""


_TREE_ROTARY = {RotaryEmbedding: TreeRotaryEmbedding, YarnRotaryEmbedding: TreeYarnRotaryEmbedding}


class TreeMLASelfAttention(MLASelfAttention):
    """``MLASelfAttention`` whose rotary is indexed by tree depth (module docstring).

    Input hidden states ``[s(/tp under SP), 1, h]``, output ``([s(/tp), 1, h], bias)`` as stock. With a
    tree ``packed_seq_params``, query/key rotary parts of row r rotate by
    ``packed_seq_params.position_ids[r]``; with anything else (no tree) it is the stock module.
    """

    def __init__(self, config, submodules, layer_number: int, attn_mask_type=AttnMaskType.padding,
                 cp_comm_type: Optional[str] = None, pg_collection=None, name: Optional[str] = None):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, cp_comm_type=cp_comm_type, pg_collection=pg_collection,
                         **stock_kwargs(MLASelfAttention.__init__, name=name))  # name: 0.19+ builders pass it
        if (getattr(config, "experimental_attention_variant", None) == "dsa"
                and not getattr(self.core_attention, "requires_dsa_inputs", False)):
            raise ValueError("TreeMLASelfAttention: experimental_attention_variant='dsa' needs a DSA core attention "
                             "(megatron_tree.megatron.dsa.TreeDSAttention: get_tree_gpt_layer_spec(..., "
                             "experimental_attention_variant='dsa')); got "
                             f"{type(self.core_attention).__name__}")
        cls = _TREE_ROTARY.get(type(self.rotary_pos_emb))
        if cls is None:
            raise TypeError(f"TreeMLASelfAttention: no depth-indexed variant of {type(self.rotary_pos_emb).__name__} "
                            f"(rope_type={config.rope_type!r}); supported: rope, yarn")
        # Same object, same buffers and construction arguments as Megatron's: only lookups change.
        self.rotary_pos_emb.__class__ = cls

    def rotary_positions(self, packed_seq_params: TreePackedSeqParams) -> torch.Tensor:
        """[s] rotary position of every row this rank computes: its depth on its root path."""
        return packed_seq_params.position_ids

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                    packed_seq_params=None, inference_context=None, *, inference_params=None):
        """Stock projections + RoPE; on a tree, RoPE by depth. Returns ``(q [s,1,n,dq], k [s,1,n,dq],
        v [s,1,n,dv], q_compressed, kv_compressed)`` with ``dq = qk_head_dim + qk_pos_emb_head_dim``."""
        if not _is_tree(packed_seq_params):
            return super().get_query_key_value_tensors(hidden_states, key_value_states, position_ids,
                                                       packed_seq_params, inference_context=inference_context,
                                                       inference_params=inference_params)
        if inference_context is not None or inference_params is not None:
            raise ValueError("TreeMLASelfAttention trains on trees; inference contexts are not supported on a tree")
        depths = self.rotary_positions(packed_seq_params)
        s = hidden_states.shape[0] * (self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1)
        if depths.shape[0] != s:
            raise ValueError(f"{depths.shape[0]} rotary positions for a sequence of {s} rows")
        with self.rotary_pos_emb.at_depths(depths, packed_seq_params.layout.num_rows):
            # packed_seq_params=None: the tree keeps Megatron's sbhd layout (the stock code reads the
            # params for THD packing only); the core attention still gets them from forward()
            return super().get_query_key_value_tensors(hidden_states, key_value_states, position_ids, None)
