"""The tree ``forward_step_func`` for Megatron-Core's pipeline schedules.

``get_forward_backward_func()(forward_step_func=partial(tree_forward_step, loss_type=...), ...)``
over an iterator of `TreeMicrobatch`es trains a `TreeGPTModel` on trees with any schedule (no
pipelining, 1F1B, interleaved): every stage reads the microbatch, because attention visibility,
recurrences and RoPE depths are needed in every layer.

Under context parallelism (``config.context_parallel_size > 1``) an item may be ``(mb, plan)``
with a `CPPlan` made ahead (the data pipeline's ``plan_fn``), or a bare microbatch, planned here
with ``cp_strategy``. Every CP rank then runs on its owned rows; the plan's hash is compared over
the CP group first, so ranks holding different plans stop with an error instead of hanging.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from ..cp import PlanCache
from .loss import tree_loss_func
from .packed_seq import context_parallel_view, tree_packed_seq_params

__all__ = ["tree_forward_step", "context_parallel_params", "check_same_plan"]

# Plans made here (microbatches that arrive without one), shared by the pipeline stages of a process.
_PLANS = PlanCache(maxsize=16)


def _config_and_cp_group(model):
    m = model
    while hasattr(m, "module"):  # DDP / Float16Module wrappers
        m = m.module
    cp_group = getattr(getattr(m, "pg_collection", None), "cp", None)
    if cp_group is None and m.config.context_parallel_size > 1:
        from megatron.core import parallel_state

        cp_group = parallel_state.get_context_parallel_group()
    return m.config, cp_group


def check_same_plan(plan, group) -> None:
    """Stop with a clear error unless every rank of ``group`` holds a plan with the same hash."""
    if group is None or dist.get_world_size(group) == 1:
        return
    h = torch.tensor([int(plan.hash, 16) & ((1 << 62) - 1)], dtype=torch.int64)
    lo, hi = h.clone(), h.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if int(lo) != int(hi):
        raise RuntimeError(f"CP rank {dist.get_rank(group)} holds CP plan {plan.hash} but another rank of its CP "
                           "group holds a different plan: every CP rank must plan the same microbatch with the same "
                           "strategy, cost model and chunk size")


def context_parallel_params(psp, model, *, plan=None, strategy: str = "balanced"):
    """This rank's view of a whole-microbatch `TreePackedSeqParams` under ``model``'s CP size.

    Without CP, ``psp`` itself. Otherwise ``plan`` (or, when None, the plan ``strategy`` makes on the
    host from the layout; every rank makes the same one), checked to be the same on every CP rank,
    then `packed_seq.context_parallel_view` padded to the TP size under sequence parallelism.
    """
    config, cp_group = _config_and_cp_group(model)
    cp = config.context_parallel_size
    if cp == 1:
        return psp
    if plan is None:
        layout = psp.layout if psp.layout.device.type == "cpu" else psp.layout.to("cpu")
        plan = _PLANS.get_or_plan(layout, cp, strategy=strategy)
    if plan.cp_size != cp:
        raise ValueError(f"the CP plan is for {plan.cp_size} ranks but context_parallel_size is {cp}")
    check_same_plan(plan, cp_group)
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return context_parallel_view(psp, plan, cp_group.rank(), pad_to_multiple_of=tp)


def tree_forward_step(data_iterator, model, *, loss_type: str = "sft", clip_eps: float = 0.2, clip_eps_high=None,
                      kl_coef: float = 0.0, device=None, cp_strategy: str = "balanced"):
    """Megatron ``forward_step_func`` for `TreeMicrobatch` iterators (every stage reads the batch)."""
    item = next(data_iterator)
    mb, plan = item if isinstance(item, tuple) else (item, None)
    dev = device if device is not None else next(model.parameters()).device
    psp = context_parallel_params(tree_packed_seq_params(mb, dev), model, plan=plan, strategy=cp_strategy)
    out = model(psp.input_ids.unsqueeze(0), psp.position_ids.unsqueeze(0), None, packed_seq_params=psp)
    return out, partial(tree_loss_func, psp.loss_map, loss_type=loss_type, clip_eps=clip_eps,
                        clip_eps_high=clip_eps_high, kl_coef=kl_coef)
