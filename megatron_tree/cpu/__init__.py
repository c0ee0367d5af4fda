"""The CPU layer: what lets Megatron-Core and Megatron-LM run on a CPU-only host with gloo. Used by
the tests, the CPU demo / recipes and the launcher's CPU path, never by a GPU run (every ``enable``
returns False and changes nothing where CUDA is available). Nothing happens on import.

- `megatron_core`: Megatron-Core on CPU (``torch.cuda`` call sites, CUDA RNG tracker, p2p sync,
  sequence-parallel torch norm, ...); ``enable(kernels=True)`` also installs `standins`;
- `standins`: torch stand-ins for the GPU kernels stock GatedDeltaNet / MambaMixer import (FLA,
  mamba-ssm, Triton), calling our ops' torch references;
- `megatron_training`: Megatron-LM's ``megatron.training`` (``pretrain()``) on CPU, on top of
  `megatron_core`;
- `dsa`: the stock DSA module on CPU (torch Hadamard rotation, indexer-loss tracker device).

``megatron_tree.cpu.enable()`` is `megatron_core.enable`.
"""
from .megatron_core import applied, disable, enable, is_enabled, patch_module

__all__ = ["enable", "disable", "is_enabled", "applied", "patch_module"]
