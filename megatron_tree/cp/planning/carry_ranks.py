"""Carry groups cut over data-parallel ranks: the schedule items of every rank and where carried state
and its gradient cross ranks (host side, numpy; every rank computes the same schedule).

`tree.carry.assign_carry_ranks` may put an exporting microbatch on rank q and a microbatch that reads its
rows on rank r. Then r needs q's exported state before its reader's forward, and q needs r's accumulated
gradient of that state before its restore (or release). Both cross at **syncs**: schedule positions that
are the same on every rank of the data-parallel group, where every rank runs the same collectives
(`cp.execution.carry.CarryStore.exchange`) at the start of that item, after every earlier item's
backward (no pipelining: each item's backward ends before the next forward):

* ``state`` of owner o: its rank broadcasts the exported rows' layer state (every layer, as its fill or
  keep wrote it); the ranks of o's readers keep a copy in their store and read it like local state;
* ``grad`` of owner o: the gradient accumulators the readers of o built on their ranks are summed onto
  o's rank (a reduce; a rank without readers adds zeros), before o's restore adds them to its backward.

`rank_schedule` simulates the ranks in lock step, one *tick* at a time: every rank runs its next item
that waits on nothing, or a padding item (a zero-loss microbatch) if none does, and a sync follows the
first tick after which something can cross, so every rank has the same items up to each sync. Each
rank's items keep the order one rank's carry needs within a group (`carry_phases`: forwards in step
order, then restores in reverse) and may interleave groups: a rank whose next item of one group waits
on a sync runs another group's (or a microbatch without carry) meanwhile. The same schedule gives each
rank its store lifetimes (`rank_lifetimes`) and a predicted step time (`schedule_ms`: between two syncs,
the slowest rank's items, plus each sync's transfers).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from .carry import WRITES, carry_lifetimes, carry_phases

__all__ = ["Transfer", "RankSchedule", "rank_schedule", "rank_lifetimes", "rank_store_timeline", "schedule_ms",
           "CarryWork", "split_step_ms", "plan_carry_ranks", "CarryRankPlan", "busy_balance", "PAD"]

#: the phase of a padding item (a zero-loss microbatch every rank runs so that the syncs line up)
PAD = "pad"


@dataclass(frozen=True)
class Transfer:
    """What crosses ranks at a sync. ``kind``: "state" (``src`` broadcasts owner ``owner``'s exported state;
    ``ranks`` keep it) or "grad" (the accumulators of ``ranks``' readers are summed onto ``src``, the owner's
    rank). ``owner``: `CarryInfo.index`."""

    kind: str
    owner: int
    src: int
    ranks: tuple


@dataclass
class RankSchedule:
    """Every data-parallel rank's schedule items and the syncs between them.

    items     per rank ``[(step index of the microbatch, phase)]``, the same length on every rank; phase
              `PAD` (index -1) for a padding item
    syncs     ``{position: [Transfer]}``: run at the start of item ``position`` on every rank
    rank_of   ``{step index: rank}`` of every microbatch
    """

    items: list
    syncs: dict
    rank_of: dict
    segments: list = field(default_factory=list)  # [(start, stop)] positions between syncs

    @property
    def num_items(self) -> int:
        return len(self.items[0]) if self.items else 0

    def with_keep(self, rank: int, keep) -> "RankSchedule":
        """This schedule with ``rank``'s exporters in ``keep`` (`CarryInfo.index`) run as keep / release instead of
        fill / restore (the same positions and syncs: a release waits on its readers' gradient as a restore does)."""
        if not keep:
            return self
        rename = {"fill": "keep", "restore": "release"}
        items = list(self.items)
        items[rank] = [(i, rename.get(p, p) if i in keep else p) for i, p in items[rank]]
        return dataclasses.replace(self, items=items)

    def num_pads(self, rank: int) -> int:
        """``rank``'s padding items."""
        return sum(p == PAD for _, p in self.items[rank])

    def padded(self, num_items: int) -> "RankSchedule":
        """This schedule with padding items at the end of every rank's up to ``num_items``."""
        extra = [(-1, PAD)] * (num_items - self.num_items)
        return dataclasses.replace(self, items=[x + extra for x in self.items])

    def cut_owners(self) -> list:
        """The owners whose state crosses ranks."""
        return sorted({t.owner for ts in self.syncs.values() for t in ts if t.kind == "state"})


def _reads(mb) -> tuple:
    info = getattr(mb, "carry", None)
    return info.reads_from if info is not None else ()


def rank_schedule(microbatches: list, ranks: list, keep=None) -> RankSchedule:
    """The lock-step schedule of ``microbatches`` (the whole step; ``microbatches[i].carry.index == i``) over the
    data-parallel ranks ``ranks`` (`tree.carry.assign_carry_ranks`: step indices per rank, step order).
    ``keep``: per rank, the exporters that keep their graph (`carry_phases`), or None."""
    n_ranks = len(ranks)
    rank_of = {i: r for r, idx in enumerate(ranks) for i in idx}
    if sorted(rank_of) != list(range(len(microbatches))):
        raise ValueError("rank_schedule: every microbatch of the step must be on exactly one rank")
    for i, mb in enumerate(microbatches):
        info = getattr(mb, "carry", None)
        if info is not None and info.index != i:
            raise ValueError(f"rank_schedule: microbatch {i} has carry index {info.index} (pass the step's microbatches "
                             "in pack order)")
    readers: dict = {}
    for i, mb in enumerate(microbatches):
        for o in _reads(mb):
            readers.setdefault(o, set()).add(rank_of[i])
    remote = {o: tuple(sorted(rs - {rank_of[o]})) for o, rs in readers.items() if rs - {rank_of[o]}}

    # per rank: its groups' item queues (carry_phases order within a group), microbatches without carry last
    queues = []
    for r, idx in enumerate(ranks):
        local = [microbatches[i] for i in idx]
        phases = carry_phases(local, keep=None if keep is None else keep[r], remote=True)
        qs: dict = {}
        for j, phase in phases:
            info = getattr(local[j], "carry", None)
            g = info.group if info is not None and info.group >= 0 else None
            qs.setdefault(("g", g) if g is not None else ("free",), []).append((idx[j], phase))
        queues.append([qs[k] for k in qs if k != ("free",)] + ([qs[("free",)]] if ("free",) in qs else []))
    # the last item on each rank whose backward builds gradient for a remote owner, in queue (= run) order: a
    # run, a restore, or a keep's release (a fill or keep runs no backward). Every reader of an owner is in the
    # owner's group, so one queue holds them all; the release must count where it runs, after later groups'
    # items, else the grad sync would precede it. With this, keep only renames phases: the items and syncs
    # equal those without keep (`RankSchedule.with_keep`).
    last_use: dict = {}
    for r, qs in enumerate(queues):
        for q in qs:
            for i, p in q:
                for o in (_reads(microbatches[i]) if p not in ("fill", "keep") else ()):
                    if o in remote and rank_of[o] != r:
                        last_use[(r, o)] = (i, p)
    done: list = [set() for _ in range(n_ranks)]  # (index, phase) finished per rank
    have: list = [set() for _ in range(n_ranks)]  # remote owners whose state this rank holds
    returned: set = set()  # owners whose readers' gradient came back
    sent: set = set()
    heads = [[0] * len(qs) for qs in queues]

    def blocked(r, i, phase) -> bool:
        if phase in ("restore", "release") and i in remote and i not in returned:
            return True
        return phase != "release" and any(rank_of[o] != r and o not in have[r] for o in _reads(microbatches[i]))

    def ready() -> list:
        out = []
        for o, rs in sorted(remote.items()):
            q = rank_of[o]
            if o not in sent and any((o, p) in done[q] for p in WRITES):
                out.append(Transfer("state", o, q, rs))
            elif o in sent and o not in returned and all(last_use[(r, o)] in done[r] for r in rs):
                out.append(Transfer("grad", o, q, rs))
        return out

    # one tick: every rank runs its next item that waits on nothing (a padding item if none does); a sync follows
    # the first tick after which something can cross
    items: list = [[] for _ in range(n_ranks)]
    sync_at: dict = {}
    while any(h < len(q) for hs, qs in zip(heads, queues) for h, q in zip(hs, qs)):
        progressed = False
        for r in range(n_ranks):
            pick = next((g for g, q in enumerate(queues[r])
                         if heads[r][g] < len(q) and not blocked(r, *q[heads[r][g]])), None)
            if pick is None:
                items[r].append((-1, PAD))
                continue
            item = queues[r][pick][heads[r][pick]]
            heads[r][pick] += 1
            items[r].append(item)
            done[r].add(item)
            progressed = True
        moves = ready()
        if not moves and not progressed:
            raise RuntimeError("rank_schedule: no rank can go on and nothing can cross ranks (a carry group whose "
                               "readers precede their owners)")
        if moves:
            sync_at[len(items[0])] = moves
            for t in moves:
                if t.kind == "state":
                    sent.add(t.owner)
                    for r in t.ranks:
                        have[r].add(t.owner)
                else:
                    returned.add(t.owner)
    bounds = [0] + sorted(sync_at) + [len(items[0])]
    spans = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return RankSchedule(items=items, syncs=sync_at, rank_of=rank_of, segments=spans)


def rank_lifetimes(microbatches: list, schedule: RankSchedule, rank: int) -> dict:
    """``{owner: (fill, first_row_read, first_state_read, last_read, restore)}`` positions for ``rank``'s carry
    store (`CarryStore.set_lifetimes`), from its items in ``schedule``. Beside `carry_lifetimes` of its own
    owners: an owner whose state another rank reads lives at least until the sync that sends it; a remote owner's
    copy arrives at its sync (its "fill": counted from the item before, whose end the sync follows) and its
    accumulators live until the sync that returns them (its "restore"); an owner's accumulators hold its remote
    readers' sum from that sync on; the store runs a sync before releasing (`CarryStore.exchange`, then
    `advance`)."""
    order = sorted({i for i, _ in schedule.items[rank]})  # -1 (padding) first
    at = {i: j for j, i in enumerate(order)}
    mbs = [microbatches[i] if i >= 0 else _Pad() for i in order]
    arrive = {t.owner: pos - 1 for pos, ts in schedule.syncs.items() for t in ts
              if t.kind == "state" and rank in t.ranks}
    leave = {t.owner: pos for pos, ts in schedule.syncs.items() for t in ts if t.kind == "grad" and rank in t.ranks}
    out = carry_lifetimes(mbs, [(at[i], p) for i, p in schedule.items[rank]], arrive=arrive, leave=leave)
    for pos, moves in schedule.syncs.items():
        for t in moves:
            if t.src != rank:
                continue
            f, fr, fs, last, restore = out[t.owner]
            if t.kind == "state":  # its state lives until the sync that sends it
                out[t.owner] = (f, fr, fs, max(last, pos - 1), restore)
            else:  # its accumulators (every state tensor's) hold the remote readers' sum from here on
                first = lambda x: pos - 1 if x < 0 else min(x, pos - 1)  # noqa: E731
                out[t.owner] = (f, first(fr), first(fs), last, restore)
    return out


class _Pad:
    carry = None


def schedule_ms(schedule: RankSchedule, item_ms, transfer_ms) -> dict:
    """Predicted step time of ``schedule``: per segment the slowest rank's items (``item_ms(index, phase)``;
    padding costs nothing), plus each sync's ``transfer_ms(transfer)`` (one after the other). Returns
    ``{"step_ms", "rank_ms": [busy ms per rank], "sync_ms"}``."""
    n = len(schedule.items)
    busy = np.zeros(n)
    step = 0.0
    for a, b in schedule.segments:
        seg = np.array([sum(item_ms(i, p) for i, p in schedule.items[r][a:b] if p != PAD) for r in range(n)])
        busy += seg
        step += float(seg.max()) if n else 0.0
    sync = sum(transfer_ms(t) for ts in schedule.syncs.values() for t in ts)
    return {"step_ms": step + sync, "rank_ms": busy.tolist(), "sync_ms": sync}


def rank_store_timeline(microbatches: list, schedule: RankSchedule, rank: int, geometry) -> list:
    """`carry.carry_store_timeline` of ``rank``'s items in ``schedule`` (`carry.CarryGeometry`): copies of remote
    owners' state count from their arrival to their readers' last, their accumulators until they leave."""
    from .carry import lifetime_timeline

    return lifetime_timeline(microbatches, rank_lifetimes(microbatches, schedule, rank), geometry, schedule.num_items)


@dataclass(frozen=True)
class CarryWork:
    """A roofline estimate of carry items and transfers, for planning the split over data-parallel ranks.

    A forward costs ``layers * (24 * hidden**2 * rows + 4 * hidden * pairs)`` flops at ``tflops`` (a dense layer
    with a 4x MLP, two flops per multiply-add; ``pairs``: the visible (query, key) pairs of the microbatch's own
    queries, carried keys included); fill and keep are one forward, run and restore three (forward + backward),
    release two. A transfer moves the owner's exported state (``geometry``: `carry.CarryGeometry`) at ``link_gbs``
    GB/s after ``latency_ms``. Ratios between plans are what it is for, not absolute times."""

    geometry: object
    hidden: int = 4096
    layers: int = 32
    tflops: float = 400.0
    link_gbs: float = 50.0
    latency_ms: float = 0.05

    def forward_ms(self, mb) -> float:
        info = getattr(mb, "carry", None)
        c = len(info.carried) if info is not None else 0
        pairs = int(mb.layout.visible_pairs()) - c * (c + 1) // 2
        flops = self.layers * (24.0 * self.hidden ** 2 * mb.owned_rows + 4.0 * self.hidden * pairs)
        return flops / (self.tflops * 1e12) * 1e3

    def item_ms(self, mb, phase: str) -> float:
        return self.forward_ms(mb) * {"fill": 1, "keep": 1, "release": 2, PAD: 0}.get(phase, 3)

    def transfer_ms(self, mb) -> float:
        info = mb.carry
        nbytes = len(info.exported) * self.geometry.row_bytes() + len(info.state_rows) * self.geometry.state_row_bytes()
        return self.latency_ms + nbytes / (self.link_gbs * 1e9) * 1e3


def split_step_ms(microbatches: list, dp_size: int, work: CarryWork) -> dict:
    """Split packing's predicted step over ``dp_size`` ranks: its microbatches (forward + backward each) balanced
    over the ranks (`data.sharding`'s rule: largest first to the least loaded); ranks never wait on each other.
    ``{"step_ms", "rank_ms"}``."""
    cost = sorted((3 * work.forward_ms(mb) for mb in microbatches), reverse=True)
    load = np.zeros(dp_size)
    for c in cost:
        load[int(np.argmin(load))] += c
    return {"step_ms": float(load.max()), "rank_ms": load.tolist()}


@dataclass
class CarryRankPlan:
    """`plan_carry_ranks`' choice: the budget the step is cut at, its microbatches, their ranks, the exporters each
    rank keeps, the schedule and its predicted times (`schedule_ms`)."""

    budget: int
    microbatches: list
    ranks: list
    keep: list
    schedule: RankSchedule
    times: dict
    tried: dict  # {budget: predicted step ms (the faster of its assignments)}
    refined: bool = False  # the ranks are `assign_carry_ranks(..., refine=True)`'s

    @property
    def balance(self) -> float:
        """The slowest rank's predicted busy time over the mean (1.0: even; padding counts as idle)."""
        return busy_balance(self.times)


def busy_balance(times: dict) -> float:
    """``max / mean`` of `schedule_ms`' per-rank busy times (1.0 where nothing is busy)."""
    busy = np.asarray(times["rank_ms"], float)
    return float(busy.max() / busy.mean()) if busy.size and busy.mean() > 0 else 1.0


def plan_carry_ranks(samples: list, budget: int, dp_size: int, work: CarryWork, *, cut: str = "auto",
                     choose_keep=None, finer: int = 3, min_budget: int = 1024, pack_kwargs=None,
                     balance: float = 1.10, slack: float = 0.005) -> CarryRankPlan:
    """Carry over ``dp_size`` ranks at the budget and assignment that predict the fastest step. Budgets: ``budget``
    (the user's bound on a microbatch's owned rows), up to ``finer`` halvings of it and the largest tree's rows where
    that is smaller (one tree per microbatch: whole trees for the ranks to spread), then further halvings while no
    candidate within ``slack`` of the fastest is balanced; none below ``min_budget``. Every budget computes the same
    rows, a finer one gives the ranks smaller pieces to balance (more microbatches, carried reads and, where kept
    graphs do not fit, extra forwards). Assignments per budget: `assign_carry_ranks` as the pipeline runs it, and
    with ``refine`` (local moves / swaps lowering the most loaded rank), kept only where it differs.

    Choice: among the candidates whose predicted step is within ``slack`` (relative) of the fastest, the fastest
    whose slowest rank's busy time is at most ``balance`` x the mean (`busy_balance`); if none is, the best balanced
    of them. Balance only breaks near-ties: ``slack`` (0.5%) is about what the roofline resolves (`CarryWork`), and
    no more predicted step than that is given for it. It is often out of reach at the fastest step: while a
    prompt's owner runs, every rank waiting on its state idles, so the owner's rank is busiest unless a finer budget
    spreads the prompt's chunks over the ranks, which costs extra forwards where their kept graphs do not fit.
    Ties go to the larger budget, then to the plain assignment. ``choose_keep(rank_microbatches) -> set`` picks
    each rank's kept graphs (None: none)."""
    from ...tree.carry import assign_carry_ranks
    from ...tree.packing import PrefixPlan, pack

    split = dp_size > 1 and cut != "never"
    budgets = [budget]
    while split and len(budgets) <= finer and budgets[-1] // 2 >= min_budget:
        budgets.append(budgets[-1] // 2)
    if split:
        largest = int(PrefixPlan([np.asarray(s.tokens) for s in samples]).tree_rows().max())
        if min_budget <= largest < budget:
            budgets = sorted(set(budgets) | {largest}, reverse=True)
    item_work = lambda mb: work.item_ms(mb, "run")  # noqa: E731
    cands, tried = [], {}

    def near(c) -> bool:
        return c.times["step_ms"] <= min(x.times["step_ms"] for x in cands) * (1 + slack)

    k = 0
    while k < len(budgets):
        b = budgets[k]
        mbs = pack(samples, b, carry=True, **(pack_kwargs or {}))
        seen = []
        for refine in (False, True) if split else (False,):
            ranks = assign_carry_ranks(mbs, dp_size, work=item_work, cut=cut, refine=refine)
            if ranks in seen:
                continue
            seen.append(ranks)
            keep = [choose_keep([mbs[i] for i in idx]) if choose_keep else set() for idx in ranks]
            schedule = rank_schedule(mbs, ranks, keep=keep)
            times = schedule_ms(schedule, lambda i, p: work.item_ms(mbs[i], p) if i >= 0 else 0.0,
                                lambda t: work.transfer_ms(mbs[t.owner]))
            tried[b] = min(tried.get(b, np.inf), times["step_ms"])
            cands.append(CarryRankPlan(b, mbs, ranks, keep, schedule, times, tried, refine))
        k += 1
        # a finer budget only where the coarser ones leave the near-fastest plans uneven
        if (split and k == len(budgets) and b // 2 >= min_budget
                and not any(near(c) and c.balance <= balance for c in cands)):
            budgets.append(b // 2)
    close = [c for c in cands if near(c)]
    even = [c for c in close if c.balance <= balance]
    return _first_min(even, lambda c: c.times["step_ms"]) if even else _first_min(close, lambda c: c.balance)


def _first_min(cands: list, key):
    """The first of ``cands`` (in preference order: larger budget, then the plain assignment) whose ``key`` is the
    least up to float noise."""
    low = min(key(c) for c in cands)
    return next(c for c in cands if key(c) <= low * (1 + 1e-9))
