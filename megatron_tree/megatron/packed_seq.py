"""`TreePackedSeqParams`: tree metadata that rides through Megatron-Core's ``packed_seq_params``.

Megatron hands ``packed_seq_params`` to every attention / GDN / Mamba module, on every pipeline
stage and again during activation recomputation, so the layout (and later the CP plan) reaches
every module without mutable module state. ``qkv_format`` stays ``"sbhd"``: inputs keep Megatron's
[s, b=1, ...] shape and stock RoPE/attention code takes its ordinary (non-THD) paths.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from ..tree.layout import TreeLayout
from ..tree.loss_map import LossMap


@dataclass
class TreePackedSeqParams(PackedSeqParams):
    """PackedSeqParams carrying a tree.

    layout    `TreeLayout` of the microbatch's rows (on the compute device)
    loss_map  `LossMap` (on the compute device), or None on stages that compute no loss
    cp_plan   context-parallel plan (None without CP); every rank holds the same plan
    """

    layout: Optional[TreeLayout] = None
    loss_map: Optional[LossMap] = None
    cp_plan: Any = None

    def __post_init__(self):
        if self.qkv_format is None:
            self.qkv_format = "sbhd"
        if self.qkv_format != "sbhd":
            raise ValueError("TreePackedSeqParams keeps Megatron's [s, b, ...] layout: qkv_format must be 'sbhd'")
        if self.layout is not None and self.max_seqlen_q is None:
            # Megatron sizes its rotary table from these; every row of the tree is one position slot
            self.max_seqlen_q = self.max_seqlen_kv = self.layout.num_rows

    @property
    def position_ids(self) -> torch.Tensor:
        """[N] depth of every row (what RoPE is indexed by)."""
        return self.layout.position_ids


def get_tree_layout(packed_seq_params) -> TreeLayout:
    """The layout of a `TreePackedSeqParams`; a clear error for anything else."""
    if not isinstance(packed_seq_params, TreePackedSeqParams) or packed_seq_params.layout is None:
        raise ValueError(
            "tree modules need packed_seq_params=TreePackedSeqParams(layout=...) "
            f"(got {type(packed_seq_params).__name__}); build it with megatron_tree.megatron.packed_seq.tree_packed_seq_params(mb)")
    return packed_seq_params.layout


def tree_packed_seq_params(mb, device=None, *, cp_plan=None) -> TreePackedSeqParams:
    """`TreePackedSeqParams` for a `TreeMicrobatch`, moved to ``device``."""
    layout, loss_map = mb.layout, mb.loss_map
    if device is not None:
        layout, loss_map = layout.to(device), loss_map.to(device)
    return TreePackedSeqParams(layout=layout, loss_map=loss_map, cp_plan=cp_plan)
