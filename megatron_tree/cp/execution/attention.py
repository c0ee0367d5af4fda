"""Tree attention over a context-parallel group: `tree_attention_cp`.

Each rank keeps its queries and outputs (the rows ``plan.owner_rows(rank)``, ascending). Its output
is built in stages over disjoint key sets:

1. the **local stage**: its queries against its own K / V (``ops.tree_attention_partial`` with the
   global row ids, so visibility is the layout's predicate unchanged);
2. one **remote stage per wave**: the remote K / V rows its queries see (`schedule.build_schedule`;
   a windowed layer fetches only rows inside its window) arrive by ``all_to_all_single`` and are
   attended the same way.

Stage results ``(o_r, lse_r)`` are merged exactly (``ops.merge_attention``: the weights are
``w_r = exp(lse_r - lse)``), and learned sinks are applied once, after the last merge
(``ops.apply_sinks``): a sink is probability mass of the whole query, not of each stage.

Overlap: the fetch of wave 0 is issued before the local stage, and the fetch of wave ``w + 1``
before the compute of wave ``w`` (asynchronous ``all_to_all_single``, waited just before use). On
NCCL the transfer runs on the communicator's stream while the compute stream works; on gloo on its
worker thread. That is the overlap the planner's cost model assumes.

Autograd design: the whole CP attention (all stages and all collectives) is ONE
``torch.autograd.Function``. Its backward issues every collective explicitly, in a fixed order
that depends only on the plan, so every rank enters the same collectives in the same order whatever
rows it owns (also a rank that owns nothing or needs nothing remote); it does not rely on the
autograd engine visiting per-wave nodes in the same order on every rank. The per-stage backward uses
the *global* softmax derivative through the stage's own autograd graph: with the merged ``o``, ``lse``
and incoming ``g = dL/do``, ``dlse``, stage ``r`` receives the adjoints of the merge,

    dL/do_r   = w_r * g
    dL/dlse_r = w_r * (g . (o_r - o) + dlse)

which make its softmax backward equal ``dS = P_global * (g . v - g . o + dlse)``, the derivative of
the single softmax over all keys. dQ stays local; dK / dV of fetched rows return to their owners by
the reverse all-to-all and are ADDED there (``index_add``): a fetched row may be read by several
ranks, and the transpose of a replicating gather is an accumulation. The return of wave ``w`` is
in flight while the next stage's backward computes.

Memory modes (``recompute``): by default each stage keeps its autograd graph from forward to
backward (no recomputation, but every fetched remote row stays held until backward, i.e. the total
fetched). With ``recompute=True`` forward keeps only ``q, k, v, o, lse``; backward fetches each
wave again and recomputes its stage, so at most one (two with prefetch) wave of remote K / V is
held at any time: the waves bound remote KV memory, at the price of one more fetch and one more
stage forward per wave.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from ...ops.attention import apply_sinks, merge_attention, tree_attention_partial
from ..planning.plan import CPPlan
from ..planning.schedule import CPSchedule, build_schedule
from .comm import group_rank, received, start_exchange, start_fetch

__all__ = ["tree_attention_cp", "attention_seconds"]

#: TEST-ONLY fault switch for the sensitivity tests (tests/test_cp_attention.py). Always None in
#: real use. Each value plants one known executor bug that the equivalence tests must catch:
#: "skip_merge" (the output is the last stage's, without the LSE merge), "drop_wave" (the last
#: wave's stage is not merged), "no_dkv_return" (returned dK / dV are not added by their owners),
#: "sinks_per_stage" (sinks applied to every stage instead of once). Collectives still run.
_FAULT: str | None = None


@dataclass(frozen=True, eq=False)
class _Cfg:
    sched: CPSchedule
    group: object
    scale: float
    window: int | None
    backend: str
    recompute: bool
    build_graph: bool  # grad mode was on and an input requires grad
    fault: str | None
    sinks: torch.Tensor | None  # only for the "sinks_per_stage" fault
    softcap: float | None = None  # attention logit soft-cap (Gemma 2), elementwise: exact per stage


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Stage:
    """One stage's inputs (leaves when a graph is built) and its ``(o, lse)`` output."""

    __slots__ = ("inputs", "o", "lse")

    def __init__(self, inputs, o, lse):
        self.inputs, self.o, self.lse = inputs, o, lse


def _run_stage(q, k, v, k_rows, k_vis, k_pos, idx: dict, cfg: _Cfg, with_graph: bool) -> _Stage:
    """Attention of the owned queries against one key set; with_graph: differentiable w.r.t. fresh leaves."""
    if with_graph:
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    pos = cfg.window is not None
    with torch.set_grad_enabled(with_graph):
        o, lse = tree_attention_partial(
            q, k, v, idx["owned"], k_rows, k_vis,
            q_positions=idx["owned_position_ids"] if pos else None, k_positions=k_pos if pos else None,
            softmax_scale=cfg.scale, window=cfg.window, backend=cfg.backend, softcap=cfg.softcap)
    return _Stage((q, k, v) if with_graph else None, o, lse)


def _pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[n,Hkv,D] and [n,Hkv,Dv] -> one [n, Hkv*(D+Dv)] block (explicit sizes: n may be 0)."""
    n, hkv, d = k.shape
    return torch.cat([k.reshape(n, hkv * d), v.reshape(n, hkv * v.shape[-1])], 1)


def _split_kv(block: torch.Tensor, hkv: int, d: int, dv: int):
    m = block.shape[0]
    return block[:, :hkv * d].view(m, hkv, d), block[:, hkv * d:].view(m, hkv, dv)


def _remote_stage(block, idx, cfg, w, hkv, d, dv, q, with_graph) -> _Stage:
    """Stage of wave ``w`` on its received block; the graph's K / V leaf is the packed block itself,
    so the backward yields the packed dK / dV that travels back in one buffer."""
    wi = idx["waves"][w]
    if with_graph:
        block = block.detach().requires_grad_(True)
        q = q.detach().requires_grad_(True)
    pos = cfg.window is not None
    with torch.set_grad_enabled(with_graph):  # also around the split: views made without grad are untracked
        k, v = _split_kv(block, hkv, d, dv)
        o, lse = tree_attention_partial(
            q, k, v, idx["owned"], wi["rows"], wi["visible_until"],
            q_positions=idx["owned_position_ids"] if pos else None, k_positions=wi["position_ids"] if pos else None,
            softmax_scale=cfg.scale, window=cfg.window, backend=cfg.backend, softcap=cfg.softcap)
    return _Stage((q, block) if with_graph else None, o, lse)


def _stage_grads(stage: _Stage, g: torch.Tensor, dlse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor):
    """Gradients of the stage's leaves under the global softmax (adjoints of the merge)."""
    lse_r = stage.lse.detach().to(lse.dtype)
    # w_r = exp(lse_r - lse); 0 where the stage saw no key (lse_r = -inf, also when lse = -inf)
    w = torch.where(torch.isneginf(lse_r), torch.zeros_like(lse_r), torch.exp(lse_r - lse))
    o_r = stage.o.detach().to(g.dtype)
    do_r = (g * w.unsqueeze(-1)).to(stage.o.dtype)
    dlse_r = (w * ((g * (o_r - o)).sum(-1) + dlse)).to(stage.lse.dtype)
    # not allow_unused: every leaf must be in the stage's graph (an untracked leaf is a bug, not a zero)
    return torch.autograd.grad((stage.o, stage.lse), stage.inputs, (do_r, dlse_r))


_SECONDS = [0.0]  # wall time this process spent inside tree CP attention (forward + backward)


def attention_seconds(*, reset: bool = False) -> float:
    """Seconds this process spent in `tree_attention_cp` forward and backward (including waits for
    its fetches) since the last reset. The trainer compares it over CP ranks (measured max / mean).
    Host wall time: on CUDA it counts launches and synchronising waits, not kernel time."""
    t = _SECONDS[0]
    if reset:
        _SECONDS[0] = 0.0
    return t


def _timed(fn):
    @functools.wraps(fn)
    def wrapper(*args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            _SECONDS[0] += time.perf_counter() - t0
    return wrapper


class _CPAttentionFn(torch.autograd.Function):
    """(q, k, v) -> (o, lse) of the owned rows over the whole CP group (no sinks)."""

    @staticmethod
    @_timed
    def forward(ctx, q, k, v, cfg: _Cfg):
        sched, nw = cfg.sched, cfg.sched.num_waves
        idx = sched.device_indices(q.device)
        n, hkv, d = k.shape
        dv = v.shape[-1]
        keep = cfg.build_graph and not cfg.recompute  # keep each stage's graph until backward
        # K and V travel together in one buffer per wave: [n, Hkv*(D+Dv)] (D and Dv may differ)
        pack = _pack_kv(k, v)
        fetch = start_fetch(cfg.sched, pack, 0, cfg.group) if nw else None  # wave 0 moves while the local stage runs
        stages = [_run_stage(q, k, v, idx["owned"], idx["owned_visible_until"], idx["owned_position_ids"],
                             idx, cfg, keep)]
        for w in range(nw):
            nxt = start_fetch(cfg.sched, pack, w + 1, cfg.group) if w + 1 < nw else None  # before wave w's compute
            block = received(cfg.sched, fetch, pack, w)
            fetch = nxt
            if block.shape[0] == 0 or (cfg.fault == "drop_wave" and w == nw - 1):
                stages.append(None)  # nothing visible here: o = 0, lse = -inf contributes nothing
                continue
            stages.append(_remote_stage(block, idx, cfg, w, hkv, d, dv, q, keep))

        # exact LSE merge over disjoint key sets, accumulated in float32 (float64 for float64)
        adt = _acc_dtype(q.dtype)
        o_acc, lse_acc = None, None
        for st in stages:
            if st is None:
                continue
            o_r, lse_r = st.o.detach().to(adt), st.lse.detach()
            if cfg.fault == "sinks_per_stage" and cfg.sinks is not None:
                o_r, lse_r = apply_sinks(o_r, lse_r, cfg.sinks.detach())
            if o_acc is None or cfg.fault == "skip_merge":
                o_acc, lse_acc = o_r, lse_r
            else:
                o_acc, lse_acc = merge_attention(o_acc, lse_acc, o_r, lse_r)
        o = o_acc.to(q.dtype)
        ctx.cfg = cfg
        ctx.stages = stages if keep else None
        ctx.shapes = (hkv, d, dv)
        ctx.save_for_backward(q, k, v, o, lse_acc)
        return o, lse_acc

    @staticmethod
    @_timed
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        cfg = ctx.cfg
        sched, nw = cfg.sched, cfg.sched.num_waves
        idx = sched.device_indices(q.device)
        hkv, d, dv = ctx.shapes
        n = k.shape[0]
        adt = _acc_dtype(q.dtype)
        g, o32, dlse = do.to(adt), o.to(adt), dlse.to(lse.dtype)
        stages = ctx.stages
        ctx.stages = None  # the kept graphs are freed as soon as each stage is done
        # without kept graphs (recompute mode, or a second backward through a retained graph) every
        # stage is fetched and recomputed; all ranks take the same branch (same mode, same calls)
        recompute = stages is None

        dq = torch.zeros(q.shape, dtype=adt, device=q.device)
        # gradient of the packed local K / V (the owner's accumulator for returned contributions)
        dpack = torch.zeros((n, hkv * (d + dv)), dtype=adt, device=q.device)
        pack = _pack_kv(k, v) if recompute else None
        returns = []  # (Exchange, wave) of dK / dV travelling back to their owners

        def add_returned(upto: int):
            # wait for the returns issued so far except the last ``upto`` and add them (owner side)
            while len(returns) > upto:
                ex, w = returns.pop(0)
                got = ex.wait()
                if cfg.fault != "no_dkv_return" and got.shape[0]:
                    dpack.index_add_(0, idx["waves"][w]["send_local"], got.to(adt))

        def local_stage():
            st = stages[0] if stages is not None else _run_stage(
                q, k, v, idx["owned"], idx["owned_visible_until"], idx["owned_position_ids"], idx, cfg, True)
            gq, gk, gv = _stage_grads(st, g, dlse, o32, lse)
            dq.add_(gq)
            dpack[:, :hkv * d].add_(gk.reshape(n, hkv * d))
            dpack[:, hkv * d:].add_(gv.reshape(n, hkv * dv))

        fetch = start_fetch(cfg.sched, pack, 0, cfg.group) if recompute and nw else None
        if recompute:
            local_stage()  # overlaps the re-fetch of wave 0
        for w in range(nw):
            wave = sched.waves[w]
            if recompute:
                nxt = start_fetch(cfg.sched, pack, w + 1, cfg.group) if w + 1 < nw else None
                block = received(cfg.sched, fetch, pack, w)
                fetch = nxt
                st = None if block.shape[0] == 0 else _remote_stage(block, idx, cfg, w, hkv, d, dv, q, True)
            else:
                st, stages[w + 1] = stages[w + 1], None  # drop our reference: the graph goes after its use
            m = wave.rows.shape[0]
            if st is None:
                dblock = k.new_zeros((m, hkv * (d + dv)))  # the packed K / V dtype: every rank sends the same
            else:
                gq, dblock = _stage_grads(st, g, dlse, o32, lse)
                dq.add_(gq)
            if wave.global_rows:
                # back in receive order, to the ranks we fetched from
                send = dblock.index_select(0, idx["waves"][w]["recv_order"])
                returns.append((start_exchange(send, wave.recv_splits, wave.send_splits, cfg.group), w))
            add_returned(1)  # keep at most one return in flight beside the next stage's compute
        if not recompute:
            local_stage()
        add_returned(0)
        dk = dpack[:, :hkv * d].reshape(k.shape).to(k.dtype)
        dv_ = dpack[:, hkv * d:].reshape(v.shape).to(v.dtype)
        return dq.to(q.dtype), dk, dv_, None


def tree_attention_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan, group=None, *,
                      softmax_scale: float | None = None, window: int | None = None,
                      sinks: torch.Tensor | None = None, return_lse: bool = False, recompute: bool = False,
                      backend: str = "auto", softcap: float | None = None):
    """Tree attention of this rank's owned rows over the CP ``group`` under ``plan`` (autograd).

    q [n_local,Hq,D], k [n_local,Hkv,D], v [n_local,Hkv,Dv]: the rows ``plan.owner_rows(rank)``
    (``rank`` = this process's rank in ``group``; None is the default group), in that order
    (ascending global row). Hq a multiple of Hkv (GQA); k and v of one dtype. Returns
    o [n_local,Hq,Dv] equal to rows ``owner_rows(rank)`` of single-device ``ops.tree_attention`` on
    the whole layout, and with ``return_lse`` also lse [n_local,Hq] (float32, float64 for float64
    inputs, including the sinks). ``softmax_scale`` defaults to D**-0.5; ``window`` is the sliding
    window on depth; ``sinks`` [Hq] learned sink logits, applied once after the merge (each rank's
    sinks gradient covers its own queries: reduce it over the CP group like any replicated
    parameter). ``recompute``: bounded remote-KV memory (see the module docstring). ``backend`` and
    ``softcap`` (an attention logit soft-cap) are passed to ``ops.tree_attention_partial``.

    Every rank of the group must call this with the same plan, window and shapes apart from
    n_local, and must backpropagate through its output whenever any rank does (the backward runs
    collectives), including ranks that own no rows.
    """
    if not isinstance(plan, CPPlan):
        raise TypeError(f"plan must be a CPPlan, got {type(plan).__name__}")
    rank = group_rank(plan, group, "tree_attention_cp")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [n_local,H,D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    sched = build_schedule(plan, rank, window=window)
    n_local = sched.owned.shape[0]
    if q.shape[0] != n_local or k.shape[0] != n_local or v.shape[0] != n_local:
        raise ValueError(f"rank {rank} owns {n_local} rows under plan {plan.hash}, but q, k, v have "
                         f"{q.shape[0]}, {k.shape[0]}, {v.shape[0]} rows (they must be plan.owner_rows(rank), "
                         "in order)")
    if k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
        raise ValueError(f"incompatible k {tuple(k.shape)} / v {tuple(v.shape)} / q {tuple(q.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if k.dtype != v.dtype:
        raise ValueError(f"k and v must share a dtype (they travel in one buffer); got {k.dtype} and {v.dtype}")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [Hq={q.shape[1]}], got {tuple(sinks.shape)}")
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    build = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    fault = _FAULT
    cfg = _Cfg(sched=sched, group=group, scale=scale, window=sched.window, backend=backend,
               recompute=bool(recompute), build_graph=build, fault=fault,
               sinks=sinks if fault == "sinks_per_stage" else None, softcap=softcap)
    o, lse = _CPAttentionFn.apply(q, k, v, cfg)
    if sinks is not None and fault != "sinks_per_stage":
        o, lse = apply_sinks(o, lse, sinks)  # once, after every stage is merged
    return (o, lse) if return_lse else o
