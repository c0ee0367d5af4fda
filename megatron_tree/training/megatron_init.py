"""Megatron-Core's process state inside one rank of a script: CPU shims, model-parallel groups, seeds.

For tools and tests that build models directly (`training.models`) on a process group that
`launch.run_distributed` (or torchrun) set up. The trainer, verify and score set up their own, since
each also reads its flags (DSA's CPU layer, world-size checks, seeds taken later).
"""
from __future__ import annotations

from typing import Any

import torch


def init_megatron(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, *, seed: int = 1234, kernels: bool = False,
                  **parallel_kwargs: Any):
    """Inside a rank: apply the CPU shims, initialise Megatron's model-parallel state and seed.

    Calls ``megatron_tree.cpu.enable(kernels=kernels)`` (nothing with CUDA), then
    ``parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
    pipeline_model_parallel_size=pp, context_parallel_size=cp, expert_model_parallel_size=ep,
    **parallel_kwargs)`` (DP is what remains of the world size), then
    ``model_parallel_cuda_manual_seed(seed)`` and ``torch.manual_seed(seed)``: every rank draws
    the same CPU weights, so ``use_cpu_initialization=True`` models match across layouts.
    Returns ``megatron.core.parallel_state``.
    """
    from ..cpu import megatron_core as cpu

    cpu.enable(kernels=kernels)  # before Megatron's SSM modules are imported (they import Triton ops)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp, expert_model_parallel_size=ep,
                                             **parallel_kwargs)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return parallel_state
