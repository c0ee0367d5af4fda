"""Context parallelism, the execution: differentiable ops over the CP process group.

Each executor takes the rank's owned rows in `CPPlan.owner_rows(rank)` order and a plan from
`cp.planning`, issues every collective in an order fixed by the plan (so ranks with no rows still
enter each one), and returns exact per-sample results with autograd through the exchanges:
`attention.tree_attention_cp`, `dsa.tree_dsa_cp` (DeepSeek sparse attention), `gdn.tree_gdn_cp`
(Gated DeltaNet: summary or heads mode), `mamba.tree_mamba_cp` (Mamba-2: head transpose),
`redistribute.redistribute_rows` (hidden rows between two ownerships). `comm` holds the row-block
all-to-all they share.
"""
from .attention import attention_seconds, tree_attention_cp
from .dsa import tree_dsa_cp
from .gdn import default_gdn_cp_mode, tree_gdn_cp
from .mamba import tree_mamba_cp
from .redistribute import redistribute_rows

__all__ = ["tree_attention_cp", "attention_seconds", "tree_dsa_cp", "tree_gdn_cp", "default_gdn_cp_mode",
           "tree_mamba_cp", "redistribute_rows"]
