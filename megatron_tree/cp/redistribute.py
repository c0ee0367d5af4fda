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

Host-side index maps (`row_move`) are pure numpy, built once per (plan pair, rank) and cached.
Every rank of ``group`` must call `redistribute_rows` in the same order with the same plans (an
ordered collective); a rank that owns no rows still enters it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .comm import fetch_rows, group_rank
from .lru import lru_get
from .plan import CPPlan

__all__ = ["RowMove", "row_move", "redistribute_rows", "redistribution_figures", "redistribution_count"]

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


@dataclass(frozen=True)
class RowMove:
    """What one rank does to move its rows from ``src`` ownership to ``dst`` ownership.

    n_src, n_dst  rows this rank owns under src / dst
    send_local    [n_src] int64 local (src order) index of each sent row, grouped by destination
                  rank, ascending global row within a destination
    send_splits   [cp] rows sent to each rank (including itself)
    recv_splits   [cp] rows received from each rank (including itself)
    recv_order    [n_dst] int64: the k-th row in dst local order is the ``recv_order[k]``-th received
                  row (received rows come grouped by source, ascending global row within a source)
    """

    n_src: int
    n_dst: int
    send_local: np.ndarray
    send_splits: tuple
    recv_splits: tuple
    recv_order: np.ndarray


def _check_pair(src: CPPlan, dst: CPPlan) -> None:
    if not isinstance(src, CPPlan) or not isinstance(dst, CPPlan):
        raise TypeError(f"redistribution needs two CPPlans, got {type(src).__name__} and {type(dst).__name__}")
    if src.cp_size != dst.cp_size or src.num_rows != dst.num_rows:
        raise ValueError(f"redistribution needs two plans of one microbatch and one CP group: got cp_size "
                         f"{src.cp_size} / {dst.cp_size} and {src.num_rows} / {dst.num_rows} rows")


_CACHE: OrderedDict = OrderedDict()


def row_move(src: CPPlan, dst: CPPlan, rank: int) -> RowMove:
    """The `RowMove` of ``rank`` from ``src`` to ``dst`` ownership (cached per plan pair and rank)."""
    _check_pair(src, dst)
    return lru_get(_CACHE, (src.hash, dst.hash, int(rank)), lambda: _row_move(src, dst, rank), 256)


def _row_move(src: CPPlan, dst: CPPlan, rank: int) -> RowMove:
    cp = src.cp_size
    src_rows, dst_rows = src.owner_rows(rank), dst.owner_rows(rank)
    dest = dst.owner[src_rows].astype(np.int64)
    # stable sort: within one destination the rows stay in ascending global order, which is also
    # the order the destination expects them in from this source
    send_local = np.argsort(dest, kind="stable").astype(np.int64)
    source = src.owner[dst_rows].astype(np.int64)
    by_source = np.argsort(source, kind="stable")  # received position k holds dst_rows[by_source[k]]
    recv_order = np.empty_like(by_source)
    recv_order[by_source] = np.arange(by_source.shape[0])
    return RowMove(int(src_rows.shape[0]), int(dst_rows.shape[0]), send_local,
                   tuple(int(c) for c in np.bincount(dest, minlength=cp)),
                   tuple(int(c) for c in np.bincount(source, minlength=cp)), recv_order.astype(np.int64))


def redistribute_rows(x: torch.Tensor, src: CPPlan, dst: CPPlan, group=None, *, src_padding: int = 0,
                      dst_padding: int = 0) -> torch.Tensor:
    """Move this rank's rows from ``src`` to ``dst`` ownership (autograd: gradients move back).

    x    [n_src + src_padding, ...] rows ``src.owner_rows(rank)`` in ascending order, then padding
    ->   [n_dst + dst_padding, ...] rows ``dst.owner_rows(rank)`` in ascending order, then zero rows

    Exact (a permutation of rows across the group): row ``r`` of the output equals row ``r`` of the
    input on whichever rank owned it. Every rank of ``group`` must call it with the same plans.
    """
    global _CALLS
    _check_pair(src, dst)
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


def redistribution_figures(src: CPPlan, dst: CPPlan, row_bytes: int) -> dict:
    """Traffic of one `redistribute_rows` call (one direction, forward; backward moves the same).

    row_bytes    bytes of one row (hidden size x element size)
    Returns ``rows_moved`` (rows whose owner changes: they cross the network), ``bytes_moved``,
    ``max_rank_send_bytes`` / ``max_rank_recv_bytes`` (the busiest rank), ``fraction_moved``.
    """
    _check_pair(src, dst)
    moved = src.owner != dst.owner
    cp = src.cp_size
    send = np.bincount(src.owner[moved], minlength=cp) * int(row_bytes)
    recv = np.bincount(dst.owner[moved], minlength=cp) * int(row_bytes)
    n_moved = int(moved.sum())
    return dict(rows_moved=n_moved, bytes_moved=n_moved * int(row_bytes), max_rank_send_bytes=int(send.max(initial=0)),
                max_rank_recv_bytes=int(recv.max(initial=0)), fraction_moved=n_moved / max(1, src.num_rows))
