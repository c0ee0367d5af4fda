"""Differentiable row redistribution between two CP ownerships of one microbatch.

A hybrid model can keep two ownerships of the same rows: the attention planner's (balanced pair
counts) and a GDN-friendly one for "islands" of consecutive recurrent / token-local layers (chains
kept whole on few ranks, so the summary scan has little to do). At an island's entry every row's
hidden state moves from its attention owner to its GDN owner, at the exit back:

    y = redistribute_rows(x, src_plan, dst_plan, group)      # x [n_src (+pad), ...] -> y [n_dst (+pad), ...]

``x`` holds ``src_plan.owner_rows(rank)`` in local (ascending) order, optionally followed by
``src_padding`` padding rows; ``y`` holds ``dst_plan.owner_rows(rank)`` in local order followed by
``dst_padding`` zero rows. One ``all_to_all_single`` per call (`comm.fetch_rows`): a row whose owner
does not change stays on its rank (it is "sent" to itself, which moves no bytes). The move is a
permutation of the owned rows across the group, so its backward is the inverse permutation of the
gradients (the same all-to-all in reverse); padding rows get a zero gradient (they reach no loss).

Host-side index maps (`cp.planning.row_moves.row_move`) are pure numpy, built once per (plan pair,
rank) and cached.
Every rank of ``group`` must call `redistribute_rows` in the same order with the same plans (an
ordered collective); a rank that owns no rows still enters it.
"""
from __future__ import annotations

import torch

from ..planning.plan import CPPlan
from ..planning.row_moves import check_pair, row_move
from .comm import fetch_rows, group_rank

__all__ = ["redistribute_rows", "redistribution_count"]

# Test-only fault switch (None in normal use): "no_reorder" keeps the received rows in the order they
# arrive (grouped by source rank) instead of putting them into the destination's local order.
_FAULT = None

# Forward calls of `redistribute_rows` in this process (tests count island boundaries with it).
_CALLS = 0


def redistribution_count(reset: bool = False) -> int:
    """Number of `redistribute_rows` forward calls in this process so far (optionally reset to 0)."""
    global _CALLS
    n = _CALLS
    if reset:
        _CALLS = 0
    return n


def redistribute_rows(x: torch.Tensor, src: CPPlan, dst: CPPlan, group=None, *, src_padding: int = 0,
                      dst_padding: int = 0) -> torch.Tensor:
    """Move this rank's rows from ``src`` to ``dst`` ownership (autograd: gradients move back).

    x    [n_src + src_padding, ...] rows ``src.owner_rows(rank)`` in ascending order, then padding
    ->   [n_dst + dst_padding, ...] rows ``dst.owner_rows(rank)`` in ascending order, then zero rows

    Exact (a permutation of rows across the group): row ``r`` of the output equals row ``r`` of the
    input on whichever rank owned it. Every rank of ``group`` must call it with the same plans.
    """
    global _CALLS
    check_pair(src, dst)
    rank = group_rank(src, group, "redistribute_rows") if src.cp_size > 1 else 0
    mv = row_move(src, dst, rank)
    if x.shape[0] != mv.n_src + src_padding:
        raise ValueError(f"redistribute_rows: rank {rank} owns {mv.n_src} rows under the source plan (+ {src_padding} "
                         f"padding) but the input has {x.shape[0]} rows")
    _CALLS += 1
    dev = x.device
    owned = x[: mv.n_src] if src_padding else x
    if src.cp_size == 1:
        got = owned.index_select(0, torch.from_numpy(mv.send_local).to(dev))
    else:
        got = fetch_rows(owned, torch.from_numpy(mv.send_local).to(dev), mv.send_splits, mv.recv_splits, group)
    if _FAULT != "no_reorder":
        got = got.index_select(0, torch.from_numpy(mv.recv_order).to(dev))
    if dst_padding:
        got = torch.cat([got, got.new_zeros((dst_padding,) + tuple(got.shape[1:]))])
    return got
