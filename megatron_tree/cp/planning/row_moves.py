"""Row moves between two CP ownerships of one microbatch, the host side: what each rank sends and
receives (`row_move`, pure numpy, cached per plan pair and rank) and the traffic of one move
(`redistribution_figures`). The differentiable move itself is `cp.execution.redistribute`.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .lru import lru_get
from .plan import CPPlan

__all__ = ["RowMove", "row_move", "check_pair", "redistribution_figures"]


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


def check_pair(src: CPPlan, dst: CPPlan) -> None:
    if not isinstance(src, CPPlan) or not isinstance(dst, CPPlan):
        raise TypeError(f"redistribution needs two CPPlans, got {type(src).__name__} and {type(dst).__name__}")
    if src.cp_size != dst.cp_size or src.num_rows != dst.num_rows:
        raise ValueError(f"redistribution needs two plans of one microbatch and one CP group: got cp_size "
                         f"{src.cp_size} / {dst.cp_size} and {src.num_rows} / {dst.num_rows} rows")


_CACHE: OrderedDict = OrderedDict()


def row_move(src: CPPlan, dst: CPPlan, rank: int) -> RowMove:
    """The `RowMove` of ``rank`` from ``src`` to ``dst`` ownership (cached per plan pair and rank)."""
    check_pair(src, dst)
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


def redistribution_figures(src: CPPlan, dst: CPPlan, row_bytes: int) -> dict:
    """Traffic of one `redistribute_rows` call (one direction, forward; backward moves the same).

    row_bytes    bytes of one row (hidden size x element size)
    Returns ``rows_moved`` (rows whose owner changes: they cross the network), ``bytes_moved``,
    ``max_rank_send_bytes`` / ``max_rank_recv_bytes`` (the busiest rank), ``fraction_moved``.
    """
    check_pair(src, dst)
    moved = src.owner != dst.owner
    cp = src.cp_size
    send = np.bincount(src.owner[moved], minlength=cp) * int(row_bytes)
    recv = np.bincount(dst.owner[moved], minlength=cp) * int(row_bytes)
    n_moved = int(moved.sum())
    return dict(rows_moved=n_moved, bytes_moved=n_moved * int(row_bytes), max_rank_send_bytes=int(send.max(initial=0)),
                max_rank_recv_bytes=int(recv.max(initial=0)), fraction_moved=n_moved / max(1, src.num_rows))
