"""The KV schedule of one CP rank under a `CPPlan`: which remote rows it fetches, in which wave, and
the all-to-all split sizes that move them.

Everything here is host-side numpy derived from the plan alone, so every rank computes the same
global picture: what each rank needs (its queries' visible remote keys), how each rank's needs are
cut into waves, and therefore what each rank must send to every other rank in every wave.

Needs. Key row ``k`` (owned by ``s``) is needed by rank ``r != s`` iff some row ``q`` owned by ``r``
sees it: ``k <= q < visible_until[k]`` and, with a sliding window ``w``,
``position_ids[q] - position_ids[k] < w``. ``r``'s owned rows inside ``[k, visible_until[k])`` are a
contiguous run of its local order (two binary searches in its owned rows); without a window ``k``
is needed iff that run is not empty, with a window iff its smallest depth is
``< position_ids[k] + w`` (a range-minimum query on a sparse table of ``r``'s owned depths). So a
windowed layer fetches only rows inside its window. The tests are made per *group* of keys that
share an owner run, a ``visible_until`` and consecutive depths (`_key_groups`), not per key.

Waves (the rule stated in `CPPlan`): rank ``r``'s needed remote rows, sorted by global row, are cut
into ``num_waves`` contiguous parts of near-equal size (``np.array_split``: the first
``n % num_waves`` parts hold one row more). A wave may be empty on some ranks; every rank still
enters every wave's collective (a wave that moves no row on any rank is skipped by all ranks alike,
which the plan lets each of them know).

Buffers. In wave ``w`` rank ``r`` receives, from each source ``s`` in rank order, the rows of its
wave that ``s`` owns, ascending; that is the order of ``all_to_all_single``'s output. The executor
reorders the received block to ascending global row (``sorted_from_recv``) once, and the backward
pass sends gradients back in receive order (``recv_order``). Symmetrically ``send_local`` holds,
per destination in rank order, the *local* indices (into ``plan.owner_rows(rank)``) of the rows
this rank owns that the destination needs in wave ``w``.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .lru import lru_get
from .plan import CPPlan

__all__ = ["CPSchedule", "WaveSchedule", "build_schedule", "remote_needs", "schedule_figures"]

# Plans are immutable and identified by their hash; a handful of recent ones is all a training step
# touches (one microbatch's plan, plus the next one being prepared).
_CACHE_SIZE = 16
_needs_cache: OrderedDict = OrderedDict()
_schedule_cache: OrderedDict = OrderedDict()


@dataclass(frozen=True, eq=False)
class WaveSchedule:
    """One wave of one rank (all index arrays int64 numpy).

    rows              [m] global rows this rank fetches in the wave, ascending
    recv_splits       [cp] rows received from each source rank (sum m)
    recv_order        [m] receive-buffer slot i holds ``rows[recv_order[i]]``
    sorted_from_recv  [m] inverse of ``recv_order``: ``buffer[sorted_from_recv]`` is in ``rows`` order
    send_local        [n_send] local indices (into the rank's owned rows) sent, grouped by destination
    send_splits       [cp] rows sent to each destination rank (sum n_send)
    global_rows       rows moved by all ranks together in this wave (0: every rank skips it)
    visible_until     [m] the plan's ``visible_until`` of ``rows``
    position_ids      [m] the plan's depths of ``rows``
    """

    rows: np.ndarray
    recv_splits: tuple
    recv_order: np.ndarray
    sorted_from_recv: np.ndarray
    send_local: np.ndarray
    send_splits: tuple
    global_rows: int
    visible_until: np.ndarray
    position_ids: np.ndarray


@dataclass(frozen=True, eq=False)
class CPSchedule:
    """The attention KV schedule of ``rank`` under one plan (and one window).

    owned                 [n_local] global rows owned by the rank (its local order, ascending)
    owned_visible_until   [n_local] and ``owned_position_ids`` [n_local]: the plan's arrays at ``owned``
    waves                 ``plan.num_waves`` `WaveSchedule`s
    remote_rows_total     rows this rank fetches over all waves (each remote row once)
    remote_rows_peak      the largest wave: remote KV rows a wave brings in at once
    sent_rows_total       rows this rank sends over all waves
    """

    plan_hash: str
    rank: int
    cp_size: int
    window: int | None
    owned: np.ndarray
    owned_visible_until: np.ndarray
    owned_position_ids: np.ndarray
    waves: tuple
    remote_rows_total: int
    remote_rows_peak: int
    sent_rows_total: int
    # device copies of the index arrays, filled lazily by `device_indices` (host -> device once)
    _device: dict = field(default_factory=dict, repr=False)

    @property
    def num_waves(self) -> int:
        return len(self.waves)

    def device_indices(self, device):
        """The schedule's arrays as int64 tensors on ``device``, cached (host -> device once): a dict
        with ``owned``, ``owned_visible_until``, ``owned_position_ids`` and ``waves``, one dict per
        wave with ``rows``, ``visible_until``, ``position_ids``, ``send_local``,
        ``sorted_from_recv``, ``recv_order``."""
        import torch

        key = str(device)
        if key not in self._device:
            def t(a):
                return torch.as_tensor(a, dtype=torch.int64).to(device)

            self._device[key] = {
                "owned": t(self.owned),
                "owned_visible_until": t(self.owned_visible_until),
                "owned_position_ids": t(self.owned_position_ids),
                "waves": tuple({"rows": t(w.rows), "visible_until": t(w.visible_until),
                                "position_ids": t(w.position_ids), "send_local": t(w.send_local),
                                "sorted_from_recv": t(w.sorted_from_recv), "recv_order": t(w.recv_order)}
                               for w in self.waves),
            }
        return self._device[key]


# ---------------------------------------------------------------------------------------- needs
def _sparse_table_min(a: np.ndarray) -> list:
    """Levels of a range-minimum sparse table: level j holds min(a[i : i + 2**j])."""
    levels = [a]
    j = 1
    while (1 << j) <= a.shape[0]:
        prev = levels[-1]
        half = 1 << (j - 1)
        levels.append(np.minimum(prev[:-half], prev[half:]))
        j += 1
    return levels


def _range_min(levels: list, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """min(a[lo:hi]) for each (lo, hi) with hi > lo (vectorised)."""
    length = hi - lo
    j = np.floor(np.log2(length)).astype(np.int64)
    # float log2 of an exact power of two is exact; guard the other direction anyway
    j -= (1 << j) > length
    out = np.empty(lo.shape[0], dtype=levels[0].dtype)
    for lev in np.unique(j):
        sel = j == lev
        table = levels[lev]
        out[sel] = np.minimum(table[lo[sel]], table[hi[sel] - (1 << lev)])
    return out


def _key_groups(plan: CPPlan) -> dict:
    """The keys that another rank than their owner may see, as maximal row ranges ("groups").

    A key ``k`` inside a run of rows of one owner is seen by another rank only through rows at or
    after the run's end ``e``: it is a candidate iff ``visible_until[k] > e`` (with chunked
    ownership most keys are not). Consecutive candidates with one run, one ``visible_until`` and
    consecutive depths form a group ``[start, stop)``: every rank's owned rows that may see them are
    the same (those in ``[e, visible_until)``), and a window cuts a group to a suffix. So the
    per-rank work is per group, not per key. Returns int64 arrays ``start``, ``stop``, ``owner``,
    ``seen_from`` (= e), ``visible_until``, ``depth`` (of ``start``).
    """
    owner, vu, pos = plan.owner, plan.visible_until, plan.position_ids
    n = owner.shape[0]
    empty = np.zeros(0, dtype=np.int64)
    if n == 0:
        return dict(start=empty, stop=empty, owner=empty, seen_from=empty, visible_until=empty, depth=empty)
    run_start = np.flatnonzero(np.concatenate([[True], owner[1:] != owner[:-1]]))
    bounds = np.concatenate([run_start, [n]])
    run_end = np.repeat(bounds[1:], np.diff(bounds))
    cand = np.flatnonzero(vu > run_end)
    if cand.shape[0] == 0:
        return dict(start=empty, stop=empty, owner=empty, seen_from=empty, visible_until=empty, depth=empty)
    prev, cur = cand[:-1], cand[1:]
    brk = np.concatenate([[True], (cur != prev + 1) | (run_end[cur] != run_end[prev]) | (vu[cur] != vu[prev])
                          | (pos[cur] != pos[prev] + 1)])
    first = np.flatnonzero(brk)
    last = np.concatenate([first[1:], [cand.shape[0]]]) - 1
    start = cand[first]
    return dict(start=start.astype(np.int64), stop=(cand[last] + 1).astype(np.int64),
                owner=owner[start].astype(np.int64), seen_from=run_end[start].astype(np.int64),
                visible_until=vu[start].astype(np.int64), depth=pos[start].astype(np.int64))


def _concat_ranges(start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(start[i], stop[i])`` (vectorised)."""
    lengths = stop - start
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(start - offsets, lengths) + np.arange(total, dtype=np.int64)


def _needs_of_rank(plan: CPPlan, rank: int, window: int | None, groups: dict) -> np.ndarray:
    """Ascending global rows not owned by ``rank`` that some query of ``rank`` sees."""
    owned = plan.owner_rows(rank)
    sel = groups["owner"] != rank
    if owned.shape[0] == 0 or not sel.any():
        return np.zeros(0, dtype=np.int64)
    start, stop = groups["start"][sel], groups["stop"][sel]
    # r's owned rows that may see the group are its local positions lo .. hi - 1
    lo = np.searchsorted(owned, groups["seen_from"][sel])
    hi = np.searchsorted(owned, groups["visible_until"][sel])
    hit = hi > lo
    if window is not None and hit.any():
        # the shallowest such row q sees the keys with depth > depth[q] - window: a suffix of the group
        levels = _sparse_table_min(plan.position_ids[owned])
        sub = np.flatnonzero(hit)
        shallowest = _range_min(levels, lo[sub], hi[sub])
        start = start.copy()
        start[sub] = np.maximum(start[sub], start[sub] + shallowest - window + 1 - groups["depth"][sel][sub])
        hit &= start < stop
    return _concat_ranges(start[hit], stop[hit])


def remote_needs(plan: CPPlan, window: int | None = None) -> tuple:
    """Per rank (tuple of cp_size arrays): ascending global rows it must fetch from other ranks.

    Cached per (plan hash, window). Vectorised numpy: O(N) once for the key groups
    (`_key_groups`), then per rank O(G log n_r) for G groups plus its output, and with a window
    a range-minimum sparse table of its owned depths.
    """
    window = None if window is None else int(window)
    def make():
        groups = _key_groups(plan)
        return tuple(_needs_of_rank(plan, r, window, groups) for r in range(plan.cp_size))

    return lru_get(_needs_cache, (plan.hash, window), make, _CACHE_SIZE)


def _wave_bounds(m: int, num_waves: int) -> np.ndarray:
    """[num_waves + 1] cut points of ``np.array_split(range(m), num_waves)``."""
    base, extra = divmod(m, num_waves)
    sizes = np.full(num_waves, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


# ---------------------------------------------------------------------------------------- schedule
def _make_schedule(plan: CPPlan, rank: int, window: int | None) -> CPSchedule:
    cp, nw = plan.cp_size, plan.num_waves
    needs = remote_needs(plan, window)
    owner = plan.owner
    owned = plan.owner_rows(rank)
    # local index of every global row within its owner's local order
    local_index = np.empty(plan.num_rows, dtype=np.int64)
    for r in range(cp):  # loop over ranks, not rows
        rows_r = plan.owner_rows(r)
        local_index[rows_r] = np.arange(rows_r.shape[0])
    bounds = [_wave_bounds(needs[r].shape[0], nw) for r in range(cp)]

    waves = []
    sent_total = 0
    for w in range(nw):
        # receive side: this rank's wave-w rows, grouped by source rank (stable: ascending within)
        rows = needs[rank][bounds[rank][w]:bounds[rank][w + 1]]
        src = owner[rows]
        recv_order = np.argsort(src, kind="stable").astype(np.int64)
        sorted_from_recv = np.empty_like(recv_order)
        sorted_from_recv[recv_order] = np.arange(recv_order.shape[0])
        recv_splits = tuple(int(c) for c in np.bincount(src, minlength=cp))
        # send side: for every destination d (rank order), the rows of d's wave w that we own
        send_parts, send_splits = [], []
        global_rows = 0
        for d in range(cp):
            rows_d = needs[d][bounds[d][w]:bounds[d][w + 1]]
            global_rows += rows_d.shape[0]
            mine = rows_d[owner[rows_d] == rank] if d != rank else rows_d[:0]
            send_parts.append(local_index[mine])
            send_splits.append(int(mine.shape[0]))
        send_local = np.concatenate(send_parts).astype(np.int64) if send_parts else np.zeros(0, np.int64)
        sent_total += send_local.shape[0]
        waves.append(WaveSchedule(rows=rows.astype(np.int64), recv_splits=recv_splits, recv_order=recv_order,
                                  sorted_from_recv=sorted_from_recv, send_local=send_local,
                                  send_splits=tuple(send_splits), global_rows=int(global_rows),
                                  visible_until=plan.visible_until[rows].astype(np.int64),
                                  position_ids=plan.position_ids[rows].astype(np.int64)))
    sizes = [w.rows.shape[0] for w in waves]
    return CPSchedule(plan_hash=plan.hash, rank=rank, cp_size=cp, window=window, owned=owned,
                      owned_visible_until=plan.visible_until[owned].astype(np.int64),
                      owned_position_ids=plan.position_ids[owned].astype(np.int64), waves=tuple(waves),
                      remote_rows_total=int(sum(sizes)), remote_rows_peak=int(max(sizes)),
                      sent_rows_total=int(sent_total))


def build_schedule(plan: CPPlan, rank: int, *, window: int | None = None) -> CPSchedule:
    """The KV schedule of ``rank`` under ``plan`` (and a sliding ``window`` on depth, if any).

    Cached per (plan hash, rank, window): plans are immutable, and every attention layer of a
    microbatch (and its recomputation) reuses one schedule. Raises ValueError for a rank outside
    the plan's CP group or a window < 1.
    """
    if not 0 <= rank < plan.cp_size:
        raise ValueError(f"rank {rank} is outside the CP group of size {plan.cp_size}")
    if window is not None:
        if int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        window = int(window)
    return lru_get(_schedule_cache, (plan.hash, rank, window), lambda: _make_schedule(plan, rank, window),
                   _CACHE_SIZE)


def schedule_figures(plan: CPPlan, window: int | None = None) -> dict:
    """Per-rank KV traffic of a plan (numpy [cp_size] int64 arrays).

    ``remote_rows``: rows each rank fetches in total; ``peak_remote_rows``: its largest wave (the
    remote KV a wave brings in at once); ``sent_rows``: rows each rank sends in total.
    """
    needs = remote_needs(plan, window)
    cp, nw = plan.cp_size, plan.num_waves
    fetched = np.array([x.shape[0] for x in needs], dtype=np.int64)
    peak = np.array([int(np.diff(_wave_bounds(int(m), nw)).max()) for m in fetched], dtype=np.int64)
    sent = np.zeros(cp, dtype=np.int64)
    for x in needs:
        sent += np.bincount(plan.owner[x], minlength=cp)
    return {"remote_rows": fetched, "peak_remote_rows": peak, "sent_rows": sent}
