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

Each rank is a fresh process started by ``torch.multiprocessing`` (a forkserver on CPU), with one
torch/OpenMP thread (the test machine has 2 cores), the gloo process group initialised on the TCP
store the launcher bound first (port 0, so no other run can take it; a world of one uses an
in-process store), and ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set. An
exception on any rank is re-raised here as ``DistributedError`` with that rank's traceback, and
the other ranks are ended; a run past ``timeout`` seconds is ended and raises ``TimeoutError``.
Spawning and importing Megatron costs a few seconds per run: batch several checks into one run.
"""
from __future__ import annotations

# Both live in the package: `megatron-tree verify` and the trainer spawn ranks too, and the tools set up ranks alike.
from megatron_tree.training.launch import DistributedError, run_distributed  # noqa: F401
from megatron_tree.training.megatron_init import init_megatron  # noqa: F401

__all__ = ["run_distributed", "init_megatron", "DistributedError"]
