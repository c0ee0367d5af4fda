"""Tree-aware context parallelism: the planner (pure CPU) and the executors (torch.distributed).

``plan_context_parallel(layout, cp_size)`` chooses which CP rank owns which rows (`CPPlan`);
``tree_attention_cp(q, k, v, plan, group)`` runs tree attention over the CP group with that plan.
Imports ``tree`` and ``ops`` only.
"""
from .plan import CPPlan

__all__ = ["CPPlan"]
from .attention import tree_attention_cp  # noqa: E402  (executor: cp/attention.py, cp/schedule.py, cp/comm.py)
from .schedule import CPSchedule, build_schedule, schedule_figures  # noqa: E402
__all__ += ["tree_attention_cp", "build_schedule", "CPSchedule", "schedule_figures"]
from .cost_model import CostModel  # noqa: E402  (planner: cp/planner.py, cp/pairs.py, cp/cost_model.py)
from .planner import PlanCache, make_plan_fn, plan_context_parallel  # noqa: E402
__all__ += ["plan_context_parallel", "CostModel", "PlanCache", "make_plan_fn"]
