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
the carried K / V; the stages merge exactly (``ops.merge_attention``) and sinks apply once. The store
is freed with `CarryStore.clear` at the end of the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...ops.attention import apply_sinks, merge_attention, tree_attention_partial

__all__ = ["CarryStore", "CarryView", "inject_gradient", "carried_attention"]

#: TEST-ONLY fault switch (tests/test_carry.py): "detach" (readers' gradients are dropped: no restoration),
#: "twice" (the accumulated gradient is injected twice). None in real use.
_FAULT: str | None = None


@dataclass
class _Entry:
    keys: np.ndarray  # [E] step-global rows, ascending
    values: list  # detached tensors [E, ...]
    acc: list  # gradient accumulators (None until a reader's backward adds one)


class CarryStore:
    """Per-step state of exported rows, per (layer key, owner microbatch)."""

    def __init__(self):
        self._entries: dict = {}

    def put(self, key, owner: int, keys: np.ndarray, values: list) -> None:
        if (key, owner) in self._entries:
            raise RuntimeError(f"carry store: layer {key} of microbatch {owner} is filled twice in one step")
        self._entries[(key, owner)] = _Entry(np.asarray(keys), [v.detach() for v in values], [None] * len(values))

    def read(self, key, owners: np.ndarray, keys: np.ndarray) -> list:
        """The state of rows ``keys`` (owned by ``owners``, both [C]) as autograd leaves, in that order."""
        parts, per_owner = [], []
        for o in np.unique(owners).tolist():
            e = self._entries.get((key, o))
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
            leaf = torch.cat(vals)[where.to(vals[0].device)].detach()
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
                    e.acc[t] = torch.zeros_like(e.values[t])
                e.acc[t].index_add_(0, pos.to(grad.device), chunk.to(e.acc[t].dtype))
            return None
        return hook

    def accumulated(self, key, owner: int, t: int):
        e = self._entries.get((key, owner))
        return None if e is None else e.acc[t]

    def clear(self) -> None:
        self._entries.clear()

    def nbytes(self) -> int:
        """Bytes of stored state (accumulators excluded)."""
        return sum(v.numel() * v.element_size() for e in self._entries.values() for v in e.values)


class _Inject(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows, store, key, owner, t):
        ctx.rows, ctx.store, ctx.key, ctx.owner, ctx.t = rows, store, key, owner, t
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        acc = ctx.store.accumulated(ctx.key, ctx.owner, ctx.t)  # read now: every reader's backward has run
        if acc is not None:
            g = g.clone()
            g.index_add_(0, ctx.rows.to(g.device), acc.to(g.dtype))
            if _FAULT == "twice":
                g.index_add_(0, ctx.rows.to(g.device), acc.to(g.dtype))
        return g, None, None, None, None, None


def inject_gradient(x: torch.Tensor, rows: torch.Tensor, store: CarryStore, key, owner: int, t: int) -> torch.Tensor:
    """Identity on ``x`` [n, ...]; backward adds the accumulated gradient of state ``t`` of layer
    ``key`` of microbatch ``owner`` to the rows ``rows`` [E] of ``x`` (its exported rows)."""
    return _Inject.apply(x, rows, store, key, owner, t)


@dataclass
class CarryView:
    """What the layers of one carry microbatch need (rides in ``TreePackedSeqParams.carry``).

    phase      "fill" (no autograd; writes the store), "run" or "restore"
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
    _cache: dict = field(default_factory=dict, repr=False)

    def state(self, key, values: list) -> list:
        """Own rows' state tensors ``values`` ([n, ...] each) of layer ``key``, through the phase:
        stored (fill) or given the readers' gradient (restore); unchanged otherwise."""
        if not len(self.exported_keys):
            return values
        if self.phase == "fill":
            self.store.put(key, self.index, self.exported_keys, [v[self.exported] for v in values])
        elif self.phase == "restore":
            values = [inject_gradient(v, self.exported, self.store, key, self.index, t) for t, v in enumerate(values)]
        return values

    def carried_state(self, key) -> list | None:
        """The carried rows' state of layer ``key`` ([C, ...] each), or None when nothing is carried."""
        if not len(self.carried_keys):
            return None
        return self.store.read(key, self.carried_owner, self.carried_keys)


def carried_attention(q, k, v, layout, view: CarryView, key, *, softmax_scale, window=None, sinks=None,
                      backend: str = "auto") -> torch.Tensor:
    """Tree attention of the own rows ``q, k, v`` ([n, H, D], rows ``view.own``) over own and carried
    keys. Returns [n, Hq, Dv], equal to whole-tree attention at those rows."""
    k, v = view.state(key, [k, v])
    own = view.own
    vis, pos = layout.visible_until, layout.position_ids
    kw = dict(softmax_scale=softmax_scale, window=window, backend=backend)
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
