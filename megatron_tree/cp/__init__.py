"""Tree-aware context parallelism: the planner (pure CPU) and the executors (torch.distributed).

``plan_context_parallel(layout, cp_size)`` chooses which CP rank owns which rows (`CPPlan`);
``tree_attention_cp(q, k, v, plan, group)`` runs tree attention over the CP group with that plan,
``tree_gdn_cp`` and ``tree_mamba_cp`` the Gated DeltaNet and Mamba-2 sequence mixing, ``tree_dsa_cp``
DeepSeek Sparse Attention.
Imports ``tree`` and ``ops`` only.
"""
from .attention import attention_seconds, tree_attention_cp
from .cost_model import CostModel, DSAWork
from .dsa import tree_dsa_cp
from .gdn import GDNCostModel, GDNHeads, default_gdn_cp_mode, tree_gdn_cp
from .mamba import mamba_exchange_figures, mamba_head_shards, tree_mamba_cp
from .plan import CPPlan
from .planner import PlanCache, make_plan_fn, plan_context_parallel
from .schedule import CPSchedule, build_schedule, schedule_figures

__all__ = ["CPPlan", "plan_context_parallel", "CostModel", "PlanCache", "make_plan_fn",
           "tree_attention_cp", "attention_seconds", "build_schedule", "CPSchedule", "schedule_figures",
           "tree_gdn_cp", "GDNCostModel", "GDNHeads", "default_gdn_cp_mode",
           "tree_mamba_cp", "mamba_head_shards", "mamba_exchange_figures", "tree_dsa_cp", "DSAWork"]
