"""Tree-aware context parallelism, in two rooms:

- `cp.planning`: the plan (host, numpy, identical on every rank, never a collective):
  ``plan_context_parallel(layout, cp_size)`` chooses which CP rank owns which rows (`CPPlan`),
  the attention schedule, the recurrent layers' plans, the cost models and ``megatron-tree plan``'s
  reports;
- `cp.execution`: differentiable execution over the CP process group with such a plan:
  ``tree_attention_cp(q, k, v, plan, group)``, ``tree_dsa_cp``, ``tree_gdn_cp``, ``tree_mamba_cp``,
  ``redistribute_rows``.

Imports ``tree`` and ``ops`` only. The names below are exported lazily (PEP 562), so importing the
planning half never loads the execution half.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "CPPlan": "planning.plan", "plan_context_parallel": "planning.planner", "PlanCache": "planning.planner",
    "make_plan_fn": "planning.planner", "CostModel": "planning.cost_model", "DSAWork": "planning.cost_model",
    "build_schedule": "planning.schedule", "CPSchedule": "planning.schedule", "schedule_figures": "planning.schedule",
    "GDNCostModel": "planning.gdn_plan", "GDNHeads": "planning.gdn_plan",
    "mamba_head_shards": "planning.mamba_heads", "mamba_exchange_figures": "planning.mamba_heads",
    "tree_attention_cp": "execution.attention", "attention_seconds": "execution.attention",
    "tree_dsa_cp": "execution.dsa", "tree_gdn_cp": "execution.gdn", "default_gdn_cp_mode": "execution.gdn",
    "tree_mamba_cp": "execution.mamba",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
