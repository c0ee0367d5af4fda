"""The extension a Megatron-Core user swaps in: tree packed-seq params, layer specs, modules, model, loss.

This package imports ``tree``, ``ops`` (and ``cp``) and Megatron-Core, never ``data`` or our training
application (``megatron_tree.training``: trainer, verify, launch, Megatron-LM hooks).

Names are exported lazily (PEP 562): ``from megatron_tree.megatron import get_tree_gpt_layer_spec``
imports Megatron-Core only when a name is first used, so importing this package stays cheap.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "TreePackedSeqParams": "packed_seq", "tree_packed_seq_params": "packed_seq", "get_tree_layout": "packed_seq",
    "TreeDotProductAttention": "attention",
    "TreeGatedDeltaNet": "gdn", "tree_gdn_module_spec": "gdn",
    "TreeMambaMixer": "mamba", "tree_mamba_module_spec": "mamba",
    "TreeMLASelfAttention": "mla",
    "TreeGPTModel": "model", "TreeMambaModel": "model", "TreeLanguageModelMixin": "model",
    "get_tree_mamba_stack_spec": "family_specs", "get_local_mamba_stack_spec": "family_specs",
    "get_tree_transformer_block_with_experimental_attention_variant_spec": "family_specs",
    "get_local_transformer_block_with_experimental_attention_variant_spec": "family_specs",
    "get_tree_gpt_layer_spec": "specs", "get_tree_gpt_decoder_block_spec": "specs",
    "get_tree_hybrid_stack_spec": "specs", "treeify_spec": "specs",
    "vocab_parallel_logprobs": "loss", "tree_loss_func": "loss", "vocab_parallel_logprobs_entropy": "loss",
    "tree_forward_step": "forward_step",
    "get_tree_gpt_mtp_block_spec": "specs", "TreeMultiTokenPredictionLayer": "mtp",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
