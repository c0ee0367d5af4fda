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
import torch

from ..tree.layout import TreeLayout
from ..tree.loss_map import LossMap
from ..tree.microbatch import MicrobatchStats, TreeMicrobatch

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


def padding_microbatch(max_tokens_per_mb: int, *, num_rows: int = 1, pad_id: int = 0,
                       float_fields: Sequence[str] = ()) -> TreeMicrobatch:
    """A microbatch of ``num_rows`` padding rows and no samples: zero loss, zero gradient.

    Each padding row is its own one-row root segment (it sees only itself), so every op runs on it
    without special cases. The `LossMap` has M = 0 occurrences; ``float_fields`` names the optional
    per-occurrence fields ("advantages", "old_logprobs", "ref_logprobs") to create as empty float64
    tensors, so that the padding microbatch has the same fields as the real ones of the run.
    """
    if not 1 <= num_rows <= max_tokens_per_mb:
        raise ValueError(f"num_rows={num_rows} must lie in [1, max_tokens_per_mb={max_tokens_per_mb}]")
    layout = TreeLayout.from_segments(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                                      num_padding=num_rows, pad_id=pad_id)
    empty_l = lambda: torch.zeros(0, dtype=torch.int64)
    empty_f = lambda: torch.zeros(0, dtype=torch.float64)
    optional = {f: (empty_f() if f in float_fields else None) for f in ("advantages", "old_logprobs", "ref_logprobs")}
    unknown = set(float_fields) - set(optional)
    if unknown:
        raise ValueError(f"unknown loss-map fields {sorted(unknown)}")
    loss_map = LossMap(source_rows=empty_l(), targets=empty_l(), sample_index=empty_l(), positions=empty_l(),
                       weights=empty_f(), **optional)
    stats = MicrobatchStats(num_samples=0, num_trees=0, num_segments=0, num_targets=0, flat_tokens=0, tree_tokens=0,
                            padding_tokens=num_rows, flat_attention_pairs=0, tree_attention_pairs=0,
                            max_tokens_per_mb=max_tokens_per_mb)
    # TreeMicrobatch has no public "empty" constructor; its path fields are simply empty here.
    return TreeMicrobatch(layout=layout, loss_map=loss_map, sample_ids=(), stats=stats,
                          _path_rows=np.zeros(0, np.int64), _path_offsets=np.zeros(1, np.int64))
