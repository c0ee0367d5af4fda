"""Test entry point for `megatron-tree launch` (not collected by pytest).

Runs the Megatron-LM entry point named by ``$MTREE_LM_SCRIPT`` as ``__main__`` and records, on every
rank that computes the loss (last pipeline stage, tensor-parallel rank 0), each microbatch's
``(iteration, loss_sum, num_tokens)`` in ``$MTREE_LM_LOSSES.<rank>.jsonl``. Megatron-LM's printed
"lm loss" is rounded to 7 digits and, in 0.19.x, averaged over the first two iterations after a
(re)start; these records are the exact per-iteration sums.
"""
import json
import os
import runpy
import sys

from megatron_tree.training import megatron_lm as hooks

_loss_func = hooks.loss_func


def _recording_loss_func(loss_map, output_tensor, **kwargs):
    out = _loss_func(loss_map, output_tensor, **kwargs)
    from megatron.core import parallel_state as ps
    from megatron.training import get_args

    if ps.get_tensor_model_parallel_rank() == 0:
        import torch.distributed as dist

        it = int(getattr(get_args(), "curr_iteration", -1)) + 1  # the number Megatron-LM logs
        with open(f"{os.environ['MTREE_LM_LOSSES']}.{dist.get_rank()}.jsonl", "a") as f:
            f.write(json.dumps({"iteration": it, "loss_sum": float(out[0].detach()),
                                "num_tokens": int(out[1])}) + "\n")
    return out


hooks.loss_func = _recording_loss_func
script = os.environ["MTREE_LM_SCRIPT"]
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
