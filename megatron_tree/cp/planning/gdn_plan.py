"""Host-side plan of tree Gated DeltaNet under context parallelism (numpy, identical on every rank).

Derived from a `CPPlan`'s ownership and the `TreeLayout` alone, so every rank computes the same
structures and enters the same collectives. Two executions (`megatron_tree.cp.execution.gdn`):

**summary mode** (the state crosses ranks). A *piece* is a maximal run of consecutive rows of one
segment owned by one rank. Its *predecessor* is the piece whose final state it starts from: the
previous piece of its segment, or, at a segment start, the last piece of the parent segment
(``segment_parent``, as `ops.tree_gated_delta_rule`). An *entry* is a piece whose predecessor lives
on another rank; that predecessor is an *exit*. Cutting the cross-rank edges leaves each rank a
forest of *local trees*: an **anchored** tree starts at a true root (zero state) and is computed
at once; a **floating** tree starts at an entry whose state is not known yet. For each floating
tree the owner computes, from its own tokens, the affine map ``S_out = M S_in + E`` from the
entry's state to each exit's final state (`ops.gated_delta_rule_summary`, only on the pieces on a
path to an exit: ``upstream``). The entries form a forest too (entry ``e`` hangs off the entry
that roots its predecessor's local tree): ``X_e = M_x X_parent + E_x``; pointer doubling
composes it in ``ceil(log2(depth))`` rounds, each one row exchange per matrix kind. Then every
floating tree runs from its true entry state.

**heads mode** (the partition moves). An all-to-all turns token shards into value-head shards
(``HV / cp`` value heads and the key heads they read, for every row of the tree), the whole tree
runs on one device per head shard, an inverse all-to-all brings outputs home. Needs ``cp | HV``.

`gdn_cp_figures` prices both from the plan (bytes moved and recurrence work per rank) and
`choose_mode` picks the smaller predicted maximum over ranks.
"""
from __future__ import annotations

import functools
import json
import os
import weakref
from dataclasses import dataclass

import numpy as np

from ...tree.layout import TreeLayout
from .plan import CPPlan

__all__ = ["GDNHeads", "GDNCostModel", "gdn_cp_figures", "choose_mode", "gdn_pieces", "gdn_rank_plan",
           "gdn_heads_plan", "gdn_heads_plan_of_owner", "check_heads_mode", "heads_mode_fits", "MODES", "summary_terms",
           "heads_terms", "GDN_CPU_COST_JSON"]

MODES = ("auto", "summary", "heads")


# ------------------------------------------------------------------------------- row exchanges
@dataclass(frozen=True, eq=False)
class Transfer:
    """One all-to-all of table rows as one rank sees it.

    send_local   [s] int64 rows of this rank's table to send, grouped by destination rank
    send_splits  rows per destination;  recv_splits: rows per source
    recv_order   [m] int64: ``received.index_select(0, recv_order)`` lists the received rows in
                 ascending transfer id (the order the caller listed the transfers in)
    total        transfers over the whole group: 0 means every rank skips the collective
    """

    send_local: np.ndarray
    send_splits: tuple
    recv_splits: tuple
    recv_order: np.ndarray
    total: int

    @property
    def rows_sent(self) -> int:
        return int(self.send_local.shape[0])

    @property
    def rows_received(self) -> int:
        return int(self.recv_order.shape[0])


def _transfer(src_rank: np.ndarray, src_index: np.ndarray, dst_rank: np.ndarray, cp: int, rank: int) -> Transfer:
    """Transfers ``t`` (global list, id = position) move row ``src_index[t]`` of rank ``src_rank[t]``'s
    table to rank ``dst_rank[t]``. The view of ``rank``: what it sends, in destination-then-id order,
    and how to put what it receives (source-then-id order) into id order."""
    tid = np.arange(src_rank.shape[0])
    mine = tid[src_rank == rank]
    out = mine[np.lexsort((mine, dst_rank[mine]))]
    inc = tid[dst_rank == rank]
    inc = inc[np.lexsort((inc, src_rank[inc]))]
    return Transfer(send_local=src_index[out].astype(np.int64),
                    send_splits=tuple(int(x) for x in np.bincount(dst_rank[out], minlength=cp)),
                    recv_splits=tuple(int(x) for x in np.bincount(src_rank[inc], minlength=cp)),
                    recv_order=np.argsort(inc, kind="stable").astype(np.int64), total=int(tid.shape[0]))


def _local_positions(owner: np.ndarray, cp: int) -> np.ndarray:
    """[N] index of every row in its owner's local order (ascending global row)."""
    order = np.argsort(owner, kind="stable")
    first = np.searchsorted(owner[order], np.arange(cp))
    pos = np.empty_like(order)
    pos[order] = np.arange(order.shape[0]) - first[owner[order]]
    return pos


def _forest_roots(parent: np.ndarray) -> np.ndarray:
    """Root of every node of a forest given by ``parent`` (-1 at roots), by pointer doubling."""
    anc = np.where(parent >= 0, parent, np.arange(parent.shape[0]))
    while True:
        nxt = anc[anc]
        if np.array_equal(nxt, anc):
            return anc
        anc = nxt


# ------------------------------------------------------------------------------- pieces (global)
@dataclass(frozen=True, eq=False)
class GDNPieces:
    """The piece forest of one (plan, layout): every array indexed by piece id (ascending start row).

    start, length, owner    [P]  rows ``start:start+length`` of one segment, all on ``owner``
    pred                    [P]  piece whose final state this one starts from (-1: zero state)
    entry                   [P]  bool, pred lives on another rank (the state crosses ranks)
    exit                    [P]  bool, some entry starts from this piece's final state
    local_root              [P]  root of the piece's local tree (cross-rank edges cut)
    floating                [P]  bool, the local root is an entry (unknown incoming state)
    upstream                [P]  bool, floating and on a local path to an exit: needs a summary
    segment_start           [P]  bool, the piece starts its segment
    entries                 [E]  piece ids of the entries (ascending)
    entry_parent            [E]  entry index the entry's state depends on, or -1 (known after init)
    rounds                  pointer-doubling rounds: (requesting entries, their targets, target
                                 not yet final) as entry indices; requesters ascending
    """

    cp_size: int
    num_rows: int
    start: np.ndarray
    length: np.ndarray
    owner: np.ndarray
    pred: np.ndarray
    entry: np.ndarray
    exit: np.ndarray
    local_root: np.ndarray
    floating: np.ndarray
    upstream: np.ndarray
    segment_start: np.ndarray
    entries: np.ndarray
    entry_parent: np.ndarray
    rounds: tuple

    @property
    def num_pieces(self) -> int:
        return int(self.start.shape[0])


def _build_pieces(owner: np.ndarray, offsets: np.ndarray, seg_parent: np.ndarray, visible_until: np.ndarray,
                  cp: int) -> GDNPieces:
    N = owner.shape[0]
    owner = owner.astype(np.int64)
    S = seg_parent.shape[0]
    is_start = np.zeros(N, bool)
    if N:
        is_start[offsets[:-1]] = True
        is_start[1:] |= owner[1:] != owner[:-1]
    start = np.flatnonzero(is_start)
    P = start.shape[0]
    length = np.diff(np.append(start, N))
    piece_of_row = np.cumsum(is_start) - 1
    seg_of_row = np.repeat(np.arange(S), np.diff(offsets))
    seg = seg_of_row[start]
    ps = seg_parent[seg]
    parent_last = piece_of_row[np.maximum(offsets[np.maximum(ps, 0) + 1] - 1, 0)] if P else np.zeros(0, np.int64)
    segment_start = start == offsets[seg]
    pred = np.where(segment_start, np.where(ps >= 0, parent_last, -1), np.arange(P) - 1)
    powner = owner[start]
    entry = (pred >= 0) & (powner[np.maximum(pred, 0)] != powner)
    local_root = _forest_roots(np.where(entry, -1, pred))
    floating = entry[local_root]
    exit_ = np.zeros(P, bool)
    exit_[pred[entry]] = True
    # upstream: floating p with a floating exit x of the same local tree in p's subtree range.
    upstream = np.zeros(P, bool)
    ex = np.flatnonzero(exit_ & floating)
    fl = np.flatnonzero(floating)
    if ex.size and fl.size:
        keys = np.sort(local_root[ex] * (N + 1) + start[ex])
        base = local_root[fl] * (N + 1)
        i = np.searchsorted(keys, base + start[fl])
        upstream[fl] = (i < keys.size) & (keys[np.minimum(i, keys.size - 1)] < base + visible_until[start[fl]])
    entries = np.flatnonzero(entry)
    index_of_entry = np.full(P, -1, np.int64)
    index_of_entry[entries] = np.arange(entries.size)
    src = pred[entries]
    entry_parent = np.where(floating[src], index_of_entry[local_root[src]], -1)
    rounds = []
    jump = entry_parent.copy()
    while (jump >= 0).any():
        req = np.flatnonzero(jump >= 0)
        tgt = jump[req]
        rounds.append((req, tgt, jump[tgt] >= 0))
        jump = np.where(jump >= 0, jump[np.maximum(jump, 0)], -1)
    return GDNPieces(cp_size=cp, num_rows=N, start=start, length=length, owner=powner, pred=pred, entry=entry,
                     exit=exit_, local_root=local_root, floating=floating, upstream=upstream,
                     segment_start=segment_start, entries=entries, entry_parent=entry_parent, rounds=tuple(rounds))


# ------------------------------------------------------------------------------- one rank's view
@dataclass(frozen=True, eq=False)
class ForestRun:
    """Arguments of one `ops.gated_delta_rule_forest` / `gated_delta_rule_summary` call (local rows)."""

    seg_start: np.ndarray
    seg_len: np.ndarray
    seg_parent: np.ndarray
    final: np.ndarray            # segments whose final state is kept
    initial_index: np.ndarray    # [S] entry-table row a root starts from (-1: zero)

    @property
    def rows(self) -> int:
        return int(self.seg_len.sum())


@dataclass(frozen=True, eq=False)
class Round:
    req: np.ndarray        # local entry indices updated this round (ascending)
    full: np.ndarray       # local entry indices whose map matrix is composed too
    states: Transfer       # the targets' B rows
    maps: Transfer         # the targets' A rows (targets not yet final)


@dataclass(frozen=True, eq=False)
class GDNRankPlan:
    """What rank ``rank`` runs in summary mode (all indices local: position in ``owner_rows``).

    anchored   local trees from the zero state: outputs, and final states of their exits
    summary    floating pieces upstream of an exit: ``[M | E]`` of the floating exits
    finish     every floating piece, roots starting from their entry state
    exit_order [X] row of ``cat(anchored finals, summary E)`` for each exit of this rank (piece order)
    init_states / init_maps   exit E rows / floating-exit M rows -> entries (entry order)
    init_maps_at  local entry indices that receive an M
    rounds     pointer doubling (global round count: every rank runs every round)
    """

    rank: int
    num_local: int
    num_entries: int
    anchored: ForestRun
    summary: ForestRun
    finish: ForestRun
    exit_order: np.ndarray
    init_states: Transfer
    init_maps: Transfer
    init_maps_at: np.ndarray
    rounds: tuple
    fault_zero_child: np.ndarray  # finish roots that start a segment (test-only fault "zero_child")


def _subset_run(pieces: GDNPieces, sel: np.ndarray, local_start: np.ndarray, final_mask: np.ndarray,
                initial: np.ndarray | None) -> ForestRun:
    """ForestRun of the pieces ``sel`` (ascending ids, closed under local parents)."""
    pos = np.full(pieces.num_pieces, -1, np.int64)
    pos[sel] = np.arange(sel.size)
    lp = np.where(pieces.entry[sel], -1, pieces.pred[sel])
    parent = np.where(lp >= 0, pos[np.maximum(lp, 0)], -1)
    return ForestRun(seg_start=local_start[sel], seg_len=pieces.length[sel], seg_parent=parent,
                     final=np.flatnonzero(final_mask[sel]),
                     initial_index=np.full(sel.size, -1, np.int64) if initial is None else initial)


def _build_rank_plan(pieces: GDNPieces, owner_rows: np.ndarray, rank: int) -> GDNRankPlan:
    cp, P = pieces.cp_size, pieces.num_pieces
    ids = np.arange(P)
    local_start = np.zeros(P, np.int64)
    mine = pieces.owner == rank
    local_start[mine] = np.searchsorted(owner_rows, pieces.start[mine])
    # exit tables: every exit's index among its owner's exits, and among its owner's floating exits
    ex = np.flatnonzero(pieces.exit)
    exit_idx = np.full(P, -1, np.int64)
    exit_idx[ex] = _rank_positions(pieces.owner[ex], cp)
    fex = ex[pieces.floating[ex]]
    fexit_idx = np.full(P, -1, np.int64)
    fexit_idx[fex] = _rank_positions(pieces.owner[fex], cp)
    ent = pieces.entries
    eowner = pieces.owner[ent]
    entry_idx = _rank_positions(eowner, cp)  # index of each entry in its owner's entry table

    anchored = _subset_run(pieces, ids[mine & ~pieces.floating], local_start, pieces.exit, None)
    summary = _subset_run(pieces, ids[mine & pieces.upstream], local_start, pieces.exit, None)
    fin_sel = ids[mine & pieces.floating]
    ent_pos = np.full(P, -1, np.int64)
    ent_pos[ent] = entry_idx
    finish = _subset_run(pieces, fin_sel, local_start, np.zeros(P, bool),
                         np.where(pieces.entry[fin_sel], ent_pos[fin_sel], -1))
    my_exits = ex[pieces.owner[ex] == rank]
    a_exits = my_exits[~pieces.floating[my_exits]]
    n_a = a_exits.size
    exit_order = np.where(pieces.floating[my_exits], n_a + fexit_idx[my_exits],
                          np.searchsorted(a_exits, my_exits))

    src = pieces.pred[ent]
    init_states = _transfer(pieces.owner[src], exit_idx[src], eowner, cp, rank)
    fsrc = pieces.floating[src]
    init_maps = _transfer(pieces.owner[src[fsrc]], fexit_idx[src[fsrc]], eowner[fsrc], cp, rank)
    init_maps_at = entry_idx[fsrc & (eowner == rank)]
    rounds = []
    for req, tgt, full in pieces.rounds:
        states = _transfer(eowner[tgt], entry_idx[tgt], eowner[req], cp, rank)
        maps = _transfer(eowner[tgt[full]], entry_idx[tgt[full]], eowner[req[full]], cp, rank)
        rounds.append(Round(req=entry_idx[req[eowner[req] == rank]],
                            full=entry_idx[req[full & (eowner[req] == rank)]], states=states, maps=maps))
    at_seg_start = pieces.entry[fin_sel] & pieces.segment_start[fin_sel]  # children of a remote parent
    return GDNRankPlan(rank=rank, num_local=int(owner_rows.shape[0]), num_entries=int((eowner == rank).sum()),
                       anchored=anchored, summary=summary, finish=finish, exit_order=exit_order.astype(np.int64),
                       init_states=init_states, init_maps=init_maps, init_maps_at=init_maps_at,
                       rounds=tuple(rounds), fault_zero_child=np.flatnonzero(at_seg_start))


def _rank_positions(ranks: np.ndarray, cp: int) -> np.ndarray:
    """For items listed in ascending id, each item's index among the items of the same rank."""
    order = np.argsort(ranks, kind="stable")
    first = np.searchsorted(ranks[order], np.arange(cp))
    pos = np.empty(ranks.shape[0], np.int64)
    pos[order] = np.arange(ranks.shape[0]) - first[ranks[order]]
    return pos


# ------------------------------------------------------------------------------- conv halos
@dataclass(frozen=True, eq=False)
class HaloPlan:
    """Conv taps of one rank. ``taps[k, i]`` ([W, n]) is the row of the extended input
    ``cat(local rows, fetched halo rows, one zero row)`` that multiplies ``weight[:, W-1-k]`` for
    local row ``i``: ``k`` steps back along ``path_prev`` (``k = 0`` is the row itself)."""

    taps: np.ndarray
    fetch: Transfer
    num_halo: int


@dataclass(frozen=True, eq=False)
class HaloGlobal:
    """Conv taps of every row (``taps [W, N]`` global rows, -1 before a root) and the rows that
    travel: ``dst[i]`` needs row ``h[i]`` (pairs unique, sorted by ``(dst, h)``)."""

    taps: np.ndarray
    dst: np.ndarray
    h: np.ndarray
    local: np.ndarray  # [N] position of every row in its owner's local order


def _halo_global(plan: CPPlan, path_prev: np.ndarray, width: int, physical: bool) -> HaloGlobal:
    owner = plan.owner.astype(np.int64)
    N = owner.shape[0]
    step = np.append(path_prev, -1)  # index N (= none) maps to none
    back = [np.arange(N)]
    for _ in range(1, width):
        back.append(step[np.where(back[-1] < 0, N, back[-1])])
    taps = np.stack(back)  # [W, N] global rows (-1: before a root)
    if physical:  # test-only fault: a remote tap reads the physical row k above instead of the path
        k = np.arange(width)[:, None]
        phys = np.arange(N)[None, :] - k
        remote = (taps >= 0) & (owner[np.maximum(taps, 0)] != owner[None, :])
        taps = np.where(remote, np.where(phys >= 0, phys, -1), taps)
    need = (taps >= 0) & (owner[np.maximum(taps, 0)] != owner[None, :])
    dst = np.broadcast_to(owner, taps.shape)[need]
    h = taps[need]
    key = np.unique(dst * (N + 1) + h)
    return HaloGlobal(taps=taps, dst=key // (N + 1), h=key % (N + 1), local=_local_positions(owner, plan.cp_size))


def _build_halo(plan: CPPlan, hg: HaloGlobal, rank: int) -> HaloPlan:
    owner = plan.owner.astype(np.int64)
    rows = plan.owner_rows(rank)
    n = rows.shape[0]
    taps, dst, h, local = hg.taps, hg.dst, hg.h, hg.local
    fetch = _transfer(owner[h], local[h], dst, plan.cp_size, rank)
    mine_h = h[dst == rank]  # ascending: the received halo rows in id order
    t = taps[:, rows]
    t_owner = owner[np.maximum(t, 0)]
    idx = np.where(t < 0, n + mine_h.size,
                   np.where(t_owner == rank, local[np.maximum(t, 0)], n + np.searchsorted(mine_h, t)))
    return HaloPlan(taps=idx.astype(np.int64), fetch=fetch, num_halo=int(mine_h.size))


# ------------------------------------------------------------------------------- heads mode
@dataclass(frozen=True)
class GDNHeads:
    """Head geometry of the GDN layer on this TP rank: ``H`` key heads, ``HV`` value heads."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_width: int

    def __post_init__(self):
        if min(self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim, self.conv_width) < 1:
            raise ValueError(f"GDNHeads: every size must be >= 1; got {self}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"value heads ({self.num_v_heads}) must be a multiple of key heads ({self.num_k_heads})")

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


@dataclass(frozen=True, eq=False)
class HeadsPlan:
    """Heads mode on one rank.

    qkv_cols  [cp, cq] conv-channel columns sent to each rank (padded with ``C``: a zero column)
    gb_cols   [cp, cg] columns of ``cat(g, beta)`` sent to each rank (padded with ``2 HV``)
    my_qkv    conv channels this rank convolves (= ``qkv_cols[rank]`` unpadded): q, k of key heads
              ``k_heads``, then v of value heads ``[rank*hv, (rank+1)*hv)``
    key_of_value  [hv] local key head each local value head reads, or None when the local heads
              already follow ``h // G`` (no expansion)
    rows_by_source  [N] global rows in receive order (owner_rows of rank 0, 1, ...)
    from_source     [N] position in receive order of every global row
    """

    hv: int
    k_heads: np.ndarray
    qkv_cols: np.ndarray
    gb_cols: np.ndarray
    my_qkv: np.ndarray
    key_of_value: np.ndarray | None
    rows_by_source: np.ndarray
    from_source: np.ndarray
    n_by_rank: tuple


def heads_mode_fits(heads: GDNHeads, cp: int) -> bool:
    """Heads mode splits a TP rank's value heads over the CP group: ``cp`` must divide them."""
    return heads.num_v_heads % cp == 0


def check_heads_mode(heads: GDNHeads, cp: int) -> None:
    if not heads_mode_fits(heads, cp):
        raise ValueError(f"GDN heads mode splits value heads over the CP group: the CP size ({cp}) must divide the "
                         f"value heads of this TP rank ({heads.num_v_heads}); use gdn_cp_mode='summary'")


def _build_heads(plan: CPPlan, heads: GDNHeads, rank: int) -> HeadsPlan:
    return gdn_heads_plan_of_owner(plan.owner, plan.cp_size, heads, rank)


def gdn_heads_plan_of_owner(owner: np.ndarray, cp: int, heads: GDNHeads, rank: int) -> HeadsPlan:
    """`HeadsPlan` of rank ``rank`` for the rows ``owner`` [N] gives to CP ranks (a plan's ``owner``,
    or under carry the own rows' part of it: the transposes then move only the rows a microbatch
    computes)."""
    check_heads_mode(heads, cp)
    H, HV, K, V = heads.num_k_heads, heads.num_v_heads, heads.head_k_dim, heads.head_v_dim
    G, hv, C = HV // H, HV // cp, heads.conv_channels
    qkv_cols, gb_cols, kh = [], [], []
    for j in range(cp):
        vh = np.arange(j * hv, (j + 1) * hv)
        keys = np.unique(vh // G)
        kc = (keys[:, None] * K + np.arange(K)).reshape(-1)
        vc = 2 * H * K + (vh[:, None] * V + np.arange(V)).reshape(-1)
        qkv_cols.append(np.concatenate([kc, H * K + kc, vc]))
        gb_cols.append(np.concatenate([vh, HV + vh]))
        kh.append(keys)
    cq = max(c.size for c in qkv_cols)
    pad = lambda cols, fill, w: np.stack([np.concatenate([c, np.full(w - c.size, fill)]) for c in cols])  # noqa: E731
    vh = np.arange(rank * hv, (rank + 1) * hv)
    keys = kh[rank]
    aligned = hv % G == 0  # then local value head i reads local key head i // G, as the op assumes
    key_of_value = None if aligned else (vh // G - keys[0]).astype(np.int64)
    owner = np.asarray(owner)
    rows_by_source = np.argsort(owner, kind="stable").astype(np.int64)  # each rank's rows, ascending, rank by rank
    from_source = np.empty_like(rows_by_source)
    from_source[rows_by_source] = np.arange(rows_by_source.shape[0])
    return HeadsPlan(hv=hv, k_heads=keys, qkv_cols=pad(qkv_cols, C, cq).astype(np.int64),
                     gb_cols=np.stack(gb_cols).astype(np.int64), my_qkv=qkv_cols[rank].astype(np.int64),
                     key_of_value=key_of_value, rows_by_source=rows_by_source, from_source=from_source,
                     n_by_rank=tuple(int(x) for x in np.bincount(owner, minlength=cp)))


# ------------------------------------------------------------------------------- caches
# Keyed on the layout object (one per microbatch, shared by every layer and by recomputation) and
# then on the plan's hash, so each layer call after the first reuses the host structures.
_CACHE: "weakref.WeakKeyDictionary[TreeLayout, dict]" = weakref.WeakKeyDictionary()


def _host(layout: TreeLayout, name: str) -> np.ndarray:
    """Layout field ``name`` as a host int64 array (the GDN planners' host work; gdn_layout shares it)."""
    return getattr(layout, name).detach().cpu().numpy().astype(np.int64)


def _cached(layout: TreeLayout, key, build):
    d = _CACHE.setdefault(layout, {})
    if key not in d:
        if len(d) > 64:  # a long-lived layout planned many ways: keep the cache bounded
            d.clear()
        d[key] = build()
    return d[key]


def _check(plan: CPPlan, layout: TreeLayout) -> None:
    if not isinstance(plan, CPPlan):
        raise TypeError(f"expected a CPPlan, got {type(plan).__name__}")
    if plan.num_rows != layout.num_rows:
        raise ValueError(f"the CP plan covers {plan.num_rows} rows but the layout has {layout.num_rows}")


def gdn_pieces(plan: CPPlan, layout: TreeLayout) -> GDNPieces:
    """The piece forest of ``plan`` on ``layout`` (cached per layout object and plan hash)."""
    _check(plan, layout)
    return _cached(layout, ("pieces", plan.hash), lambda: _build_pieces(
        plan.owner, _host(layout, "segment_offsets"), _host(layout, "segment_parent"),
        _host(layout, "visible_until"), plan.cp_size))


def gdn_rank_plan(plan: CPPlan, layout: TreeLayout, rank: int, conv_width: int, *, physical_halo: bool = False):
    """(GDNRankPlan, HaloPlan) of ``rank`` in summary mode (cached)."""
    pieces = gdn_pieces(plan, layout)
    rp = _cached(layout, ("rank", plan.hash, rank),
                 lambda: _build_rank_plan(pieces, plan.owner_rows(rank), rank))
    halo = _cached(layout, ("halo", plan.hash, rank, conv_width, physical_halo),
                   lambda: _build_halo(plan, _halo_plan_global(plan, layout, conv_width, physical_halo), rank))
    return rp, halo


def _halo_plan_global(plan: CPPlan, layout: TreeLayout, conv_width: int, physical: bool = False) -> HaloGlobal:
    return _cached(layout, ("halo_global", plan.hash, conv_width, physical),
                   lambda: _halo_global(plan, _host(layout, "path_prev"), conv_width, physical))


def gdn_heads_plan(plan: CPPlan, layout: TreeLayout, heads: GDNHeads, rank: int) -> HeadsPlan:
    _check(plan, layout)
    return _cached(layout, ("heads", plan.hash, rank, heads), lambda: _build_heads(plan, heads, rank))


# ------------------------------------------------------------------------------- cost
FIELDS = ("sec_per_flop", "sec_per_byte", "sec_per_collective", "sec_per_call")
GDN_CPU_COST_JSON = os.path.join(os.path.dirname(__file__), "gdn_cost_cpu.json")


@dataclass(frozen=True)
class GDNCostModel:
    """Predicted seconds of one GDN layer call (forward) per rank: ``flops * sec_per_flop +
    max(bytes sent, bytes received) * sec_per_byte + collectives * sec_per_collective + op calls *
    sec_per_call`` (op calls: the recurrence runs of the rank, anchored / summary / finish in
    summary mode, one in heads mode).

    Recurrence flops per row and value head with ``Vc`` state columns: ``8 K Vc`` (chunked form:
    intra-chunk solve, state products, output); conv: ``2 W`` per channel; a composition of two
    summaries: ``2 K K (K + V)`` per head. Defaults are rough H100 / NVLink figures; only ratios
    matter for the mode choice. `GDNCostModel.cpu` loads the coefficients fitted on this CPU by
    ``tools/bench_cp_gdn.py --calibrate`` (``gdn_cost_cpu.json``).
    """

    sec_per_flop: float = 1.0 / 100e12
    sec_per_byte: float = 1.0 / 100e9
    sec_per_collective: float = 20e-6
    sec_per_call: float = 0.0  # fixed cost of one recurrence op call (anchored / summary / finish run)

    def __post_init__(self):
        for k in FIELDS:
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise ValueError(f"GDNCostModel.{k} must be a finite number >= 0, got {v!r}")

    def seconds(self, flops, bytes_moved, collectives, calls=0):
        return (np.asarray(flops, float) * self.sec_per_flop + np.asarray(bytes_moved, float) * self.sec_per_byte
                + collectives * self.sec_per_collective + np.asarray(calls, float) * self.sec_per_call)

    @classmethod
    def from_json(cls, path: str) -> "GDNCostModel":
        """Coefficients from a JSON object holding field names (missing ones keep their default);
        other keys (fit metadata) are ignored."""
        with open(path) as f:
            d = json.load(f)
        return cls(**{k: float(d[k]) for k in FIELDS if k in d})

    @classmethod
    def cpu(cls) -> "GDNCostModel":
        """The CPU fit shipped as ``gdn_cost_cpu.json`` (default coefficients if it is missing)."""
        return cls.from_json(GDN_CPU_COST_JSON) if os.path.exists(GDN_CPU_COST_JSON) else cls()

    @classmethod
    def default(cls) -> "GDNCostModel":
        """GPU defaults when CUDA is available, else the CPU fit (equal on every rank of a job)."""
        import torch

        return cls() if torch.cuda.is_available() else cls.cpu()


def summary_terms(pieces: GDNPieces, rows: np.ndarray, heads: GDNHeads, halo_src: np.ndarray,
                  halo_dst: np.ndarray, *, act_bytes: int = 2, state_bytes: int = 4,
                  cost: GDNCostModel | None = None) -> dict:
    """Summary-mode work and bytes per rank from a piece forest (see `gdn_cp_figures`).

    rows      [cp] rows each rank owns;  halo_src / halo_dst: owner and destination rank of every
              conv halo row that travels (one entry per (row, destination) pair)
    """
    cost = cost or GDNCostModel()
    cp = pieces.cp_size
    K, V, HV, W, C = heads.head_k_dim, heads.head_v_dim, heads.num_v_heads, heads.conv_width, heads.conv_channels
    state_b, map_b = HV * K * V * state_bytes, HV * K * K * state_bytes
    keys = ("halo_rows", "state_rows", "map_rows")
    sent = {k: np.zeros(cp) for k in keys}
    recv = {k: np.zeros(cp) for k in keys}
    count = lambda r: np.bincount(r, minlength=cp).astype(float)  # noqa: E731

    def move(name, src, dst):  # a row a rank "sends" itself never travels
        far = src != dst
        sent[name] += count(src[far])
        recv[name] += count(dst[far])
        return int(src.size > 0)  # one collective when anything is listed (also self-moves)

    collectives = move("halo_rows", halo_src, halo_dst)
    ent, po = pieces.entries, pieces.owner
    src = pieces.pred[ent]
    fsrc = pieces.floating[src]
    collectives += move("state_rows", po[src], po[ent]) + move("map_rows", po[src[fsrc]], po[ent[fsrc]])
    comp = np.zeros(cp)
    for req, tgt, full in pieces.rounds:
        collectives += move("state_rows", po[ent[tgt]], po[ent[req]])
        collectives += move("map_rows", po[ent[tgt[full]]], po[ent[req[full]]])
        comp += count(po[ent[req]]) * 2 * K * K * V + count(po[ent[req[full]]]) * 2 * K * K * K
    rows = np.asarray(rows, float)
    sum_rows = np.bincount(po[pieces.upstream], weights=pieces.length[pieces.upstream], minlength=cp)
    unit = dict(halo_rows=C * act_bytes, state_rows=state_b, map_rows=map_b)
    flops = HV * (8 * K * V * rows + 8 * K * (K + V) * sum_rows) + HV * comp + 2 * W * C * rows
    bs = sum(sent[k] * unit[k] for k in keys)
    br = sum(recv[k] * unit[k] for k in keys)
    fl = pieces.floating
    calls = ((np.bincount(po[~fl], minlength=cp) > 0).astype(float) + (sum_rows > 0)
             + (np.bincount(po[fl], minlength=cp) > 0))  # anchored, summary and finish runs
    return dict(flops=flops, bytes_sent=bs, bytes_recv=br, collectives=collectives, calls=calls,
                seconds=cost.seconds(flops, np.maximum(bs, br), collectives, calls), rows=rows, summary_rows=sum_rows,
                rounds=len(pieces.rounds), **{k: sent[k] + recv[k] for k in keys})


@functools.lru_cache(maxsize=256)
def _heads_cols(H: int, HV: int, K: int, V: int, cp: int) -> int:
    """Most conv channels one rank convolves in heads mode (its key heads' q, k and its v)."""
    hv, G = HV // cp, HV // H
    return max(2 * (np.unique(np.arange(j * hv, (j + 1) * hv) // G).size) * K + hv * V for j in range(cp))


def heads_terms(rows: np.ndarray, heads: GDNHeads, *, act_bytes: int = 2, state_bytes: int = 4,
                cost: GDNCostModel | None = None) -> dict | None:
    """Heads-mode work and bytes per rank (``rows`` [cp] rows owned per rank); None when the CP
    size does not divide the value heads."""
    cost = cost or GDNCostModel()
    n = np.asarray(rows, float)
    cp = n.shape[0]
    H, HV, K, V, W = heads.num_k_heads, heads.num_v_heads, heads.head_k_dim, heads.head_v_dim, heads.conv_width
    if HV % cp:
        return None
    N = float(n.sum())
    hv = HV // cp
    cq = _heads_cols(H, HV, K, V, cp)
    row_in = cq * act_bytes + 2 * hv * state_bytes  # g, beta travel in fp32
    row_out = hv * V * act_bytes
    sent_h = n * (cp - 1) * row_in + (N - n) * row_out if cp > 1 else np.zeros(cp)
    recv_h = (N - n) * row_in + n * (cp - 1) * row_out if cp > 1 else np.zeros(cp)
    flops_h = np.full(cp, float(hv * 8 * K * V * N + 2 * W * cq * N))
    coll = 3 if cp > 1 else 0
    return dict(flops=flops_h, bytes_sent=sent_h, bytes_recv=recv_h, collectives=coll,
                seconds=cost.seconds(flops_h, np.maximum(sent_h, recv_h), coll, 1))


def gdn_cp_figures(plan: CPPlan, layout: TreeLayout, heads: GDNHeads, *, act_bytes: int = 2, state_bytes: int = 4,
                   cost: GDNCostModel | None = None) -> dict:
    """Per-rank work and bytes of one GDN layer (forward) in both modes, from the plan alone.

    Returns ``{"summary": {...}, "heads": {...} or None (cp does not divide HV)}``; each holds
    ``[cp]`` arrays ``flops``, ``bytes_sent``, ``bytes_recv`` and the predicted ``seconds``, plus
    ``collectives``; summary mode also ``halo_rows``, ``state_rows`` (parent / boundary states
    and E rows), ``map_rows`` (M / A matrices), ``rows``, ``summary_rows`` (rows run with ``K + V``
    state columns), ``rounds``. Backward moves the same bytes back.
    """
    pieces = gdn_pieces(plan, layout)
    hg = _halo_plan_global(plan, layout, heads.conv_width)
    n = plan.rows_per_rank()
    kw = dict(act_bytes=act_bytes, state_bytes=state_bytes, cost=cost)
    summ = summary_terms(pieces, n, heads, plan.owner.astype(np.int64)[hg.h], hg.dst, **kw)
    return {"summary": summ, "heads": heads_terms(n, heads, **kw)}


def choose_mode(plan: CPPlan, layout: TreeLayout, heads: GDNHeads, *, cost: GDNCostModel | None = None,
                act_bytes: int = 2, state_bytes: int = 4) -> str:
    """"summary" or "heads": the smaller predicted slowest rank (`gdn_cp_figures`); deterministic in
    the plan, the layout and the shapes, so every rank picks the same. Ties and ``cp ∤ HV``: summary."""
    key = ("choice", plan.hash, heads, cost, act_bytes, state_bytes)

    def pick():
        f = gdn_cp_figures(plan, layout, heads, act_bytes=act_bytes, state_bytes=state_bytes, cost=cost)
        if f["heads"] is None:
            return "summary"
        return "heads" if float(f["heads"]["seconds"].max()) < float(f["summary"]["seconds"].max()) else "summary"

    return _cached(layout, key, pick)
