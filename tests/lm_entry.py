"""Test entry point for `megatron-tree launch` (not collected by pytest).

Runs the Megatron-LM entry point named by ``$MTREE_LM_SCRIPT`` as ``__main__`` and appends to
``$MTREE_LM_RECORD.<rank>.jsonl``, for every microbatch:

* ``{"kind": "data", "iteration", "sample_ids"}`` on every rank that reads tree data, when the
  schedule takes the microbatch (dataset line indices; padding microbatches have none; the ranks
  of one CP group read the same microbatch);
* ``{"kind": "loss", "iteration", "loss_sum", "num_tokens"}`` on every loss-computing rank
  (tensor-parallel rank 0 of the last stage; under CP each rank's share of the occurrences):
  Megatron-LM's printed "lm loss" is rounded to 7 digits and, in 0.19.x, averaged over the first
  two iterations after a (re)start; these are the exact per-iteration sums.

``iteration`` is the number Megatron-LM logs (``args.curr_iteration + 1``), ``attempt`` torchrun's
restart count (``TORCHELASTIC_RESTART_COUNT``: 0 until a rank dies under ``--max-restarts``).

``$MTREE_LM_ENOSPC=RANK:ITERATION`` (a planted fault): on that rank, in the first attempt, the
``torch.save`` of that iteration's checkpoint (``--ckpt-format torch``) writes some bytes and raises
ENOSPC, as on a disk that fills up.

``$MTREE_LM_PAUSE=RANK:ITERATION`` (so a test kills at a known iteration instead of racing the loop
by reading the log: an iteration takes tens of milliseconds here): on that rank, in the first
attempt, the first training microbatch of that iteration is not drawn; the rank prints ``rank RANK
(pid P) paused before iteration ITERATION`` and sleeps until it is killed.
"""
import json
import os
import runpy
import sys

from megatron_tree.training import megatron_lm as hooks


def _record(entry: dict) -> None:
    import torch.distributed as dist
    from megatron.training import get_args

    entry = dict(entry, iteration=int(getattr(get_args(), "curr_iteration", -1)) + 1,
                 attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))  # torchrun's in-place restarts
    with open(f"{os.environ['MTREE_LM_RECORD']}.{dist.get_rank()}.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


_next = hooks.MicrobatchStream.__next__
_loss_func = hooks.loss_func


def _pause_here(self) -> None:
    import time

    import torch.distributed as dist
    from megatron.training import get_args

    rank, iteration = map(int, os.environ["MTREE_LM_PAUSE"].split(":"))
    if self.name == "train" and dist.get_rank() == rank and int(get_args().curr_iteration) + 1 == iteration:
        print(f"rank {rank} (pid {os.getpid()}) paused before iteration {iteration}", flush=True)
        time.sleep(600)


def _recording_next(self):
    if _PAUSE:
        _pause_here(self)
    mb = _next(self)
    # --tree-carry hands carry items: a microbatch others read comes twice (fill and restore, or keep and release):
    # counted once
    if self.name == "train" and getattr(mb, "phase", "run") not in ("restore", "release"):
        _record({"kind": "data", "sample_ids": [int(i) for i in getattr(mb, "mb", mb).sample_ids]})
    return mb


def _recording_loss_func(loss_map, output_tensor, **kwargs):
    out = _loss_func(loss_map, output_tensor, **kwargs)
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_rank() == 0:
        _record({"kind": "loss", "loss_sum": float(out[0].detach()), "num_tokens": int(out[1])})
    return out


def _plant_enospc(rank: int, iteration: int) -> None:
    import errno

    import torch
    import torch.distributed as dist

    real = torch.save

    def save(obj, f, *args, **kwargs):
        if dist.get_rank() == rank and f"iter_{iteration:07d}" in str(f):
            with open(f, "wb") as out:
                out.write(b"\0" * 512)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real(obj, f, *args, **kwargs)

    torch.save = save


_PAUSE = bool(os.environ.get("MTREE_LM_PAUSE")) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
if os.environ.get("MTREE_LM_ENOSPC") and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    _plant_enospc(*map(int, os.environ["MTREE_LM_ENOSPC"].split(":")))
hooks.MicrobatchStream.__next__ = _recording_next
hooks.loss_func = _recording_loss_func
script = os.environ["MTREE_LM_SCRIPT"]
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
