"""Gated DeltaNet over a context-parallel group: `tree_gdn_cp` (short conv + gated delta rule).

Each CP rank holds the pre-conv ``qkv`` channels, ``g`` and ``beta`` of its owned rows
(``plan.owner_rows(rank)``, ascending) and gets back ``o`` for those rows, equal to the
single-device ``tree_causal_conv1d -> activation -> l2norm -> tree_gated_delta_rule`` on the whole
tree. Two executions, chosen per call (`gdn_plan.choose_mode`, identical on every rank) or forced:

* ``"summary"``: conv halos (the ``W-1`` rows before each row along ``path_prev``, from whichever
  ranks own them) arrive by one row exchange and the conv runs on owned rows. Local trees that
  start at a true root run at once; every floating tree (starting where the state crosses from
  another rank) first yields affine summaries ``S_out = M S_in + E`` of its exits, made from its own
  tokens before any state is known (`ops.gated_delta_rule_summary`). Entry states follow from a
  pointer-doubling scan over the entry forest (``M_BA = M_B M_A``, ``E_BA = M_B E_A + E_B``):
  after an initial exchange of exit summaries, ``ceil(log2 depth)`` rounds each fetch the current
  composed map of the entry being jumped to. Forks need nothing special: a parent's final state is
  an exit read by every child entry, on whatever rank. Finally each floating tree runs from its
  true entry state (`ops.gated_delta_rule_forest`).
* ``"heads"``: one all-to-all turns token shards into value-head shards (every row, ``HV/cp``
  value heads and the key heads they read, replicated when ``HV/cp`` is smaller than the group
  size ``HV/H``), the single-device ops run on the whole tree, the inverse all-to-all brings the
  outputs home. No halo and no scan; work is balanced whatever the ownership; moves every row's
  channels. Needs ``cp | HV``.

Autograd: every exchange is a differentiable row all-to-all whose backward sends gradients back
and adds them where rows were read (a halo row or an exit state read by several ranks sums their
gradients); compositions and forest runs are plain torch ops, so the reverse scan, sibling gradient
sums into a parent state and halo gradient returns all come from autograd. Collectives are ordered
collectives, so every rank must run the same ones in the same order in backward too, whatever rows
it owns: each exchange takes the previous exchange's output as an extra (gradient-free) input and
the result is tied to the last one. Backward of exchange ``i`` therefore waits for exchange
``i + 1``'s, on every rank, and none is skipped (a rank with nothing to send still passes empty
blocks). Which exchanges run is decided from the global plan, never from local sizes.
"""
from __future__ import annotations

import os
from typing import Callable, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from ...ops.causal_conv1d import tree_causal_conv1d
from ...ops.gated_delta_rule import gated_delta_rule_forest, gated_delta_rule_summary, l2norm, tree_gated_delta_rule
from ...tree.layout import TreeLayout
from ..planning.gdn_plan import (
    MODES,
    GDNCostModel,
    GDNHeads,
    check_heads_mode,
    choose_mode,
    gdn_heads_plan,
    gdn_heads_plan_of_owner,
    gdn_rank_plan,
    heads_mode_fits,
)
from ..planning.plan import CPPlan
from .carry import carried_gdn, own_rank_of
from .comm import group_rank, start_exchange

__all__ = ["tree_gdn_cp", "compose_summaries", "default_gdn_cp_mode", "MODE_ENV"]

#: TEST-ONLY fault switch (tests/test_cp_gdn.py); always None in real use. Each value plants one
#: known bug the equivalence tests must catch: "drop_summary" (the first doubling round does not
#: compose: entries lose the summaries of earlier ranks), "zero_child" (a child segment whose parent
#: lives on another rank starts from the zero state), "physical_halo" (a remote conv tap reads the
#: physical row above instead of the row on the tree path). Collectives still run.
_FAULT: Optional[str] = None

#: Environment override of ``mode="auto"`` (tests and experiments): "summary" or "heads".
MODE_ENV = "MEGATRON_TREE_GDN_CP_MODE"


def default_gdn_cp_mode() -> str:
    """``$MEGATRON_TREE_GDN_CP_MODE`` if set (checked), else "auto"."""
    mode = os.environ.get(MODE_ENV, "auto") or "auto"
    if mode not in MODES:
        raise ValueError(f"${MODE_ENV}={mode!r}: choose one of {MODES}")
    return mode


def compose_summaries(later, earlier):
    """``(M_B, E_B) o (M_A, E_A) = (M_B M_A, M_B E_A + E_B)``: A runs first, then B.

    M [..., K, K], E [..., K, V] (any matching batch dims). Associative, not commutative: the scan
    may group compositions in any order but must keep path order.
    """
    (Mb, Eb), (Ma, Ea) = later, earlier
    return Mb @ Ma, Mb @ Ea + Eb


def _zeros_like(shape, dtype, device) -> torch.Tensor:
    """A zero gradient without the memory: autograd accumulates into an expanded tensor out of place."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


# ------------------------------------------------------------------------------- exchanges
class _Exchange(torch.autograd.Function):
    """Row all-to-all ``x[send_local] -> received``; backward returns gradients to the rows' owners
    (added: a row sent several times collects every reader's gradient). ``after`` only orders
    backward: it receives a zero gradient, so its producer's backward runs after this one."""

    @staticmethod
    def forward(ctx, x, after, send_local, send_splits, recv_splits, group):
        ctx.save_for_backward(send_local)
        ctx.meta = (send_splits, recv_splits, group, x.shape[0])
        ctx.after_shape = None if after is None else (after.shape, after.dtype, after.device)
        return start_exchange(x.index_select(0, send_local), send_splits, recv_splits, group).wait()

    @staticmethod
    def backward(ctx, grad):
        (send_local,) = ctx.saved_tensors
        send_splits, recv_splits, group, n = ctx.meta
        back = start_exchange(grad.contiguous(), recv_splits, send_splits, group).wait()
        dx = grad.new_zeros((n,) + tuple(grad.shape[1:])).index_add_(0, send_local, back)
        d_after = None
        if ctx.after_shape is not None:
            shape, dtype, device = ctx.after_shape
            d_after = _zeros_like(shape, dtype, device)
        return dx, d_after, None, None, None, None


class _Tie(torch.autograd.Function):
    """``x`` unchanged; ``after`` gets a zero gradient (makes the last exchange part of the graph)."""

    @staticmethod
    def forward(ctx, x, after):
        ctx.after_shape = (after.shape, after.dtype, after.device)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.after_shape
        return grad, _zeros_like(shape, dtype, device)


class _Chain:
    """Issues the exchanges of one layer call in order, each tied to the previous one."""

    def __init__(self, group):
        self.group, self.last = group, None

    def move(self, table: torch.Tensor, t, dev) -> torch.Tensor:
        """``t`` (a `gdn_plan.Transfer`) applied to ``table``: received rows in transfer-id order."""
        if t.total == 0:  # nothing moves anywhere in the group: every rank skips it alike
            return table.new_zeros((0,) + tuple(table.shape[1:]))
        got = self.exchange(table, torch.as_tensor(t.send_local, device=dev), t.send_splits, t.recv_splits)
        return got.index_select(0, torch.as_tensor(t.recv_order, device=dev))

    def exchange(self, table, send_local, send_splits, recv_splits):
        """Rows ``table[send_local]`` out (``send_splits`` per destination), received rows grouped by source."""
        out = _Exchange.apply(table, self.last, send_local, tuple(send_splits), tuple(recv_splits), self.group)
        self.last = out
        return out

    def tie(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.last is None else _Tie.apply(x, self.last)


# ------------------------------------------------------------------------------- entry point
def tree_gdn_cp(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                conv_bias: Optional[torch.Tensor], layout: TreeLayout, plan: CPPlan, group=None, *,
                num_k_heads: int, head_k_dim: int, head_v_dim: int,
                activation: Union[str, None, Callable] = "silu", qk_l2norm: bool = True, scale: Optional[float] = None,
                mode: str = "auto", backend: str = "auto", cost: Optional[GDNCostModel] = None, carry=None,
                key=None) -> torch.Tensor:
    """Tree Gated DeltaNet (conv + recurrence) of this rank's rows under the CP ``plan``.

    qkv [n, 2*H*K + HV*V]  pre-conv channels ``[q heads | k heads | v heads]`` of the rows
                           ``plan.owner_rows(rank)`` (ascending), ``n`` possibly 0
    g, beta [n, HV]        log decay (<= 0) and write strength, computed token-locally
    conv_weight [C, W], conv_bias [C] or None: the depthwise conv (``weight[:, W-1]`` is the row)
    layout                 the whole microbatch's `TreeLayout` (the same on every rank)
    activation             "silu", None, or a callable applied after the conv
    mode                   "auto" (cost model, same choice on every rank), "summary" or "heads"
    backend                tree-op backend for heads mode ("auto": FLA on CUDA bf16/fp16)

    carry / key            carry (`cp.execution.carry`): the microbatch's whole `CarryView` (its own rows, not
                           this rank's share) and the layer's store key; the rows are then this rank's own
                           rows (``plan.owner_rows(rank)`` among ``carry.own``), heads mode runs (each rank
                           holds every own row of its heads: the carried conv and recurrence run there, and
                           its store holds its heads' state), and ``mode`` must be "auto" or "heads"

    Returns o [n, HV, V] in qkv's dtype, equal to the single-device layer. Every rank of ``group``
    (default: the world) must call it with the same plan, layout, shapes and mode.
    """
    if not isinstance(plan, CPPlan):
        raise TypeError(f"tree_gdn_cp needs a CPPlan, got {type(plan).__name__}")
    if mode not in MODES:
        raise ValueError(f"gdn_cp_mode must be one of {MODES}; got {mode!r}")
    if plan.num_rows != layout.num_rows:
        raise ValueError(f"the CP plan covers {plan.num_rows} rows but the layout has {layout.num_rows}")
    cp = plan.cp_size
    rank = group_rank(plan, group, "tree_gdn_cp") if cp > 1 else 0
    owner = plan.owner if carry is None else own_rank_of(carry, plan)
    n = int((owner == rank).sum())
    HV = int(g.shape[1]) if g.dim() == 2 else -1
    H, K, V = int(num_k_heads), int(head_k_dim), int(head_v_dim)
    if qkv.dim() != 2 or qkv.shape[0] != n:
        raise ValueError(f"qkv must be [n, C] with n = {n} rows (plan.owner_rows({rank})); got {tuple(qkv.shape)}")
    if g.shape != (n, HV) or beta.shape != (n, HV) or HV < 1:
        raise ValueError(f"g and beta must be [n, HV] = [{n}, HV]; got {tuple(g.shape)} and {tuple(beta.shape)}")
    heads = GDNHeads(H, HV, K, V, int(conv_weight.shape[1]))
    if qkv.shape[1] != heads.conv_channels or conv_weight.shape[0] != heads.conv_channels:
        raise ValueError(f"qkv and conv_weight need C = 2*{H}*{K} + {HV}*{V} = {heads.conv_channels} channels; got "
                         f"{qkv.shape[1]} and {tuple(conv_weight.shape)}")
    if activation not in ("silu", None) and not callable(activation):
        raise ValueError(f"activation must be 'silu', None or a callable; got {activation!r}")
    if carry is not None:
        if mode == "summary" or not heads_mode_fits(heads, cp):
            raise ValueError("carry under tree CP runs Gated DeltaNet in heads mode (each rank continues its heads' "
                             f"carried state over every own row): the CP size ({cp}) must divide the value heads of "
                             f"this TP rank ({heads.num_v_heads}), and gdn_cp_mode='summary' is not supported")
        return _heads(qkv, g, beta, conv_weight, conv_bias, layout, plan, group, rank, heads, activation, qk_l2norm,
                      scale, backend, carry=(carry, key))
    if cp == 1:
        return _single_device(qkv, g, beta, conv_weight, conv_bias, layout, heads, activation, qk_l2norm, scale,
                              backend)
    if mode == "auto":
        es = qkv.element_size()
        mode = choose_mode(plan, layout, heads, cost=cost, act_bytes=es, state_bytes=max(4, es))
    if mode == "heads":
        check_heads_mode(heads, cp)
        return _heads(qkv, g, beta, conv_weight, conv_bias, layout, plan, group, rank, heads, activation, qk_l2norm,
                      scale, backend)
    return _summary(qkv, g, beta, conv_weight, conv_bias, layout, plan, group, rank, heads, activation, qk_l2norm,
                    scale)


def _activate(y, activation):
    if activation == "silu":
        return F.silu(y)
    return y if activation is None else activation(y)


def _qkv_heads(y, n, H_q, HV_v, K, V, qk_l2norm):
    q, k, v = torch.split(y, [H_q * K, H_q * K, HV_v * V], dim=-1)
    q, k, v = q.reshape(n, H_q, K), k.reshape(n, H_q, K), v.reshape(n, HV_v, V)
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q, k, v


def _single_device(qkv, g, beta, w, b, layout, heads, activation, qk_l2norm, scale, backend):
    n = qkv.shape[0]
    y = tree_causal_conv1d(qkv, w, b, layout, activation="silu" if activation == "silu" else None)
    if activation != "silu":
        y = _activate(y, activation)
    q, k, v = _qkv_heads(y, n, heads.num_k_heads, heads.num_v_heads, heads.head_k_dim, heads.head_v_dim, qk_l2norm)
    return tree_gated_delta_rule(q, k, v, g, beta, layout, scale=scale, backend=backend)


# ------------------------------------------------------------------------------- summary mode
def _summary(qkv, g, beta, w, b, layout, plan, group, rank, heads, activation, qk_l2norm, scale):
    dev = qkv.device
    n, C = qkv.shape
    H, HV, K, V, W = heads.num_k_heads, heads.num_v_heads, heads.head_k_dim, heads.head_v_dim, heads.conv_width
    rp, halo = gdn_rank_plan(plan, layout, rank, W, physical_halo=_FAULT == "physical_halo")
    chain = _Chain(group)
    t = lambda a: torch.as_tensor(a, device=dev)  # noqa: E731

    # conv: owned rows + fetched halo rows + one zero row; tap k reads k steps back along the path
    fetched = chain.move(qkv, halo.fetch, dev)
    dtype = torch.promote_types(qkv.dtype, w.dtype)
    xe = torch.cat([qkv, fetched, qkv.new_zeros(1, C)]).to(dtype)
    wd = w.to(dtype)
    y = None if b is None else b.to(dtype).expand(n, C)
    for j in range(W):
        term = xe.index_select(0, t(halo.taps[j])) * wd[:, W - 1 - j]
        y = term if y is None else y + term
    q, k, v = _qkv_heads(_activate(y, activation), n, H, HV, K, V, qk_l2norm)

    # local trees from a true root: outputs now, and the final states other ranks start from
    a = rp.anchored
    o, fin_a = gated_delta_rule_forest(q, k, v, g, beta, a.seg_start, a.seg_len, a.seg_parent, final_segments=a.final,
                                       scale=scale)
    # floating trees: affine summaries of their exits, before any incoming state is known
    s = rp.summary
    M, E = gated_delta_rule_summary(k, v, g, beta, s.seg_start, s.seg_len, s.seg_parent, s.final)
    cdt = fin_a.dtype
    E_tab = torch.cat([fin_a, E.to(cdt)]).index_select(0, t(rp.exit_order))

    # entry states: X_e = A_e X_{jump(e)} + B_e, pointer doubling until every jump is the zero state
    B = chain.move(E_tab, rp.init_states, dev)
    A_recv = chain.move(M.to(cdt), rp.init_maps, dev)
    A = A_recv.new_zeros((rp.num_entries, HV, K, K)).index_copy(0, t(rp.init_maps_at), A_recv)
    for i, rd in enumerate(rp.rounds):
        B_j = chain.move(B, rd.states, dev)
        A_j = chain.move(A, rd.maps, dev)
        if _FAULT == "drop_summary" and i == 0:
            continue
        req, full = t(rd.req), t(rd.full)
        # compose_summaries((A_e, B_e), (A_j, B_j)), split: the B part for every requester, the A
        # part only where the target is not final yet (a final target's X is B_j: A_e A_j unused)
        B_new = A.index_select(0, req) @ B_j + B.index_select(0, req)
        A_new = A.index_select(0, full) @ A_j
        B, A = B.index_copy(0, req, B_new), A.index_copy(0, full, A_new)

    # floating trees from their true entry states
    f = rp.finish
    init_index = f.initial_index
    if _FAULT == "zero_child":
        init_index = init_index.copy()
        init_index[rp.fault_zero_child] = -1
    o_f, _ = gated_delta_rule_forest(q, k, v, g, beta, f.seg_start, f.seg_len, f.seg_parent, initial_state=B,
                                     initial_index=init_index, scale=scale)
    return chain.tie(o + o_f).to(qkv.dtype)


# ------------------------------------------------------------------------------- heads mode
def _heads(qkv, g, beta, w, b, layout, plan, group, rank, heads, activation, qk_l2norm, scale, backend, carry=None):
    dev = qkv.device
    n, cp = qkv.shape[0], plan.cp_size
    HV, K, V = heads.num_v_heads, heads.head_k_dim, heads.head_v_dim
    if carry is None:
        hp = gdn_heads_plan(plan, layout, heads, rank)
        N = layout.num_rows
    else:  # the own rows only (`carry.own` order); made once per microbatch view
        view, key = carry
        memo = view.memo.setdefault("gdn_heads", {})
        if (heads, rank) not in memo:
            memo[(heads, rank)] = gdn_heads_plan_of_owner(own_rank_of(view, plan), cp, heads, rank)
        hp = memo[(heads, rank)]
        N = len(view.own)
    chain = _Chain(group)
    t = lambda a: torch.as_tensor(a, device=dev)  # noqa: E731
    # row (i, j) of the packed block is local row i's slice for rank j; sent destination-major
    send = (np.arange(n)[None, :] * cp + np.arange(cp)[:, None]).reshape(-1)
    recv = hp.n_by_rank

    def transpose(cols, table):
        packed = torch.cat([table, table.new_zeros(n, 1)], 1).index_select(1, t(cols.reshape(-1)))
        got = chain.exchange(packed.reshape(n * cp, cols.shape[1]), t(send), (n,) * cp, recv)
        return got.index_select(0, t(hp.from_source))  # [N, width] in global row order

    x = transpose(hp.qkv_cols, qkv)[:, :hp.my_qkv.size]
    gb_dtype = torch.promote_types(g.dtype, beta.dtype)  # g stays fp32 (or fp64) as the module made it
    gb = transpose(hp.gb_cols, torch.cat([g.to(gb_dtype), beta.to(gb_dtype)], 1))
    hv = hp.hv
    cols = t(hp.my_qkv)
    w, b = w.index_select(0, cols), None if b is None else b.index_select(0, cols)
    nk = hp.k_heads.size
    kv = None if hp.key_of_value is None else t(hp.key_of_value)
    if carry is not None:  # this rank's heads over every own row, continuing carried rows' state
        o = carried_gdn(x, gb[:, :hv].to(g.dtype), gb[:, hv:].to(beta.dtype), w, b, layout, view, key,
                        num_k_heads=nk, head_k_dim=K, head_v_dim=V, activation=activation, qk_l2norm=qk_l2norm,
                        scale=scale, key_of_value=kv, backend=backend)
    else:
        y = tree_causal_conv1d(x, w, b, layout, activation="silu" if activation == "silu" else None)
        if activation != "silu":
            y = _activate(y, activation)
        q, k, v = _qkv_heads(y, N, nk, hv, K, V, qk_l2norm)
        if kv is not None:  # fewer local value heads than a key head's group: one key per value head
            q, k = q.index_select(1, kv), k.index_select(1, kv)
        o = tree_gated_delta_rule(q, k, v, gb[:, :hv].to(g.dtype), gb[:, hv:].to(beta.dtype), layout, scale=scale,
                                  backend=backend)
    # home: each owner gets its rows of every head shard; shards arrive in rank (= head) order
    back = chain.exchange(o.reshape(N, hv * V), t(hp.rows_by_source), hp.n_by_rank, (n,) * cp)
    out = back.reshape(cp, n, hv, V).permute(1, 0, 2, 3).reshape(n, HV, V)
    return chain.tie(out).to(qkv.dtype)
