"""The order a step's carry microbatches run in, inside one Megatron schedule (host side, numpy).

A microbatch whose rows later microbatches read (it *exports* rows, `tree.carry.CarryInfo.exported`)
runs twice: a **fill** forward without autograd that writes the exported rows' layer state into the
step's carry store, and, after every reader has run, a **restore** forward + backward that recomputes
the same state with autograd, adds the gradient the readers accumulated on it (the gradient
restoration) and backpropagates its own loss. Every other microbatch runs once (**run**). So the
cost of carry is one extra forward (without saved activations) of each exporting microbatch, and
each row is computed once by forward + backward, as with an unlimited budget.

Order for the microbatches of one data-parallel rank: one carry group
(the microbatches cut from one tree: nothing reads across groups) after the other, each as its
microbatches in step order as fill (exports) or run (does not), then its restores in reverse step
order, then those without carry. An owner always precedes its readers (`pack(..., carry=True)` puts
them first), so every read finds its state filled, and a reader that exports itself restores before
the owners it reads: its restore's backward accumulates into theirs.
Megatron runs backward passes in forward order (no pipelining and 1F1B alike), so the order holds for
backward too.

**Kept graphs** (``keep``): an exporting microbatch may instead run once, as a **keep** forward with
autograd that writes the store *and* keeps its graph (the exported state passes through the gradient
injection, whose backward reads the readers' accumulated gradient when it runs), and a **release** item
at its restore's place that runs no forward: it hands the kept output and loss function to the schedule,
whose backward then runs through the kept graph after every reader's backward. One forward and one
backward per row, at the price of holding the graph from the keep to the release
(`choose_kept` picks which exporters under a memory budget). Without pipelining only: under 1F1B the
schedule runs a release's backward on stages whose kept graph another item's forward replaced.

Lifetimes (`carry_lifetimes`): an owner's stored state is released once its last reader's backward is
done, its gradient accumulators once its own restore's backward is done (the carry store does it at
the start of the next schedule item: without pipelining, which carry needs, each item's backward ends
before the next item's forward). `carry_store_timeline` predicts the store's bytes item by item.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["carry_phases", "choose_kept", "PHASES", "CarryGeometry", "carry_store_bytes", "carry_lifetimes", "carry_store_timeline",
           "lifetime_timeline",
           "own_forest", "mb_own_forest", "forest_levels"]

PHASES = ("fill", "run", "restore", "keep", "release")
#: the phases that write an exporter's state (its only forward with ``keep``) and that end its life
WRITES, ENDS = ("fill", "keep"), ("restore", "release")


def carry_phases(microbatches: list, keep=None, remote: bool = False) -> list[tuple[int, str]]:
    """``[(position in microbatches, phase)]`` for one rank's microbatches (step order, as
    `tree.carry.assign_carry_groups` gives them). One carry group after the other (in the order they
    first appear): its microbatches in step order as fill (exports) or run (does not), then its restores
    in reverse step order; then the microbatches without carry (no info, or group -1), once each. A
    group's state is released before the next group fills (`carry_lifetimes`), so the store peaks at
    one group's, not at the step's. ``keep``: the exporters (`CarryInfo.index`) that run as keep / release
    instead of fill / restore (module docstring); ``True`` for every one. ``remote``: the owners a microbatch
    reads may run on other data-parallel ranks (`cp.planning.carry_ranks`: their state crosses at syncs)."""
    infos = [getattr(mb, "carry", None) for mb in microbatches]
    seen = {info.index for info in infos if info is not None}
    for info in infos:
        if info is not None and not remote and not set(info.reads_from) <= seen:
            missing = sorted(set(info.reads_from) - seen)
            raise ValueError(f"carry microbatch {info.index} reads rows of microbatches {missing}, which this rank "
                             "does not run: a carry group must stay on one data-parallel rank "
                             "(megatron_tree.tree.carry.assign_carry_groups)")
    groups: dict = {}
    order, free = [], []
    for i, info in enumerate(infos):
        if info is None or info.group < 0:
            free.append((i, "run"))
        else:
            groups.setdefault(info.group, []).append(i)
    for members in groups.values():
        restores = []
        for i in members:
            exports = len(infos[i].exported) > 0
            kept = exports and (keep is True or (keep and infos[i].index in keep))
            order.append((i, "keep" if kept else "fill" if exports else "run"))
            if exports:
                restores.append((i, "release" if kept else "restore"))
        order += restores[::-1]
    # free microbatches last: a step that carries starts with a fill, as Megatron-LM's logging expects (it
    # reads the report keys of a step's first microbatch; a fill reports the loss alone)
    return order + free


def choose_kept(microbatches: list, kept_bytes, budget: float, remote: bool = False) -> set:
    """The exporters (`CarryInfo.index`) to run as keep / release: in step order, each whose kept graph (``kept_bytes(mb)``
    bytes, held from its keep to its release) fits beside the graphs already kept at every schedule item of its
    life within ``budget`` bytes. Deterministic in the microbatches, so every rank of a model-parallel group
    chooses alike. ``remote``: `carry_phases`' (owners on other data-parallel ranks)."""
    phases = carry_phases(microbatches, remote=remote)
    start, end = {}, {}
    for k, (i, phase) in enumerate(phases):
        if phase == "fill":
            start[i] = k
        elif phase == "restore":
            end[i] = k
    held = np.zeros(len(phases))
    kept = set()
    for i in sorted(start, key=start.get):
        b = float(kept_bytes(microbatches[i]))
        if held[start[i]: end[i] + 1].max() + b <= budget:
            held[start[i]: end[i] + 1] += b
            kept.add(microbatches[i].carry.index)
    return kept


@dataclass(frozen=True)
class CarryGeometry:
    """What one process stores per carried row and per state row, by layer kind (one TP rank's heads).

    pattern      one letter per layer: ``*`` attention (K and V of every exported row), ``D`` DeepSeek
                 sparse attention (K, V and the indexer key), ``G`` Gated DeltaNet (pre-conv channels of
                 every exported row, one recurrent state per state row), ``M`` Mamba-2 (the same); other
                 letters (``-`` MLP, ``E`` MoE) store nothing
    kv           (key/value heads, head dim) of attention
    dsa_index    the DSA indexer's key width
    gdn          (key heads, value heads, key dim, value dim) of GDN
    mamba        (heads, head dim, groups, state dim) of Mamba-2
    act_bytes    bytes of an activation element (2 for bf16, 8 for a float64 model)
    state_bytes  bytes of a recurrent-state element (4: states are kept in fp32; 8 in float64)
    """

    pattern: str
    kv: tuple = (8, 128)
    gdn: tuple = (16, 32, 128, 128)
    mamba: tuple = (64, 64, 8, 128)
    dsa_index: int = 128
    act_bytes: int = 2
    state_bytes: int = 4

    def row_bytes(self) -> int:
        """Stored bytes of one exported row over every layer."""
        hk, d = self.kv
        H, HV, K, V = self.gdn
        mh, mp, mg, ms = self.mamba
        per = {"*": 2 * hk * d, "D": 2 * hk * d + self.dsa_index, "G": 2 * H * K + HV * V, "M": mh * mp + 2 * mg * ms}
        return int(self.act_bytes * sum(per.get(c, 0) for c in self.pattern))

    def state_row_bytes(self) -> int:
        """Stored bytes of one state row over every layer (the recurrent states after it)."""
        H, HV, K, V = self.gdn
        mh, mp, mg, ms = self.mamba
        per = {"G": HV * K * V, "M": mh * mp * ms}
        return self.state_bytes * sum(per.get(c, 0) for c in self.pattern)


def _fill_bytes(info, geometry: CarryGeometry) -> tuple[int, int]:
    """What one microbatch's fill stores: (its exported rows' state, its recurrent states)."""
    return len(info.exported) * geometry.row_bytes(), len(info.state_rows) * geometry.state_row_bytes()


def carry_store_bytes(microbatches: list, geometry: CarryGeometry) -> list[int]:
    """Bytes each microbatch writes into the step's carry store (its fill), in order (what the store
    holds over time: `carry_store_timeline`)."""
    return [0 if getattr(mb, "carry", None) is None else sum(_fill_bytes(mb.carry, geometry)) for mb in microbatches]


def _host(t) -> np.ndarray:
    """A layout tensor (any device) or array as a host array."""
    return np.asarray(t.cpu() if hasattr(t, "cpu") else t)


def mb_own_forest(mb):
    """`own_forest` of a carry microbatch (`TreeMicrobatch` with ``carry``)."""
    info = mb.carry
    own = info.own
    return own_forest(_host(mb.layout.path_prev), own, info.carried, np.searchsorted(own, info.state_rows))


def _state_readers(mb) -> set:
    """The owners whose recurrent state ``mb`` reads: those of the carried rows its own rows hang off
    (a recurrent layer's own segment under a carried row starts from that row's stored state)."""
    parents = mb_own_forest(mb)[4]
    return set(np.asarray(mb.carry.carried_owner)[parents].tolist())


def own_forest(path_prev: np.ndarray, own: np.ndarray, carried: np.ndarray, state_rows: np.ndarray):
    """A carry microbatch's own rows as the forest its recurrent layers run (host numpy).

    ``path_prev`` [N]: the layout's previous row on each row's root path (-1 at a root); ``own`` /
    ``carried``: the layout rows it computes / reads (sorted); ``state_rows``: positions in ``own`` of
    the rows whose state later microbatches start from. A segment ends at a fork, before a row whose
    parent is not the previous own row, and after every state row; a segment whose parent row is
    carried is a root that starts from that row's stored state. Returns ``(seg_start, seg_len,
    seg_parent, initial_index, parents_in_carried, final_segments)``: segments over positions
    0..len(own)-1, ``initial_index[s]`` the index among the distinct carried parents a root starts from
    (-1: zero state), ``parents_in_carried`` their positions in ``carried``, ``final_segments`` the
    segments that end at the state rows."""
    n = len(own)
    pos_of = np.full(len(path_prev), -1, np.int64)
    pos_of[own] = np.arange(n)
    pp = path_prev[own]
    ppos = np.where(pp >= 0, pos_of[np.maximum(pp, 0)], -1)
    kids = np.bincount(ppos[ppos >= 0], minlength=n)
    is_state = np.zeros(n, bool)
    is_state[state_rows] = True
    start = (ppos != np.arange(n) - 1) | np.concatenate([[True], (kids[:-1] > 1) | is_state[:-1]])
    seg_start = np.flatnonzero(start)
    seg_len = np.diff(np.append(seg_start, n))
    seg_of = np.cumsum(start) - 1
    first_parent = ppos[seg_start]
    seg_parent = np.where(first_parent >= 0, seg_of[np.maximum(first_parent, 0)], -1)
    cparent = pp[seg_start]
    from_carried = (cparent >= 0) & (first_parent < 0)
    uniq = np.unique(cparent[from_carried])
    initial_index = np.full(len(seg_start), -1, np.int64)
    initial_index[from_carried] = np.searchsorted(uniq, cparent[from_carried])
    return seg_start, seg_len, seg_parent, initial_index, np.searchsorted(carried, uniq), seg_of[state_rows]


def forest_levels(seg_parent: np.ndarray) -> np.ndarray:
    """Depth of every segment of a forest whose parents precede their children (0 at a root)."""
    level = np.zeros(len(seg_parent), np.int64)
    has = seg_parent >= 0
    while True:  # one pass per depth
        nxt = np.where(has, level[np.maximum(seg_parent, 0)] + 1, 0)
        if np.array_equal(nxt, level):
            return level
        level = nxt


def carry_lifetimes(microbatches: list, phases: list | None = None, arrive: dict | None = None,
                    leave: dict | None = None) -> dict[int, tuple[int, int, int, int, int]]:
    """``{owner: (fill, first_row_read, first_state_read, last_read, restore)}``: schedule positions
    (`carry_phases` order) of each exporting microbatch's fill; of the first item that reads its rows'
    state (K / V, pre-conv channels) with autograd, and of the first that reads its recurrent states so
    (a run or restore: its backward makes the gradient accumulators; -1: none); of the last item that
    reads anything of it (its state is needed until that item's backward is done); and of its restore
    (its accumulators are needed until that item's backward is done). Owners: `CarryInfo.index`.
    ``phases``: `carry_phases` of ``microbatches`` where the caller has it already. A keep counts as the
    owner's fill and, for what it reads, as a reader with autograd; a release as its restore, reading
    nothing (it runs no forward). ``arrive`` / ``leave``: ``{owner: position}`` of owners on other data-parallel
    ranks (`cp.planning.carry_ranks`) whose state copy arrives at a sync (its "fill") and whose accumulators leave
    at one (its "restore": the item before)."""
    phases = carry_phases(microbatches) if phases is None else phases
    fill, restore, first_rows, first_state, last = {}, {}, {}, {}, {}
    # where each item's backward runs: a keep's at its release (the accumulators it feeds appear then)
    release_at = {i: k for k, (i, phase) in enumerate(phases) if phase == "release"}
    for k, (i, phase) in enumerate(phases):
        mb = microbatches[i]
        info = mb.carry
        if info is None:
            continue
        if phase in WRITES:
            fill[info.index] = k
        elif phase in ENDS:
            restore[info.index] = k
        if phase == "release":
            continue
        backward = release_at[i] if phase == "keep" else k
        for o in info.reads_from:
            last[o] = k
            if phase != "fill":
                first_rows[o] = min(first_rows.get(o, backward), backward)
        if phase != "fill" and info.reads_from:
            for o in _state_readers(mb):
                first_state[o] = min(first_state.get(o, backward), backward)
    for o, k in (arrive or {}).items():
        fill.setdefault(o, k)
    for o, k in (leave or {}).items():
        restore.setdefault(o, k - 1)
    return {o: (fill[o], first_rows.get(o, -1), first_state.get(o, -1), last.get(o, -1), restore[o]) for o in fill}


def carry_store_timeline(microbatches: list, geometry: CarryGeometry, pending: int = 0,
                         keep=None) -> list[tuple[int, int]]:
    """``[(state bytes, accumulator bytes)]`` the carry store holds at the end of each schedule item
    (after its backward, before the next item's releases), for one rank's microbatches (step order).
    State: from the owner's fill to its last reader; accumulators (the shapes of what they collect)
    from the first reader's backward to the owner's restore: the rows' part from the first reader of
    its rows, the recurrent states' part from the first reader of those. The peak of the sum is the
    store's memory. ``pending``: the items whose backward may still be owed when an item begins
    (1F1B stage ``r`` of ``p``: ``p - r - 1``, `megatron.forward_step.pending_backwards`): every
    release comes that many items later. ``keep``: `carry_phases`' (kept graphs' lifetimes: a release reads
    nothing)."""
    phases = carry_phases(microbatches, keep=keep)
    return lifetime_timeline(microbatches, carry_lifetimes(microbatches, phases), geometry, len(phases), pending)


def lifetime_timeline(microbatches: list, lives: dict, geometry: CarryGeometry, num_items: int,
                      pending: int = 0) -> list[tuple[int, int]]:
    """`carry_store_timeline` from lifetimes (``{owner: (fill, first_row_read, first_state_read, last, restore)}``
    over ``num_items`` schedule items; ``microbatches`` include every owner named there)."""
    rows, states = {}, {}
    for mb in microbatches:
        if getattr(mb, "carry", None) is not None:
            rows[mb.carry.index], states[mb.carry.index] = _fill_bytes(mb.carry, geometry)
    out = []
    for k in range(num_items):
        state = sum(rows[o] + states[o] for o, (f, _, _, last, _) in lives.items()
                    if f <= k <= max(last, f) + pending)
        acc = sum((rows[o] if 0 <= fr <= k <= r + pending else 0) + (states[o] if 0 <= fs <= k <= r + pending else 0)
                  for o, (_, fr, fs, _, r) in lives.items())
        out.append((state, acc))
    return out
