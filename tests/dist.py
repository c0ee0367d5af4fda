"""Run a test function on W gloo ranks on CPU.

    from tests.dist import run_distributed, init_megatron   # or: from dist import ...

    def _body(scale):                       # module level, so spawn can pickle it by name
        import torch.distributed as dist
        init_megatron(tp=2)                 # optional: compat shims + Megatron parallel state
        x = torch.full((2,), float(dist.get_rank()) * scale)
        dist.all_reduce(x)
        return x                            # anything torch.save can write

    def test_sum():
        results = run_distributed(_body, 2, 3.0)   # one result per rank, in rank order
        assert results[0].tolist() == [3.0, 3.0]

Each rank is a fresh process started by ``torch.multiprocessing`` with the spawn method, with one
torch/OpenMP thread (the test machine has 2 cores), the gloo process group initialised on a free
TCP port of 127.0.0.1, and ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` set. An
exception on any rank is re-raised here as ``DistributedError`` with that rank's traceback, and
the other ranks are ended; a run past ``timeout`` seconds is ended and raises ``TimeoutError``.
Spawning and importing Megatron costs a few seconds per run: batch several checks into one run.
"""
from __future__ import annotations

from typing import Any

import torch

# The harness itself lives in the package (``megatron-tree verify`` and the trainer spawn ranks too).
from megatron_tree.training.launch import DistributedError, run_distributed  # noqa: F401

__all__ = ["run_distributed", "init_megatron", "DistributedError"]


def init_megatron(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, *, seed: int = 1234, kernels: bool = False,
                  **parallel_kwargs: Any):
    """Inside a rank: apply the CPU shims, initialise Megatron's model-parallel state and seed.

    Calls ``megatron_tree.cpu.enable(kernels=kernels)``, then
    ``parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
    pipeline_model_parallel_size=pp, context_parallel_size=cp, expert_model_parallel_size=ep,
    **parallel_kwargs)`` (DP is what remains of the world size), then
    ``model_parallel_cuda_manual_seed(seed)`` and ``torch.manual_seed(seed)``: every rank draws
    the same CPU weights, so ``use_cpu_initialization=True`` models match across layouts.
    Returns ``megatron.core.parallel_state``.
    """
    from megatron_tree.cpu import megatron_core as cpu

    cpu.enable(kernels=kernels)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp, expert_model_parallel_size=ep,
                                             **parallel_kwargs)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return parallel_state
