"""Megatron-Bridge (Hugging Face checkpoints) to tree models: an optional extra
(``pip install 'megatron-tree[hf]'``: megatron-bridge, transformers; Python 3.12, megatron-core 0.19).

    from megatron_tree import bridge as tb

    hf, provider = tb.hf_provider("Qwen/Qwen3-8B", tensor_model_parallel_size=2)   # or:
    provider = tb.tree_provider(AutoBridge.from_hf_pretrained(path).to_megatron_provider())
    model = provider.provide_distributed_model(wrap_with_ddp=False)   # HF weights loaded (pre-wrap hook)
    ...train with tree microbatches...
    tb.save_hf_pretrained(hf, model, "out/")                            # back to a Hugging Face directory

- `tree_provider` (`provider`): the provider's own spec treeified, `TreeGPTModel` / `TreeMambaModel`
  built with its own arguments; settings that would undo the swap refused (`TreeProviderError`).
- `auto_bridge`, `register_tree_modules` (`mapping`): the Bridge's weight mapping knows the tree
  module classes, so ``load_hf_weights`` / ``save_hf_pretrained`` / ``export_hf_weights`` work on tree
  models at any TP / PP / EP; `load_hf_weights` also refuses a checkpoint that leaves a parameter
  unloaded (the Bridge only logs a warning and keeps the initial value).
- `cpu`: on a host without transformer-engine / CUDA, Megatron's local modules in place of the TE specs
  and the fused kernels off.
Importing this package imports nothing of the Bridge; the first call does.
"""
from .provider import TreeProviderError, check_tree_model, hf_provider, is_tree_provider, tree_provider
from .mapping import HFWeightsError, auto_bridge, load_hf_weights, register_tree_modules, save_hf_pretrained

__all__ = ["tree_provider", "hf_provider", "is_tree_provider", "check_tree_model", "TreeProviderError",
           "auto_bridge", "register_tree_modules", "load_hf_weights", "save_hf_pretrained", "HFWeightsError"]
