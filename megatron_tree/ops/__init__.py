"""Single-device tree ops, token-major with no batch dim (the tree is the batch).

Each op has a torch reference backend that runs everywhere (the oracle in tests) and a GPU backend
of the ecosystem chosen by ``backend="auto"`` on CUDA tensors (see `backend.select_backend`).
"""
from .attention import apply_sinks, merge_attention, tree_attention, tree_attention_partial
from .causal_conv1d import tree_causal_conv1d
from .dsa import (NO_ROW, dsa_index_scores, dsa_indexer_loss_partial_stats, dsa_indexer_loss_partial_terms, merge_topk,
                  sparse_attention, tree_dsa, tree_dsa_indexer_loss, tree_dsa_topk, tree_dsa_topk_partial)
from .gated_delta_rule import chunk_gated_delta_rule_torch, tree_gated_delta_rule
from .ssd import ssd_chunked_torch, tree_ssd

__all__ = ["tree_attention", "tree_attention_partial", "merge_attention", "apply_sinks", "tree_gated_delta_rule",
           "chunk_gated_delta_rule_torch", "tree_ssd", "ssd_chunked_torch", "tree_causal_conv1d",
           "NO_ROW", "dsa_index_scores", "merge_topk", "tree_dsa_topk_partial", "tree_dsa_topk", "sparse_attention",
           "dsa_indexer_loss_partial_stats", "dsa_indexer_loss_partial_terms", "tree_dsa_indexer_loss", "tree_dsa"]
