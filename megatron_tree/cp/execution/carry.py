"""The carry store and the carried executors: layer state of rows owned by earlier microbatches.

One `CarryStore` per optimizer step and process. For every layer (key: the module's layer number and
kind) and every exporting microbatch it holds the state of that microbatch's exported rows, written
by its fill forward (`cp.planning.carry`), and a gradient accumulator per state tensor:

* a reader takes the state as fresh autograd leaves (`CarryStore.read`); a hook on each leaf adds the
  gradient the reader's backward computes into the owner's accumulator (index_add: several readers
  may read one row). Under activation recomputation the first (no-grad) pass makes leaves that no
  graph uses, so each reader adds its gradient exactly once; the stored values are written once, by
  the fill, so a recomputation reads what the first pass read;
* the owner's restore forward recomputes the state with autograd and passes it through
  `inject_gradient`: identity forward, and in backward the incoming gradient plus the accumulated one
  on the exported rows, read when backward runs (after every reader's backward).

Attention (`carried_attention`): the own rows' queries attend to own keys and, in a second stage, to
the carried K / V; the stages merge exactly (``ops.merge_attention``) and sinks apply once. An owner's
state is released once its last reader's backward is done, its accumulators once its restore's
backward is done (`CarryStore.advance`, at each schedule item's start).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...ops.attention import apply_sinks, merge_attention, tree_attention_partial
from ...ops.causal_conv1d import tree_causal_conv1d
from ...ops.gated_delta_rule import gated_delta_rule_forest, l2norm
from ...ops.ssd import tree_ssd
from ...tree.layout import TreeLayout
from ..planning.carry import own_forest

__all__ = ["CarryStore", "CarryView", "CarryCP", "inject_gradient", "tie_gradient", "carried_attention",
           "carried_attention_cp", "carry_cp_rows", "own_rank_of", "carried_gdn", "carried_conv", "carried_mamba_ssd", "gather_rows"]

#: TEST-ONLY fault switch (tests/test_carry.py, verify --inject-fault carry_*): "detach" (readers' gradients
#: are dropped: no restoration), "twice" (the accumulated gradient is injected twice), "stale" (every
#: read perturbs the stored state afterwards, as a later microbatch overwriting the store would: a
#: recomputation then re-reads other values than its first pass), "return_dropped" (the gradient readers on
#: other data-parallel ranks built is not returned to the owner's rank). None in real use.
_FAULT: str | None = None


@dataclass
class _Entry:
    keys: np.ndarray  # [E] step-global rows, ascending
    values: list  # detached tensors [E, ...] (emptied once the last reader's backward is done)
    acc: list  # gradient accumulators (None until a reader's backward adds one)
    meta: list  # (shape, dtype, device) of each value: the accumulators' shapes
    reduced: bool = False  # tree CP: the accumulators were summed over the CP group (once, at the restore)


class CarryStore:
    """Per-step state of exported rows, per (layer key, owner microbatch).

    With lifetimes (`set_lifetimes`, from `cp.planning.carry.carry_lifetimes`; `megatron.carry.carry_items`
    sets them) `advance` releases an owner's state once its last reader's backward is done and its
    accumulators once its restore's backward is done; a read after the release is an error, not a
    stale value. Without lifetimes everything lives until `clear` (or the store is dropped)."""

    def __init__(self):
        self._entries: dict = {}
        self.microbatches: list = []  # the step's microbatches the items were made from (`carry_items`)
        self._lifetimes: dict = {}
        self._released: set = set()
        self.history: list = []  # [(position, state bytes, accumulator bytes)] held when each item began
        self.kept: dict = {}  # keep phase: {owner: (output, loss function)} until its release hands them on
        self.keep = None  # the exporters that keep their graph (`carry_phases`' ``keep``)
        # carry groups cut over data-parallel ranks (`cp.planning.carry_ranks`): the syncs {position: [Transfer]},
        # the data-parallel group they run over and this rank in it
        self.syncs: dict = {}
        self.dp_group = None
        self.dp_rank = 0
        self._synced: set = set()
        self._remote_meta: dict = {}  # {owner: [(key, keys, [(shape, dtype)])]} of state that crossed ranks
        self.rank_args = None  # `megatron.carry.carry_rank_items`' arguments (its group aside) where it made the items

    def put(self, key, owner: int, keys: np.ndarray, values: list) -> None:
        if (key, owner) in self._entries:
            raise RuntimeError(f"carry store: layer {key} of microbatch {owner} is filled twice in one step")
        if owner in self._released:
            raise RuntimeError(f"carry store: microbatch {owner} fills layer {key} after its state was released")
        self._entries[(key, owner)] = _Entry(np.asarray(keys), [v.detach() for v in values], [None] * len(values),
                                             [(v.shape, v.dtype, v.device) for v in values])

    def set_lifetimes(self, lifetimes: dict) -> None:
        """``{owner: (fill, first_row_read, first_state_read, last_read, restore)}`` schedule positions
        (`cp.planning.carry.carry_lifetimes`)."""
        self._lifetimes = dict(lifetimes)

    def advance(self, position: int) -> None:
        """Schedule item ``position`` begins: every earlier item's backward is done. Records what the
        store held (`history`), then releases the state whose last reader came before ``position`` and
        the accumulators of owners restored before it."""
        self.history.append((position, self.nbytes(), self.acc_nbytes()))
        for o, (*_, last, restore) in self._lifetimes.items():
            if last < position and o not in self._released:
                for (key, owner), e in self._entries.items():
                    if owner == o:
                        e.values = []
                self._released.add(o)
            if restore < position:
                for k in [k for k in self._entries if k[1] == o]:
                    del self._entries[k]

    def read(self, key, owners: np.ndarray, keys: np.ndarray) -> list:
        """The state of rows ``keys`` (owned by ``owners``, both [C]) as autograd leaves, in that order."""
        parts, per_owner = [], []
        for o in np.unique(owners).tolist():
            e = self._entries.get((key, o))
            if o in self._released:
                raise RuntimeError(f"carry store: layer {key} reads microbatch {o}'s state after its last planned "
                                   "reader's backward released it (a schedule the carry plan did not make)")
            if e is None:
                raise RuntimeError(f"carry store: layer {key} reads microbatch {o}'s state, which was never filled "
                                   "(its fill forward must run first in the same step)")
            sel = np.flatnonzero(owners == o)
            pos = np.searchsorted(e.keys, keys[sel])
            if (pos >= len(e.keys)).any() or (e.keys[np.minimum(pos, len(e.keys) - 1)] != keys[sel]).any():
                raise RuntimeError(f"carry store: microbatch {o} did not export every row layer {key} reads")
            parts.append(sel)
            per_owner.append((e, torch.from_numpy(pos)))
        where = torch.from_numpy(np.argsort(np.concatenate(parts), kind="stable"))
        out = []
        for t in range(len(per_owner[0][0].values)):
            vals = [e.values[t][pos.to(e.values[t].device)] for e, pos in per_owner]
            leaf = torch.cat(vals)[where.to(vals[0].device)].detach()  # a new tensor: cat + gather
            if _FAULT == "stale":
                for e, _ in per_owner:
                    e.values[t].mul_(1.001)
            if torch.is_grad_enabled():
                leaf.requires_grad_(True)
                leaf.register_hook(self._accumulate_hook(per_owner, where, t, [len(p) for p in parts]))
            out.append(leaf)
        return out

    @staticmethod
    def _accumulate_hook(per_owner, where, t, sizes):
        def hook(grad):
            if _FAULT == "detach":
                return None
            g = torch.empty_like(grad)
            g[where.to(grad.device)] = grad  # back to owner-grouped order
            for (e, pos), chunk in zip(per_owner, torch.split(g, sizes)):
                if e.acc[t] is None:
                    shape, dtype, device = e.meta[t]
                    e.acc[t] = torch.zeros(shape, dtype=dtype, device=device)
                e.acc[t].index_add_(0, pos.to(grad.device), chunk.to(e.acc[t].dtype))
            return None
        return hook

    def accumulated(self, key, owner: int, t: int):
        e = self._entries.get((key, owner))
        return None if e is None else e.acc[t]

    def reduce_accumulators(self, key, owner: int, group) -> None:
        """Tree CP: sum the accumulators of layer ``key`` of microbatch ``owner`` over the CP ``group``.

        Each CP rank's readers computed the gradient of the carried rows their plan gave them, so
        every rank holds a part; the owner's restore needs the sum. Called on every rank (a
        collective), once (a recomputation of the restore finds them reduced): at the restore's forward
        without pipelining (every reader's backward has run), in its backward under 1F1B
        (`inject_gradient`'s ``group``), where backward passes run in forward order on every rank."""
        e = self._entries.get((key, owner))
        if e is None or e.reduced:
            return
        for t, (shape, dtype, device) in enumerate(e.meta):
            if e.acc[t] is None:
                e.acc[t] = torch.zeros(shape, dtype=dtype, device=device)
            torch.distributed.all_reduce(e.acc[t], group=group)
        e.reduced = True

    def clear(self) -> None:
        self._entries.clear()

    def exchange(self, position: int) -> None:
        """Schedule item ``position`` begins on every rank of ``dp_group``: run the sync planned there, if any (once;
        a collective over the data-parallel group, `cp.planning.carry_ranks`). ``state`` transfers broadcast an
        owner's exported state from its rank (its readers' ranks keep a copy, read as if filled here; the shapes
        come first, gathered as objects); ``grad`` transfers sum the accumulators of the readers' copies onto the
        owner's rank, where its restore reads them. Call before `advance`: the lifetimes count on it."""
        moves = self.syncs.get(position)
        if not moves or position in self._synced:
            return
        self._synced.add(position)
        dist = torch.distributed
        group, me = self.dp_group, self.dp_rank
        meta = {t.owner: [(key, e.keys, [(tuple(v.shape), v.dtype) for v in e.values])
                          for (key, o), e in self._entries.items() if o == t.owner]
                for t in moves if t.kind == "state" and t.src == me}
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, meta, group=group)
        device = _device()
        for t in moves:
            src = dist.get_global_rank(group, t.src)
            if t.kind == "state":
                self._remote_meta[t.owner] = everyone[t.src][t.owner]
                for key, keys, shapes in self._remote_meta[t.owner]:
                    if me == t.src:
                        vals = self._entries[(key, t.owner)].values
                        for v in vals:
                            dist.broadcast(v.contiguous(), src=src, group=group)
                        continue
                    vals = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
                    for v in vals:
                        dist.broadcast(v, src=src, group=group)
                    if me in t.ranks:
                        self._entries[(key, t.owner)] = _Entry(np.asarray(keys), vals, [None] * len(vals),
                                                               [(v.shape, v.dtype, v.device) for v in vals])
                continue
            for key, _, shapes in self._remote_meta[t.owner]:
                e = self._entries.get((key, t.owner))
                for k, (shape, dtype) in enumerate(shapes):
                    acc = e.acc[k] if e is not None and e.acc[k] is not None else None
                    if acc is None:
                        acc = torch.zeros(shape, dtype=dtype, device=device)
                    if _FAULT == "return_dropped" and me != t.src:
                        acc = torch.zeros_like(acc)
                    dist.reduce(acc, dst=src, group=group)
                    if me == t.src:
                        e.acc[k] = acc

    def nbytes(self) -> int:
        """Bytes of stored state held now (accumulators excluded)."""
        return sum(v.numel() * v.element_size() for e in self._entries.values() for v in e.values)

    def acc_nbytes(self) -> int:
        """Bytes of gradient accumulators held now."""
        return sum(a.numel() * a.element_size() for e in self._entries.values() for a in e.acc if a is not None)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class _Inject(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows, store, key, owner, t, acc_rows, group):
        ctx.rows, ctx.store, ctx.key, ctx.owner, ctx.t, ctx.acc_rows = rows, store, key, owner, t, acc_rows
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.group is not None:  # tree CP under pipelining: the readers' parts are summed now
            ctx.store.reduce_accumulators(ctx.key, ctx.owner, ctx.group)
        acc = ctx.store.accumulated(ctx.key, ctx.owner, ctx.t)  # read now: every reader's backward has run
        if acc is not None:
            if ctx.acc_rows is not None:  # tree CP: this rank's exported rows among the owner's
                acc = acc[ctx.acc_rows.to(acc.device)]
            g = g.clone()
            g.index_add_(0, ctx.rows.to(g.device), acc.to(g.dtype))
            if _FAULT == "twice":
                g.index_add_(0, ctx.rows.to(g.device), acc.to(g.dtype))
        return g, None, None, None, None, None, None, None


class _Tie(torch.autograd.Function):
    """``y`` unchanged; backward hands ``x`` (a tensor nothing downstream uses, e.g. a final state)
    the accumulated gradient of its rows, so it flows back through ``x``'s graph."""

    @staticmethod
    def forward(ctx, y, x, rows, store, key, owner, t):
        ctx.rows, ctx.store, ctx.key, ctx.owner, ctx.t = rows, store, key, owner, t
        ctx.x_meta = (x.shape, x.dtype, x.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        shape, dtype, device = ctx.x_meta
        gx = torch.zeros(shape, dtype=dtype, device=device)
        acc = ctx.store.accumulated(ctx.key, ctx.owner, ctx.t)
        if acc is not None:
            gx.index_add_(0, ctx.rows.to(device), acc.to(dtype))
            if _FAULT == "twice":
                gx.index_add_(0, ctx.rows.to(device), acc.to(dtype))
        return g, gx, None, None, None, None, None


def tie_gradient(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, store: CarryStore, key, owner: int,
                 t: int) -> torch.Tensor:
    """``y`` unchanged; in backward ``x`` [P, ...] receives the accumulated gradient of state ``t``
    of layer ``key`` of microbatch ``owner`` on its rows ``rows``. For exported state that no later
    op of the owner reads (a recurrence's final state): ``y`` must reach the loss."""
    return _Tie.apply(y, x, rows, store, key, owner, t)


def inject_gradient(x: torch.Tensor, rows: torch.Tensor, store: CarryStore, key, owner: int, t: int,
                    acc_rows: torch.Tensor | None = None, group=None) -> torch.Tensor:
    """Identity on ``x`` [n, ...]; backward adds the accumulated gradient of state ``t`` of layer
    ``key`` of microbatch ``owner`` to the rows ``rows`` [E] of ``x`` (its exported rows): the
    accumulator's rows ``acc_rows`` [E] when given (tree CP: the owner's exported rows this rank
    computed), else all of them. ``group``: sum the accumulators over this CP group first
    (`CarryStore.reduce_accumulators`; every rank of it runs this backward)."""
    return _Inject.apply(x, rows, store, key, owner, t, acc_rows, group)


@dataclass(frozen=True)
class CarryCP:
    """A carry microbatch under tree CP (`CarryView.cp`).

    plan / group    its `CPPlan` (over the whole layout: carried rows have CP owners too) and CP group
    rank            this process's rank in ``group``
    whole           the microbatch's `CarryView` without CP (every own row): what every rank exports
                    (`CarryView.state` gathers it), and what the recurrent layers run their heads over
                    after a token -> head transpose (`tree_gdn_cp`, `tree_mamba_cp` with ``carry=``), so
                    each rank stores and reads its heads' state
    pipelined       1F1B pipelining: restores sum the readers' gradients over CP in their backward
    """

    plan: object
    group: object
    rank: int
    whole: "CarryView"
    pipelined: bool = False


def gather_rows(x: torch.Tensor, rank_of: np.ndarray, group) -> torch.Tensor:
    """All-gather rows over ``group``: each rank holds ``x`` = the rows ``rank_of == its rank`` (in
    order) of an [E, ...] tensor; every rank returns the whole [E, ...] (no autograd: fills)."""
    size = torch.distributed.get_world_size(group)
    counts = np.bincount(rank_of, minlength=size)
    m = int(counts.max(initial=0))
    buf = x.new_zeros((m,) + tuple(x.shape[1:]))
    buf[: x.shape[0]] = x
    parts = [torch.empty_like(buf) for _ in range(size)]
    torch.distributed.all_gather(parts, buf.contiguous(), group=group)
    out = x.new_empty((len(rank_of),) + tuple(x.shape[1:]))
    for r in range(size):
        out[torch.from_numpy(np.flatnonzero(rank_of == r)).to(x.device)] = parts[r][: counts[r]]
    return out


@dataclass
class CarryView:
    """What the layers of one carry microbatch need (rides in ``TreePackedSeqParams.carry``).

    phase      "fill" (no autograd; writes the store), "run", "restore" or "keep" (the exporter's one forward
               with autograd: writes the store and injects the readers' gradient, read in its backward)
    store      the step's `CarryStore`
    index      the microbatch's position in the step (`CarryInfo.index`)
    own        [n] layout rows it computes (ascending; the modules' rows, in this order)
    carried    [C] layout rows read from the store (ascending)
    carried_keys / carried_owner  [C] numpy: their step-global rows and owners
    exported   [E] positions in ``own`` of the rows later microbatches read; exported_keys [E] numpy
    """

    phase: str
    store: CarryStore
    index: int
    own: torch.Tensor
    carried: torch.Tensor
    carried_keys: np.ndarray
    carried_owner: np.ndarray
    exported: torch.Tensor
    exported_keys: np.ndarray
    state_rows: torch.Tensor  # [P] positions in ``own`` of the rows whose recurrent state is exported
    state_keys: np.ndarray
    keys: np.ndarray | None = None  # [N] step-global row of every layout row (-1: padding)
    memo: dict = field(default_factory=dict, repr=False)  # per-microbatch host work shared by its layers
    # tree CP (None without): ``own`` / ``exported`` / ``state_rows`` are then this CP rank's share
    cp: "CarryCP | None" = None
    # what the store keys of this view's layers are scoped by (None: the decoder's; MTP depth k: ("mtp", k),
    # whose layers may share the decoder's layer numbers)
    scope: object = None

    def scoped(self, key):
        """The store key of layer ``key`` in this view."""
        return key if self.scope is None else (self.scope, key)

    def state(self, key, values: list, positions=None, keys=None, rows: str = "exported") -> list:
        """Own rows' state tensors ``values`` ([n, ...] each) of layer ``key``, through the phase:
        the rows ``positions`` (default: the exported rows, or with ``rows="state"`` the state rows)
        stored under ``keys`` (fill) or given the readers' gradient (restore); unchanged otherwise.
        Under tree CP the fill gathers those rows of every CP rank (each rank's store holds them all: a
        reader's plan may give a carried row to any rank) and the restore first sums the readers'
        gradients over the CP group."""
        if self.cp is not None and positions is None:
            return self._state_cp(key, values, rows)
        key = self.scoped(key)
        if positions is None and rows == "state":
            positions, keys = self.state_rows, self.state_keys
        positions = self.exported if positions is None else positions
        keys = self.exported_keys if keys is None else keys
        if not len(keys):
            return values
        if self.phase in ("fill", "keep"):
            self.store.put(key, self.index, keys, [v[positions] for v in values])
        if self.phase in ("restore", "keep"):
            values = [inject_gradient(v, positions, self.store, key, self.index, t) for t, v in enumerate(values)]
        return values

    def _gathered_rows(self, rows: str):
        """Tree CP: the exported rows (or with ``rows="state"`` the state rows) of every CP rank, from
        ``cp.whole``: ``(this rank's as positions in own, every rank's keys [E], the rank computing each
        [E], positions of this rank's in those [e])``. Made once per view and kind."""
        memo = f"gathered_{rows}"
        if memo not in self.memo:
            cp, whole = self.cp, self.cp.whole
            at, keys = (whole.exported, whole.exported_keys) if rows == "exported" else (whole.state_rows,
                                                                                         whole.state_keys)
            rank_of = cp.plan.owner[whole.own.cpu().numpy()[at.cpu().numpy()]].astype(np.int64)
            mine = torch.from_numpy(np.flatnonzero(rank_of == cp.rank)).to(self.own.device)
            self.memo[memo] = (self.exported if rows == "exported" else self.state_rows, keys, rank_of, mine)
        return self.memo[memo]

    def _state_cp(self, key, values: list, rows: str = "exported") -> list:
        cp, key = self.cp, self.scoped(key)
        positions, keys, rank_of, mine = self._gathered_rows(rows)
        if not len(keys):  # no CP rank holds such a row of this microbatch
            return values
        if self.phase in ("fill", "keep"):
            with torch.no_grad():  # (the store holds values; a keep's graph goes on through ``values``)
                self.store.put(key, self.index, keys, [gather_rows(v[positions], rank_of, cp.group) for v in values])
        if self.phase in ("restore", "keep"):
            # a restore runs after every reader's backward (summed now); a keep's backward, at its release, does
            late = cp.pipelined or self.phase == "keep"
            if not late:
                self.store.reduce_accumulators(key, self.index, cp.group)
            values = [inject_gradient(v, positions, self.store, key, self.index, t, acc_rows=mine,
                                      group=cp.group if late else None) for t, v in enumerate(values)]
        return values

    def carried_state(self, key, rows=None) -> list | None:
        """The state of layer ``key`` of carried rows ``rows`` (positions in ``carried``; default all),
        [len, ...] each, or None when there are none."""
        keys, owners = self.carried_keys, self.carried_owner
        if rows is not None:
            keys, owners = keys[rows], owners[rows]
        if not len(keys):
            return None
        return self.store.read(self.scoped(key), owners, keys)


def carried_attention(q, k, v, layout, view: CarryView, key, *, softmax_scale, window=None, sinks=None,
                      backend: str = "auto", softcap=None) -> torch.Tensor:
    """Tree attention of the own rows ``q, k, v`` ([n, H, D], rows ``view.own``) over own and carried
    keys. Returns [n, Hq, Dv], equal to whole-tree attention at those rows."""
    k, v = view.state(key, [k, v])
    own = view.own
    vis, pos = layout.visible_until, layout.position_ids
    kw = dict(softmax_scale=softmax_scale, window=window, backend=backend, softcap=softcap)
    if window is not None:
        kw.update(q_positions=pos[own])
    o, lse = tree_attention_partial(q, k, v, own, own, vis[own], k_positions=pos[own] if window else None, **kw)
    carried = view.carried_state(key)
    if carried is not None:
        kc, vc = carried
        rows = view.carried
        o2, lse2 = tree_attention_partial(q, kc.to(q.dtype), vc.to(v.dtype), own, rows, vis[rows],
                                          k_positions=pos[rows] if window else None, **kw)
        o, lse = merge_attention(o, lse, o2, lse2)
    if sinks is not None:
        o, lse = apply_sinks(o, lse, sinks)
    return o


def own_rank_of(view: CarryView, plan) -> np.ndarray:
    """[n] the CP rank computing each of ``view.own`` under ``plan``: what the recurrent layers'
    token -> head transposes move under carry (`tree_gdn_cp`, `tree_mamba_cp`). Made once per view."""
    if "own_rank" not in view.memo:
        view.memo["own_rank"] = plan.owner[view.own.cpu().numpy()].astype(np.int64)
    return view.memo["own_rank"]


def carry_cp_rows(view: CarryView):
    """Tree CP: where this rank's rows sit among the rows its plan gives it (``plan.owner_rows(rank)``:
    its own rows and the carried rows the plan gives it). Returns ``(n, at_own [e], mine, at_carried
    [c])``: the plan's row count, the positions of ``view.own`` there, the carried rows it holds
    (positions in ``view.carried``, numpy) and their positions there. Made once per microbatch view."""
    if "cp_rows" not in view.memo:
        cp = view.cp
        rows = cp.plan.owner_rows(cp.rank)
        carried = view.carried.cpu().numpy()
        mine = np.flatnonzero(cp.plan.owner[carried] == cp.rank)
        view.memo["cp_rows"] = (len(rows), torch.from_numpy(np.searchsorted(rows, view.own.cpu().numpy())),
                                mine, torch.from_numpy(np.searchsorted(rows, carried[mine])))
    return view.memo["cp_rows"]


def carried_attention_cp(q, k, v, view: CarryView, key, *, softmax_scale, window=None, sinks=None,
                         backend: str = "auto", softcap=None) -> torch.Tensor:
    """`carried_attention` under tree CP: ``q, k, v`` [n, H, D] are this CP rank's own rows
    (``view.own``). The CP plan covers the whole layout, carried rows too: the carried rows it gives
    this rank enter `tree_attention_cp` with their stored K / V (leaves whose gradient, returned to
    this rank by the CP exchange, goes to their owner's accumulator) and zero queries, whose outputs
    are dropped; every other row is attended as usual. Returns [n, Hq, Dv]."""
    from .attention import tree_attention_cp  # a sibling executor

    cp = view.cp
    k, v = view.state(key, [k, v])
    n, at_own, mine, at_carried = carry_cp_rows(view)
    dev = q.device
    at_own = at_own.to(dev)
    full = lambda x: x.new_zeros((n,) + tuple(x.shape[1:])).index_copy(0, at_own, x)
    qf, kf, vf = full(q), full(k), full(v)
    if len(mine):
        kc, vc = view.carried_state(key, mine)
        at_carried = at_carried.to(dev)
        kf, vf = kf.index_copy(0, at_carried, kc.to(k.dtype)), vf.index_copy(0, at_carried, vc.to(v.dtype))
    out = tree_attention_cp(qf, kf, vf, cp.plan, cp.group, softmax_scale=softmax_scale, window=window, sinks=sinks,
                            backend=backend, softcap=softcap)
    return out[at_own]


def _own_forest(layout, view: CarryView):
    """The own rows as a forest for `gated_delta_rule_forest` (positions 0..n-1 in ``view.own``).

    A segment ends at a fork, before a row whose parent is not the previous row, and after every
    exported state row (its final state is what later microbatches start from). A segment whose
    parent row is carried is a root starting from that row's stored state. Returns ``(seg_start,
    seg_len, seg_parent, initial_index, parents_in_carried, final_segments)`` (numpy), where
    ``parents_in_carried`` are positions in ``view.carried`` of the distinct carried parents. Made once
    per microbatch view: every recurrent layer (and a recomputation) reuses it."""
    if "forest" not in view.memo:
        view.memo["forest"] = _make_own_forest(layout, view)
    return view.memo["forest"]


def _make_own_forest(layout, view: CarryView):
    return own_forest(layout.path_prev.cpu().numpy(), view.own.cpu().numpy(), view.carried.cpu().numpy(),
                      view.state_rows.cpu().numpy())


def carried_conv(x, weight, bias, layout, view: CarryView, key, *, activation="silu") -> torch.Tensor:
    """The tree causal conv of the own rows' pre-conv channels ``x`` [n, C], whose halo reaches into
    carried rows: their pre-conv channels come from the store (stored for every exported row), the
    whole layout is convolved and the own rows returned ([n, C], ``activation`` applied)."""
    (x,) = view.state((key, "conv"), [x])
    full = x.new_zeros((layout.num_rows, x.shape[1])).index_copy(0, view.own, x)
    carried = view.carried_state((key, "conv"))
    if carried is not None:
        full = full.index_copy(0, view.carried, carried[0].to(x.dtype))
    silu = activation == "silu"
    out = tree_causal_conv1d(full, weight, bias, layout, activation="silu" if silu else None)[view.own]
    if not silu and activation is not None:
        out = activation(out)
    return out


def _export_states(o, final, view: CarryView, key):
    """Fill: store the final states after the state rows; restore: tie their gradient to ``o``; keep: both."""
    if len(view.state_keys):  # the final states feed no later op here: restore ties their gradient to o
        rows = torch.arange(len(view.state_keys), device=final.device)
        if view.phase in ("fill", "keep"):
            view.store.put(view.scoped((key, "state")), view.index, view.state_keys, [final[rows]])
        if view.phase in ("restore", "keep"):
            o = tie_gradient(o, final, rows, view.store, view.scoped((key, "state")), view.index, 0)
    return o


def carried_mamba_ssd(x, dt, A, B, C, layout, view: CarryView, key, *, D=None, backend: str = "auto",
                      chunk_size: int = 128):
    """Mamba-2 SSD of the own rows (x [n,H,P], dt [n,H], B/C [n,G,S]; `ops.ssd.tree_ssd`'s conventions),
    continuing carried rows' state: the own rows form a layout of their own (segments end at the state
    rows) whose roots under a carried row start from its stored state. Returns y [n,H,P]."""
    seg_start, seg_len, seg_parent, init_index, parents, final_segs = _own_forest(layout, view)
    n_pad = layout.num_padding
    real = int(np.searchsorted(seg_start, x.shape[0] - n_pad))  # segments of real rows; padding rows follow
    if "own_layout" not in view.memo:  # once per microbatch view, shared by its Mamba layers
        view.memo["own_layout"] = TreeLayout.from_segments(seg_len[:real], seg_parent[:real],
                                                           num_padding=n_pad).to(x.device)
    own_layout = view.memo["own_layout"]
    init = None
    if len(parents):
        (init,) = view.carried_state((key, "state"), parents)
    idx = np.concatenate([init_index[:real], np.full(n_pad, -1, np.int64)])
    out = tree_ssd(x, dt, A, B, C, own_layout, D=D, backend=backend, chunk_size=chunk_size,
                   initial_state=init, initial_index=idx if init is not None else None,
                   final_segments=final_segs if len(view.state_keys) else None)
    if not len(view.state_keys):
        return out
    y, final = out
    return _export_states(y, final, view, key)


def carried_gdn(qkv, g, beta, conv_weight, conv_bias, layout, view: CarryView, key, *, num_k_heads: int,
                head_k_dim: int, head_v_dim: int, activation="silu", qk_l2norm: bool = True, scale=None,
                key_of_value=None, backend: str = "auto"):
    """Gated DeltaNet (conv + recurrence) of the own rows, continuing carried rows' state.

    qkv [n, 2*H*K + HV*V] pre-conv channels of ``view.own``; g, beta [n, HV]; conv_weight [C, W].
    The conv reads carried rows' pre-conv channels from the store (the whole layout is convolved,
    carried rows from the store, so the halo follows the root path across the cut); the recurrence
    runs the own rows as a forest whose roots under a carried row start from that row's stored state.
    ``key_of_value`` [HV] (tree CP's heads mode): the key head each value head reads, when the heads
    here are not grouped as ``h // (HV / H)``.
    ``backend``: the recurrence's (`ops.gated_delta_rule_forest`: FLA on CUDA under "auto").
    Returns o [n, HV, V], equal to the whole-tree layer at those rows."""
    n, H, K, V = qkv.shape[0], int(num_k_heads), int(head_k_dim), int(head_v_dim)
    HV = int(g.shape[1])
    conv = carried_conv(qkv, conv_weight, conv_bias, layout, view, key, activation=activation)
    q, k, v = torch.split(conv, [H * K, H * K, HV * V], dim=-1)
    q, k, v = q.reshape(n, H, K), k.reshape(n, H, K), v.reshape(n, HV, V)
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if key_of_value is not None:
        q, k = q.index_select(1, key_of_value), k.index_select(1, key_of_value)
    seg_start, seg_len, seg_parent, init_index, parents, final_segs = _own_forest(layout, view)
    init = None
    if len(parents):
        (init,) = view.carried_state((key, "state"), parents)
    o, final = gated_delta_rule_forest(q, k, v, g, beta, seg_start, seg_len, seg_parent, initial_state=init,
                                       initial_index=init_index if init is not None else None,
                                       final_segments=final_segs, scale=scale, backend=backend)
    return _export_states(o, final, view, key)
