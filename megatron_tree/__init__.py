"""megatron-tree: train Megatron-Core models on prefix trees with exact per-sample loss and gradients.

Layers (imports point down only): tree -> ops -> cp -> megatron -> data / cli. See DESIGN.md.
"""
__version__ = "0.1.0"
