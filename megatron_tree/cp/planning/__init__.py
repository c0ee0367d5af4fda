"""Context parallelism, the plan: host-side and deterministic, numpy only, never a collective.

Every CP rank runs the same planning on the same layout and gets the same answer (`CPPlan.hash` is
compared over the group before a microbatch runs), so nothing here may depend on the rank's
process group: this package never imports ``torch.distributed`` nor `cp.execution`
(``tests/test_layers.py`` holds it to that).

- ownership: `plan.CPPlan` (which rank owns which rows), chosen by `planner.plan_context_parallel`
  over the visible pairs of `pairs`, priced by `evaluate` and `cost_model`;
- attention: `schedule.build_schedule` (which remote K/V rows a rank fetches, in which wave);
- recurrent layers: `gdn_plan` (Gated DeltaNet summary / heads modes), `gdn_layout` (island
  ownerships), `mamba_heads` (Mamba-2's head shards), `row_moves` (moves between two ownerships);
- reports: `capacity` (``megatron-tree plan``); `lru` bounds every per-plan cache.
"""
from .cost_model import CostModel, DSAWork
from .gdn_plan import GDNCostModel, GDNHeads
from .mamba_heads import MambaHeadShards, mamba_exchange_figures, mamba_head_shards
from .plan import CPPlan
from .planner import PlanCache, make_plan_fn, plan_context_parallel
from .schedule import CPSchedule, build_schedule, schedule_figures

__all__ = ["CPPlan", "plan_context_parallel", "CostModel", "DSAWork", "PlanCache", "make_plan_fn", "build_schedule",
           "CPSchedule", "schedule_figures", "GDNCostModel", "GDNHeads", "MambaHeadShards", "mamba_head_shards",
           "mamba_exchange_figures"]
