"""megatron-tree: train Megatron-Core models on prefix trees with exact per-sample loss and gradients.

Layers (imports point down only): tree -> ops -> cp -> megatron -> training / data -> cli.
See docs/architecture.md.
"""
__version__ = "0.1.0"
