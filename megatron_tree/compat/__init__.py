"""Explicit compatibility shims (never applied on import).

``megatron_tree.compat.cpu.enable()`` lets Megatron-Core 0.16.1 run on a CPU-only host with gloo
(tests, the demo); ``enable(kernels=True)`` also installs torch stand-ins for the GPU kernels of
Megatron's stock GatedDeltaNet and MambaMixer (``megatron_tree.compat.standins``).
"""
from megatron_tree.compat.cpu import applied, disable, enable, is_enabled, patch_module

__all__ = ["enable", "disable", "is_enabled", "applied", "patch_module"]
