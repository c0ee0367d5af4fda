"""Run a function on W local ranks: gloo on CPU, NCCL with one GPU per rank when there are enough.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh processes (spawn method, one
torch/OpenMP thread each), initialises the default process group on a free 127.0.0.1 port, calls
``fn(*args)`` on every rank and returns the per-rank results in rank order. An exception on any
rank is re-raised as ``DistributedError`` with the first failing rank's traceback; a run past
``timeout`` seconds raises ``TimeoutError``. Used by ``megatron-tree verify``, the CPU demo and
the tests (multi-node jobs use torchrun/srun instead).
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

__all__ = ["run_distributed", "DistributedError"]


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
        backend = "gloo"
        if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
            torch.cuda.set_device(rank)
            backend = "nccl"
        dist.init_process_group(backend, rank=rank, world_size=world_size,
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


