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

import datetime
import os
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_distributed", "init_megatron", "DistributedError"]


class DistributedError(RuntimeError):
    """A rank raised; the message holds its rank and traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn: Callable, world_size: int, port: int, outdir: str, timeout: float, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=max(timeout, 1.0)))
        result = fn(*args)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException:
        # Written here because the parent prefers the first failing rank's own traceback over the
        # secondary errors of ranks that were waiting for it in a collective.
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        raise
    finally:
        _teardown()


def _teardown() -> None:
    try:
        import sys

        if "megatron.core.parallel_state" in sys.modules:
            sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
    except Exception:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


def _first_error(outdir: str, world_size: int) -> str | None:
    errors = []
    for rank in range(world_size):
        path = os.path.join(outdir, f"rank{rank}.err")
        if os.path.exists(path):
            with open(path) as f:
                stamp, _, text = f.read().partition("\n")
            errors.append((float(stamp), rank, text))
    if not errors:
        return None
    stamp, rank, text = min(errors)
    others = [r for _, r, _ in errors if r != rank]
    tail = f"\n(ranks {others} failed afterwards)" if others else ""
    return f"rank {rank} of {world_size} raised:\n{text}{tail}"


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` gloo ranks; return the per-rank results in rank order.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). Inside ``fn`` the
    default process group is initialised; ``dist.get_rank()`` tells the rank. Results travel
    back through ``torch.save``. Raises ``DistributedError`` (first failing rank's traceback) or
    ``TimeoutError``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    with tempfile.TemporaryDirectory(prefix="mtree_dist_") as outdir:
        ctx = mp.start_processes(_rank_main, args=(fn, world_size, _free_port(), outdir, timeout, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    if ctx.join(timeout=0.2):
                        break
                except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:  # a rank failed; start_processes ended the rest
                    raise DistributedError(_first_error(outdir, world_size) or str(exc)) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed run of {getattr(fn, '__name__', fn)!r} on {world_size} ranks "
                                       f"exceeded {timeout:.0f} s"
                                       + (f"\n{_first_error(outdir, world_size)}" if _first_error(outdir, world_size) else ""))
        finally:
            for p in ctx.processes:  # only our own children, by handle
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def init_megatron(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, *, seed: int = 1234, kernels: bool = False,
                  **parallel_kwargs: Any):
    """Inside a rank: apply the CPU shims, initialise Megatron's model-parallel state and seed.

    Calls ``megatron_tree.compat.cpu.enable(kernels=kernels)``, then
    ``parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
    pipeline_model_parallel_size=pp, context_parallel_size=cp, expert_model_parallel_size=ep,
    **parallel_kwargs)`` (DP is what remains of the world size), then
    ``model_parallel_cuda_manual_seed(seed)`` and ``torch.manual_seed(seed)``: every rank draws
    the same CPU weights, so ``use_cpu_initialization=True`` models match across layouts.
    Returns ``megatron.core.parallel_state``.
    """
    from megatron_tree.compat import cpu

    cpu.enable(kernels=kernels)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp, expert_model_parallel_size=ep,
                                             **parallel_kwargs)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return parallel_state
