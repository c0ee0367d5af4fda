"""Data-parallel sharding of one step's microbatches: cost model, balanced assignment, padding.

Every DP rank packs the same window of samples and runs the same deterministic assignment, so all
ranks agree on who trains what without communicating (the ART lesson: never let ranks decide from
local state). Each rank receives the same number of microbatches — Megatron's schedules and the
gradient all-reduce expect it — and the slots left over are filled with *padding microbatches*: one
padding row (or a fixed shape), no samples, an empty `LossMap`, so they contribute exactly zero loss
and zero gradient while still entering every collective.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..tree.microbatch import TreeMicrobatch, padding_microbatch  # noqa: F401 (re-exported for the pipeline)

# Relative cost of one visible attention pair vs one row of token-local work. Per layer and token the
# projections + MLP cost about 24 h^2 FLOPs (QKVO 8h^2, MLP with 4h hidden 16h^2); one (q, k) pair costs
# about 4h (QK^T and PV). Ratio 4h / 24h^2 = 1 / (6h); the default assumes h = 4096.
DEFAULT_ATTENTION_COST = 1.0 / (6 * 4096)


def microbatch_cost(mb: TreeMicrobatch, attention_cost: float = DEFAULT_ATTENTION_COST) -> float:
    """Predicted compute of a microbatch: physical rows (padding included: it is computed) plus
    ``attention_cost`` x visible attention pairs of the tree."""
    return float(mb.num_rows) + attention_cost * float(mb.stats.tree_attention_pairs)


def balance(costs: Sequence[float], num_ranks: int, per_rank: int | None = None) -> list[list[int]]:
    """Assign items to ``num_ranks`` ranks, at most ``per_rank`` items each, minimising the largest load.

    Greedy LPT with a cardinality cap: items in decreasing cost (ties: lower index first) each go to
    the least-loaded rank that still has a free slot (ties: lower rank). ``per_rank`` defaults to
    ceil(len(costs) / num_ranks), the fewest slots that hold every item. Deterministic; returns, per
    rank, its item indices in ascending order. Raises ValueError when the items cannot fit.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    costs = np.asarray(costs, dtype=np.float64)
    n = len(costs)
    cap = -(-n // num_ranks) if per_rank is None else int(per_rank)
    if n > cap * num_ranks:
        raise ValueError(f"{n} microbatches do not fit {num_ranks} ranks x {cap} microbatches per rank")
    load = np.zeros(num_ranks)
    count = np.zeros(num_ranks, dtype=np.int64)
    owner = np.empty(n, dtype=np.int64)
    for i in np.lexsort((np.arange(n), -costs)).tolist():
        # Full ranks are priced out; argmin returns the first (lowest) rank among equal loads.
        r = int(np.argmin(np.where(count < cap, load, np.inf)))
        owner[i] = r
        load[r] += costs[i]
        count[r] += 1
    return [np.flatnonzero(owner == r).tolist() for r in range(num_ranks)]


