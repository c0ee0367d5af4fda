"""Single-device tree ops, token-major with no batch dim (the tree is the batch).

Each op has a torch reference backend that runs everywhere (the oracle in tests) and a GPU backend
of the ecosystem chosen by ``backend="auto"`` on CUDA tensors (see `backend.select_backend`).
"""
from .attention import apply_sinks, merge_attention, tree_attention, tree_attention_partial
from .causal_conv1d import tree_causal_conv1d
from .gated_delta_rule import chunk_gated_delta_rule_torch, tree_gated_delta_rule
from .ssd import ssd_chunked_torch, tree_ssd

__all__ = ["tree_attention", "tree_attention_partial", "merge_attention", "apply_sinks", "tree_gated_delta_rule",
           "chunk_gated_delta_rule_torch", "tree_ssd", "ssd_chunked_torch", "tree_causal_conv1d"]
