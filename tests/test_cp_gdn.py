"""Tree Gated DeltaNet under context parallelism (`megatron_tree.cp.tree_gdn_cp`) against the
single-device layer (`tree_causal_conv1d` -> silu -> l2norm -> `tree_gated_delta_rule` on the whole
tree): outputs and every input gradient, float64, gloo, both modes ("summary": affine state
summaries + pointer-doubling scan + conv halos; "heads": token <-> head all-to-all).

Also: the single-device forest / summary ops against the recurrence, associativity of summary
composition, the host plan (pieces, entry forest, rounds, halo taps) against brute force, the
cost figures, and sensitivity: planted executor bugs (a dropped summary, a child started from zero,
a halo from the physical row above) must make the equivalence fail.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_tree.cp import CPPlan
from megatron_tree.tree.layout import TreeLayout

try:
    from tests.dist import run_distributed
    from tests.forests import random_forest, test_plan
except ImportError:  # run from inside tests/
    from dist import run_distributed
    from forests import random_forest, test_plan

F64 = torch.float64


# ------------------------------------------------------------------------------ layouts and plans
def _layout(kind: str, seed: int) -> TreeLayout:
    if kind == "forest":
        return random_forest(seed, num_trees=3, max_len=8, max_depth=3, num_padding=2)[0]
    if kind == "chain":  # one long segment: only ownership splits it
        return TreeLayout.from_segments([23 + seed % 5], [-1], num_padding=1)
    if kind == "forks":  # a root with three children, the middle one with two children of its own
        return TreeLayout.from_segments([7, 3, 5, 2, 4, 6], [-1, 0, 0, 2, 2, 0])
    if kind == "deep":  # few long segments, forks at several depths
        return random_forest(seed, num_trees=1, max_len=14, max_depth=4, num_padding=0)[0]
    raise ValueError(kind)


def _plan(layout: TreeLayout, kind: str, cp: int, seed: int = 0) -> CPPlan:
    # this file's "chunks" are runs of random length (unaligned piece boundaries)
    return test_plan(layout, "runs" if kind == "chunks" else kind, cp, seed)


def _inputs(n, H, HV, K, V, W, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    C = 2 * H * K + HV * V
    f = dict(generator=g, dtype=F64)
    qkv = torch.randn(n, C, **f)
    gg = -torch.nn.functional.softplus(torch.randn(n, HV, **f))
    beta = torch.rand(n, HV, **f)
    w = 0.5 * torch.randn(C, W, **f)
    b = 0.1 * torch.randn(C, **f) if bias else None
    go = torch.randn(n, HV, V, **f)
    return qkv, gg, beta, w, b, go


# ------------------------------------------------------------------------------ single-device ops
def _gdn_inputs(n, H, HV, K, V, seed):
    from megatron_tree.ops.gated_delta_rule import l2norm

    gen = torch.Generator().manual_seed(seed)
    f = dict(generator=gen, dtype=F64)
    q, k = l2norm(torch.randn(n, H, K, **f)), l2norm(torch.randn(n, H, K, **f))
    v = torch.randn(n, HV, V, **f)
    g = -torch.nn.functional.softplus(torch.randn(n, HV, **f))
    beta = torch.rand(n, HV, **f)
    return [t.requires_grad_(True) for t in (q, k, v, g, beta)]


def _grads(outputs, inputs, seed):
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=F64)).sum() for o in outputs)
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def _close(a, b, tol=1e-11):
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, rtol=0, atol=tol)


@pytest.mark.parametrize("H, HV", [(2, 2), (1, 3)])
def test_forest_op_matches_tree_op(H, HV):
    from megatron_tree.ops.gated_delta_rule import gated_delta_rule_forest, tree_gated_delta_rule

    for seed in range(3):
        layout = _layout("forest", seed)
        n, off = layout.num_rows, layout.segment_offsets
        x = _gdn_inputs(n, H, HV, 4, 3, seed)
        ref = tree_gated_delta_rule(*x, layout, backend="torch")
        o, fin = gated_delta_rule_forest(*x, off[:-1], off[1:] - off[:-1], layout.segment_parent,
                                         final_segments=[], chunk_size=3)
        assert fin.shape == (0, HV, 4, 3)
        torch.testing.assert_close(o, ref, rtol=0, atol=1e-12)
        _close(_grads([o], x, seed), _grads([ref], x, seed))


def test_forest_op_with_cut_edges_and_initial_states():
    """Cutting tree edges and feeding each cut child its parent's final state as an initial state
    (what a CP rank does with a remote parent) changes nothing, gradients included; segments of the
    second run are not in preorder (a root sits between a parent and its child)."""
    from megatron_tree.ops.gated_delta_rule import gated_delta_rule_forest

    layout = _layout("forest", 4)
    n, off, par = layout.num_rows, layout.segment_offsets, layout.segment_parent.numpy()
    start, length = off[:-1].numpy(), (off[1:] - off[:-1]).numpy()
    x = _gdn_inputs(n, 2, 4, 3, 2, 7)
    full, _ = gated_delta_rule_forest(*x, start, length, par, chunk_size=4)
    cut = (par >= 0) & (np.arange(par.size) % 2 == 0)
    assert cut.any() and ((par >= 0) & ~cut).any()
    parents = np.unique(par[cut])
    _, fin = gated_delta_rule_forest(*x, start, length, par, final_segments=parents, chunk_size=4)
    idx = np.where(cut, np.searchsorted(parents, par), -1)
    o, _ = gated_delta_rule_forest(*x, start, length, np.where(cut, -1, par), initial_state=fin,
                                   initial_index=idx, chunk_size=2)
    torch.testing.assert_close(o, full, rtol=0, atol=1e-12)
    _close(_grads([o], x, 1), _grads([full], x, 1))
    # rows no segment covers get 0; a subset of segments runs alone
    keep = np.flatnonzero(par < 0)
    o_sub, _ = gated_delta_rule_forest(*x, start[keep], length[keep], np.full(keep.size, -1))
    rows = np.concatenate([np.arange(start[s], start[s] + length[s]) for s in keep])
    other = np.setdiff1d(np.arange(n), rows)
    torch.testing.assert_close(o_sub[rows], full[rows], rtol=0, atol=1e-12)
    assert float(o_sub.detach()[other].abs().max()) == 0.0


def test_forest_op_errors():
    from megatron_tree.ops.gated_delta_rule import gated_delta_rule_forest

    x = _gdn_inputs(6, 1, 1, 2, 2, 0)
    with pytest.raises(ValueError, match="earlier segment"):
        gated_delta_rule_forest(*x, [0, 3], [3, 3], [1, -1])
    with pytest.raises(ValueError, match="overlap"):
        gated_delta_rule_forest(*x, [0, 2], [3, 3], [-1, -1])
    with pytest.raises(ValueError, match="inside the 6 input rows"):
        gated_delta_rule_forest(*x, [0, 4], [3, 3], [-1, -1])
    with pytest.raises(ValueError, match="initial_state is None"):
        gated_delta_rule_forest(*x, [0], [6], [-1], initial_index=[0])
    with pytest.raises(ValueError, match="final_segments"):
        gated_delta_rule_forest(*x, [0], [6], [-1], final_segments=[1])


def test_summary_is_the_affine_map_of_the_recurrence():
    """``M S_in + E`` equals the final state of the recurrence run from ``S_in`` (values and
    gradients), on a forest whose roots all start from unknown states."""
    from megatron_tree.ops.gated_delta_rule import gated_delta_rule_forest, gated_delta_rule_summary

    layout = _layout("forest", 9)
    n, off, par = layout.num_rows, layout.segment_offsets, layout.segment_parent.numpy()
    start, length = off[:-1].numpy(), (off[1:] - off[:-1]).numpy()
    S = par.size
    H, HV, K, V = 2, 4, 3, 2
    x = _gdn_inputs(n, H, HV, K, V, 3)
    S_in = torch.randn(S, HV, K, V, dtype=F64, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    roots = np.flatnonzero(par < 0)
    root_of = roots[np.searchsorted(roots, np.arange(S), side="right") - 1]  # preorder: last root at or before
    segs = np.arange(S)
    M, E = gated_delta_rule_summary(*x[1:], start, length, par, segs, chunk_size=3)
    pred = M @ S_in[root_of] + E
    _, fin = gated_delta_rule_forest(*x, start, length, par, initial_state=S_in,
                                     initial_index=np.where(par < 0, segs, -1), final_segments=segs)
    torch.testing.assert_close(pred, fin, rtol=0, atol=1e-12)
    inputs = x[1:] + [S_in]
    _close(_grads([pred], inputs, 2), _grads([fin], inputs, 2))


def test_summary_composition_is_associative():
    """Summaries of three consecutive parts of a chain compose to the summary of the whole chain,
    grouped either way; the composition is not commutative."""
    from megatron_tree.cp.execution.gdn import compose_summaries
    from megatron_tree.ops.gated_delta_rule import gated_delta_rule_summary

    T = 17
    x = _gdn_inputs(T, 2, 2, 3, 4, 11)
    k, v, g, beta = x[1:]
    cuts = [0, 5, 6, T]  # unaligned parts, one of a single row
    parts = gated_delta_rule_summary(k, v, g, beta, cuts[:-1], np.diff(cuts), [-1, -1, -1], [0, 1, 2])
    a, b, c = [(parts[0][i], parts[1][i]) for i in range(3)]
    whole = gated_delta_rule_summary(k, v, g, beta, [0], [T], [-1], [0])
    left = compose_summaries(compose_summaries(c, b), a)
    right = compose_summaries(c, compose_summaries(b, a))
    for got in (left, right):
        torch.testing.assert_close(got[0], whole[0][0], rtol=0, atol=1e-12)
        torch.testing.assert_close(got[1], whole[1][0], rtol=0, atol=1e-12)
    swapped = compose_summaries(a, c)
    assert float((swapped[1] - compose_summaries(c, a)[1]).detach().abs().max()) > 1e-3


# ------------------------------------------------------------------------------ host plan
def _a2a(tables, transfers):
    """Simulate one all-to-all of `gdn_plan.Transfer`s: tables[r] [rows, ...] -> received per rank."""
    cp = len(tables)
    chunks = []
    for s in range(cp):
        t = transfers[s]
        sent = tables[s][t.send_local]
        chunks.append(np.split(sent, np.cumsum(t.send_splits)[:-1]))
    out = []
    for r in range(cp):
        got = np.concatenate([chunks[s][r] for s in range(cp)]) if cp else np.zeros(0)
        assert got.shape[0] == sum(transfers[r].recv_splits)
        out.append(got[transfers[r].recv_order])
    return out


PLAN_CASES = [(lay, own, cp) for cp in (2, 3, 5, 8) for lay, own in
              [(("forest", 1), ("random", 0)), (("chain", 2), ("cycle", 3)), (("forks", 0), ("chunks", 2)),
               (("deep", 3), ("chunks", 1)), (("forest", 4), ("empty_last", 5)), (("deep", 6), ("zigzag", 0)),
               (("forest", 7), ("all_on_1", 0))]]


@pytest.mark.parametrize("lay, own, cp", PLAN_CASES)
def test_plan_scan_delivers_every_entry_state(lay, own, cp):
    """The host plan, run with scalar affine maps per piece (``s -> a s + e``) through simulated
    exchanges, gives every entry the state of its true predecessor path; rounds are log-depth."""
    from megatron_tree.cp.planning.gdn_plan import gdn_pieces, gdn_rank_plan

    layout = _layout(*lay)
    plan = _plan(layout, own[0], cp, own[1])
    pcs = gdn_pieces(plan, layout)
    P = pcs.num_pieces
    # pieces tile the rows; each is one owner, one segment, and maximal
    assert pcs.start[0] == 0 and (pcs.start + pcs.length)[-1] == layout.num_rows
    assert np.array_equal(pcs.start[1:], (pcs.start + pcs.length)[:-1])
    seg = layout.segment_ids.numpy()
    for p in range(P):
        rows = np.arange(pcs.start[p], pcs.start[p] + pcs.length[p])
        assert (plan.owner[rows] == pcs.owner[p]).all() and (seg[rows] == seg[rows[0]]).all()
    # predecessor: the piece holding the row before the start on the path (segment_parent's last row)
    prev = layout.path_prev.numpy()
    piece_of_row = np.repeat(np.arange(P), pcs.length)
    expect = np.where(prev[pcs.start] >= 0, piece_of_row[np.maximum(prev[pcs.start], 0)], -1)
    assert np.array_equal(pcs.pred, expect)
    # truth by walking pieces in order (a predecessor comes first)
    rng = np.random.default_rng(cp)
    a, e = rng.uniform(0.5, 1.5, P), rng.normal(size=P)
    s_in, s_out = np.zeros(P), np.zeros(P)
    for p in range(P):
        s_in[p] = s_out[pcs.pred[p]] if pcs.pred[p] >= 0 else 0.0
        s_out[p] = a[p] * s_in[p] + e[p]
    rps = [gdn_rank_plan(plan, layout, r, 3)[0] for r in range(cp)]
    E_tab, M_tab, entries = [], [], []
    for r, rp in enumerate(rps):
        rows = plan.owner_rows(r)
        mine = pcs.owner == r
        for run, sel in ((rp.anchored, mine & ~pcs.floating), (rp.summary, mine & pcs.upstream),
                         (rp.finish, mine & pcs.floating)):
            ids = np.flatnonzero(sel)
            assert np.array_equal(rows[run.seg_start], pcs.start[ids]) and np.array_equal(run.seg_len, pcs.length[ids])
        fa = np.zeros(rp.anchored.seg_start.size)
        ida = np.flatnonzero(mine & ~pcs.floating)
        for i, par in enumerate(rp.anchored.seg_parent):
            fa[i] = a[ida[i]] * (fa[par] if par >= 0 else 0.0) + e[ida[i]]
        ids = np.flatnonzero(mine & pcs.upstream)
        Ms, Es = np.zeros(ids.size), np.zeros(ids.size)
        for i, par in enumerate(rp.summary.seg_parent):
            Ms[i] = a[ids[i]] * (Ms[par] if par >= 0 else 1.0)
            Es[i] = a[ids[i]] * (Es[par] if par >= 0 else 0.0) + e[ids[i]]
        E_tab.append(np.concatenate([fa[rp.anchored.final], Es[rp.summary.final]])[rp.exit_order])
        M_tab.append(Ms[rp.summary.final])
        entries.append(pcs.entries[pcs.owner[pcs.entries] == r])
    B = _a2a(E_tab, [rp.init_states for rp in rps])
    got_M = _a2a(M_tab, [rp.init_maps for rp in rps])
    A = []
    for r, rp in enumerate(rps):
        A.append(np.zeros(rp.num_entries))
        A[r][rp.init_maps_at] = got_M[r]
    for i in range(len(pcs.rounds)):
        Bj = _a2a(B, [rp.rounds[i].states for rp in rps])
        Aj = _a2a(A, [rp.rounds[i].maps for rp in rps])
        for r, rp in enumerate(rps):
            rd = rp.rounds[i]
            B_new, A_new = A[r][rd.req] * Bj[r] + B[r][rd.req], A[r][rd.full] * Aj[r]
            B[r] = B[r].copy()
            A[r] = A[r].copy()
            B[r][rd.req], A[r][rd.full] = B_new, A_new
    for r, rp in enumerate(rps):
        np.testing.assert_allclose(B[r], s_in[entries[r]], rtol=1e-12, atol=1e-12)
        f = rp.finish
        roots = np.flatnonzero(f.seg_parent < 0)
        assert (f.initial_index[roots] >= 0).all()
        ids = np.flatnonzero((pcs.owner == r) & pcs.floating)
        np.testing.assert_allclose(B[r][f.initial_index[roots]], s_in[ids[roots]], rtol=1e-12, atol=1e-12)
    # log-depth: the longest chain of entries in the entry forest
    depth = np.ones(pcs.entries.size, np.int64)
    for i in range(pcs.entries.size):  # parents come first
        if pcs.entry_parent[i] >= 0:
            depth[i] = depth[pcs.entry_parent[i]] + 1
    d = int(depth.max(initial=0))
    assert len(pcs.rounds) == (math.ceil(math.log2(d)) if d > 1 else 0)


@pytest.mark.parametrize("lay, own, cp", PLAN_CASES[::3])
@pytest.mark.parametrize("W", [1, 2, 4])
def test_halo_taps_follow_the_tree_path(lay, own, cp, W):
    from megatron_tree.cp.planning.gdn_plan import gdn_rank_plan

    layout = _layout(*lay)
    plan = _plan(layout, own[0], cp, own[1])
    halos = [gdn_rank_plan(plan, layout, r, W)[1] for r in range(cp)]
    fetched = _a2a([plan.owner_rows(r) for r in range(cp)], [h.fetch for h in halos])
    prev = np.append(layout.path_prev.numpy(), -1)
    for r, h in enumerate(halos):
        ext = np.concatenate([plan.owner_rows(r), fetched[r], [-1]])
        assert h.num_halo == fetched[r].size and (plan.owner[fetched[r]] != r).all()
        want = plan.owner_rows(r)
        for k in range(W):
            np.testing.assert_array_equal(ext[h.taps[k]], want)
            want = prev[want]


def test_cost_figures_and_mode_choice():
    from megatron_tree.cp.planning.gdn_plan import GDNCostModel, GDNHeads, choose_mode, gdn_cp_figures, gdn_rank_plan

    layout = _layout("forest", 2)
    heads = GDNHeads(2, 4, 8, 8, 4)
    one = _plan(layout, "all_on_0", 2)
    f = gdn_cp_figures(one, layout, heads)
    s = f["summary"]
    assert s["bytes_sent"].sum() == 0 and s["rounds"] == 0 and s["collectives"] == 0 and s["summary_rows"].sum() == 0
    assert s["flops"][1] == 0 and f["heads"]["flops"][0] == f["heads"]["flops"][1]
    for cp, kind in ((2, "random"), (4, "chunks"), (3, "cycle")):
        f = gdn_cp_figures(_plan(layout, kind, cp, 1), layout, heads)
        for m in ("summary", "heads"):
            if f[m] is not None:
                assert f[m]["bytes_sent"].sum() == pytest.approx(f[m]["bytes_recv"].sum())
        assert (f["heads"] is None) == (4 % cp != 0)
        assert f["summary"]["rounds"] >= 1 and (f["summary"]["halo_rows"] > 0).all()
        plan = _plan(layout, kind, cp, 1)
        for r in range(cp):  # the figures (global arrays) count what each rank's transfers move
            rp, halo = gdn_rank_plan(plan, layout, r, heads.conv_width)
            moves = dict(halo_rows=[halo.fetch], state_rows=[rp.init_states] + [rd.states for rd in rp.rounds],
                         map_rows=[rp.init_maps] + [rd.maps for rd in rp.rounds])
            for name, ts in moves.items():
                far = sum(t.rows_sent - t.send_splits[r] + t.rows_received - t.recv_splits[r] for t in ts)
                assert f["summary"][name][r] == far, (name, r)
    bytes_cost = GDNCostModel(sec_per_flop=1e-15, sec_per_byte=1.0)
    assert choose_mode(one, layout, heads, cost=bytes_cost) == "summary"  # moves nothing
    free_moves = GDNCostModel(sec_per_byte=0.0, sec_per_collective=0.0)
    assert choose_mode(one, layout, heads, cost=free_moves) == "heads"  # balances the work
    assert choose_mode(_plan(layout, "random", 3), layout, heads) == "summary"  # 3 does not divide HV


def test_cp1_errors_and_env_override(monkeypatch):
    import megatron_tree.cp.execution.gdn as cpg
    from megatron_tree.cp.execution.gdn import default_gdn_cp_mode, tree_gdn_cp
    from megatron_tree.cp.planning.gdn_plan import GDNHeads, check_heads_mode
    from megatron_tree.ops import tree_causal_conv1d, tree_gated_delta_rule
    from megatron_tree.ops.gated_delta_rule import l2norm

    layout = _layout("forest", 3)
    N = layout.num_rows
    qkv, g, beta, w, b, _ = _inputs(N, 1, 2, 3, 2, 4, 0)
    one = _plan(layout, "all_on_0", 1)
    kw = dict(num_k_heads=1, head_k_dim=3, head_v_dim=2, backend="torch")
    y = tree_causal_conv1d(qkv, w, b, layout, activation="silu")
    q, k, v = y[:, :3].reshape(N, 1, 3), y[:, 3:6].reshape(N, 1, 3), y[:, 6:].reshape(N, 2, 2)
    ref = tree_gated_delta_rule(l2norm(q), l2norm(k), v, g, beta, layout, backend="torch")
    torch.testing.assert_close(tree_gdn_cp(qkv, g, beta, w, b, layout, one, **kw), ref, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        tree_gdn_cp(qkv, g, beta, w, b, layout, _plan(layout, "random", 2), **kw)
    with pytest.raises(ValueError, match="owner_rows"):
        tree_gdn_cp(qkv[1:], g[1:], beta[1:], w, b, layout, one, **kw)
    with pytest.raises(ValueError, match="channels"):
        tree_gdn_cp(qkv, g, beta, w, b, layout, one, **dict(kw, head_k_dim=2))
    with pytest.raises(ValueError, match="gdn_cp_mode"):
        tree_gdn_cp(qkv, g, beta, w, b, layout, one, mode="rows", **kw)
    with pytest.raises(TypeError, match="CPPlan"):
        tree_gdn_cp(qkv, g, beta, w, b, layout, object(), **kw)
    with pytest.raises(ValueError, match="must divide"):
        check_heads_mode(GDNHeads(1, 2, 3, 2, 4), 4)
    monkeypatch.setenv(cpg.MODE_ENV, "heads")
    assert default_gdn_cp_mode() == "heads"
    monkeypatch.setenv(cpg.MODE_ENV, "rows")
    with pytest.raises(ValueError, match="MEGATRON_TREE_GDN_CP_MODE"):
        default_gdn_cp_mode()


# ------------------------------------------------------------------------------ distributed body
def _case(layout, owner, seed=0, *, mode="summary", H=2, HV=4, K=4, V=3, W=4, bias=True, act="silu", l2=True,
          fault=None):
    return dict(layout=layout, owner=owner, seed=seed, mode=mode, H=H, HV=HV, K=K, V=V, W=W, bias=bias, act=act,
                l2=l2, fault=fault)


def _run_cases(cases):
    import torch.distributed as dist

    import megatron_tree.cp.execution.gdn as cpg
    from megatron_tree.cp.execution.gdn import tree_gdn_cp

    torch.set_num_threads(1)
    rank, cp = dist.get_rank(), dist.get_world_size()
    out = []
    for c in cases:
        layout = _layout(*c["layout"])
        plan = _plan(layout, c["owner"][0], cp, c["owner"][1])
        N = layout.num_rows
        qkv, g, beta, w, b, go = _inputs(N, c["H"], c["HV"], c["K"], c["V"], c["W"], 100 + c["seed"], c["bias"])
        act = {"silu": "silu", "none": None, "tanh": torch.tanh}[c["act"]]
        kw = dict(num_k_heads=c["H"], head_k_dim=c["K"], head_v_dim=c["V"], activation=act, qk_l2norm=c["l2"],
                  backend="torch")
        # reference: the whole tree on one device (cp=1 path: the single-device ops)
        ref_plan = CPPlan(1, "one", np.zeros(N, np.int32), plan.visible_until, plan.position_ids)
        leaves = [t.clone().requires_grad_(True) for t in (qkv, g, beta, w)] + [
            None if b is None else b.clone().requires_grad_(True)]
        o_ref = tree_gdn_cp(*leaves[:4], leaves[4], layout, ref_plan, **kw)
        (o_ref * go).sum().backward()

        rows = torch.as_tensor(plan.owner_rows(rank))
        mine = [t[rows].clone().requires_grad_(True) for t in (qkv, g, beta)]
        wl = w.clone().requires_grad_(True)
        bl = None if b is None else b.clone().requires_grad_(True)
        cpg._FAULT = c["fault"]
        try:
            o = tree_gdn_cp(*mine, wl, bl, layout, plan, None, mode=c["mode"], **kw)
            if o.requires_grad:  # not on a rank that owns nothing in a call with no exchange at all
                (o * go[rows]).sum().backward()
            with torch.no_grad():
                o_ng = tree_gdn_cp(*mine, wl, bl, layout, plan, None, mode=c["mode"], **kw)
        finally:
            cpg._FAULT = None
        dw = torch.zeros_like(w) if wl.grad is None else wl.grad.clone()
        dist.all_reduce(dw)  # parameters are replicated over CP: their gradients are summed
        db = None
        if bl is not None:
            db = torch.zeros_like(b) if bl.grad is None else bl.grad.clone()
            dist.all_reduce(db)

        def err(a, r):
            a = torch.zeros_like(r) if a is None else a
            return float((a.detach() - r.detach()).abs().max()) if r.numel() else 0.0

        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in mine]
        out.append(dict(o=err(o, o_ref[rows]), o_nograd=err(o_ng, o_ref[rows]),
                        dqkv=err(grads[0], leaves[0].grad[rows]), dg=err(grads[1], leaves[1].grad[rows]),
                        dbeta=err(grads[2], leaves[2].grad[rows]), dw=err(dw, leaves[3].grad),
                        db=0.0 if b is None else err(db, leaves[4].grad), n_local=int(rows.numel())))
    return out


_TOL = 1e-10
_METRICS = ("o", "o_nograd", "dqkv", "dg", "dbeta", "dw", "db")


def _check_exact(results, cases, offset=0):
    for i, c in enumerate(cases):
        per_rank = [r[offset + i] for r in results]
        for m in _METRICS:
            worst = max(p[m] for p in per_rank)
            assert worst < _TOL, f"case {c}: {m} differs by {worst}"


# each fault with the metric it must break (summary mode: faults live in its exchange / halo code)
_FAULT_CASES = [
    (_case(("chain", 0), ("cycle", 1), 1, fault="drop_summary"), "o"),
    (_case(("forks", 0), ("chunks", 2), 2, fault="zero_child"), "o"),
    (_case(("forest", 1), ("random", 0), 3, fault="physical_halo"), "o"),
]

_CASES_2 = [
    _case(("forest", 1), ("random", 0)),
    _case(("forest", 1), ("random", 0), mode="heads"),
    _case(("chain", 0), ("cycle", 1)),                      # pieces of 1-3 rows: halos over several pieces
    _case(("chain", 2), ("chunks", 4), mode="heads"),
    _case(("forks", 0), ("chunks", 2)),                     # children whose parent lives on the other rank
    _case(("deep", 3), ("chunks", 1), H=1, HV=2, K=3, V=2, bias=False, act="tanh"),
    _case(("deep", 3), ("chunks", 1), H=1, HV=2, K=3, V=2, mode="heads"),  # one key head on both ranks
    _case(("forest", 5), ("all_on_1", 0), act="none"),      # rank 0 owns nothing
    _case(("forest", 5), ("all_on_0", 0), mode="heads", l2=False),
    _case(("forest", 6), ("zigzag", 0), H=3, HV=6, K=2, V=2, mode="heads"),  # unaligned key heads per shard
    _case(("forest", 6), ("random", 2), W=2),
    _case(("chain", 3), ("random", 1), W=1, mode="auto"),
]


def test_cp_gdn_2_ranks_and_sensitivity():
    faults = [c for c, _ in _FAULT_CASES]
    results = run_distributed(_run_cases, 2, _CASES_2 + faults, timeout=240)
    _check_exact(results, _CASES_2)
    assert results[0][7]["n_local"] == 0 and results[1][8]["n_local"] == 0
    for j, (c, metric) in enumerate(_FAULT_CASES):
        worst = max(r[len(_CASES_2) + j][metric] for r in results)
        assert worst > 1e-3, f"fault {c['fault']!r} went unnoticed: max {metric} error {worst}"


_CASES_4 = [
    _case(("forest", 5), ("random", 2)),
    _case(("forest", 5), ("random", 2), mode="heads"),     # HV/cp = 1 < G = 2: key heads replicated
    _case(("chain", 0), ("cycle", 1)),
    _case(("deep", 3), ("chunks", 1), K=3, V=5),
    _case(("forest", 8), ("empty_last", 3)),
    _case(("forest", 8), ("empty_last", 3), mode="heads", HV=8, H=4),
    _case(("forks", 0), ("all_on_2", 0)),
]


def test_cp_gdn_4_ranks():
    results = run_distributed(_run_cases, 4, _CASES_4, timeout=240)
    _check_exact(results, _CASES_4)
    assert results[3][4]["n_local"] == 0


def test_distributed_cases_hold_the_hard_structures():
    """The cases above really contain what they are meant to test (host-side check, no ranks)."""
    from megatron_tree.cp.planning.gdn_plan import gdn_pieces, gdn_rank_plan

    def pieces(case, cp):
        layout = _layout(*case["layout"])
        plan = _plan(layout, case["owner"][0], cp, case["owner"][1])
        return layout, plan, gdn_pieces(plan, layout)

    _, _, chain = pieces(_CASES_2[2], 2)
    assert (chain.length < 4).sum() >= 3 and len(chain.rounds) >= 2  # short pieces, a multi-round scan
    _, _, forks = pieces(_CASES_2[4], 2)
    assert (forks.entry & forks.segment_start).any()  # a child whose parent lives on the other rank
    assert (forks.entry & ~forks.segment_start).any()  # a segment split across ranks
    layout, plan, chain4 = pieces(_CASES_4[2], 4)
    # a halo spanning several ranks: some row's W-1 path predecessors live on two other ranks
    prev = np.append(layout.path_prev.numpy(), -1)
    taps = [prev[np.arange(layout.num_rows)]]
    for _ in range(2):
        taps.append(prev[taps[-1]])
    own = np.where(np.stack(taps) >= 0, plan.owner[np.stack(taps)], -1)
    remote = [len(set(own[:, i]) - {-1, plan.owner[i]}) for i in range(layout.num_rows)]
    assert max(remote) >= 2 and sum(gdn_rank_plan(plan, layout, r, 4)[1].num_halo for r in range(4)) > 0
    for case, cp in zip(_FAULT_CASES, (2, 2, 2)):
        assert len(pieces(case[0], cp)[2].rounds) >= 1


def test_verify_hybrid_cp_heads_mode_forced(monkeypatch):
    """Model level against per-sample training with the head transpose forced at CP2 (for verify's
    model, "auto" picks summary mode at CP2 and heads mode at CP4: tests/test_megatron_verify.py)."""
    from megatron_tree.cp.execution.gdn import MODE_ENV
    from megatron_tree.training.verify import VerifyConfig, format_report, run_verify_many

    monkeypatch.setenv(MODE_ENV, "heads")  # inherited by the spawned ranks
    cfg = VerifyConfig(model="hybrid", pattern="G*-", cp=2, dtype="float64", loss="grpo", cp_strategy="zigzag")
    out = run_verify_many([cfg])[0]
    assert out["passed"], format_report(cfg, out)


# ------------------------------------------------------------------------------ the Megatron module
def _module_body(modes):
    """`TreeGatedDeltaNet` at CP2 (``gdn_cp_mode`` given to the constructor) against the same weights
    in a CP1 module (separate 1-rank CP group) running the whole tree: outputs, input and parameter
    gradients (summed over CP as Megatron's DP x CP reduction does). Plans: random ownership, and all
    rows on rank 1 (rank 0 holds one padding row only)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_tree.megatron.gdn import TreeGatedDeltaNet, tree_gdn_module_spec
    from megatron_tree.megatron.packed_seq import TreePackedSeqParams, context_parallel_view

    try:
        from tests.dist import init_megatron
    except ImportError:
        from dist import init_megatron
    init_megatron(cp=2)
    torch.set_default_dtype(F64)
    rank = dist.get_rank()
    singles = [dist.new_group([r]) for r in range(2)]  # every rank creates every group
    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True, params_dtype=F64,
                normalization="RMSNorm", activation_func=F.silu, hidden_dropout=0.0, attention_dropout=0.0,
                linear_conv_kernel_dim=4, linear_key_head_dim=4, linear_value_head_dim=3, linear_num_key_heads=2,
                linear_num_value_heads=4)
    cfg_cp, cfg_one = TransformerConfig(context_parallel_size=2, **base), TransformerConfig(**base)
    layout = _layout("forest", 12)
    N = layout.num_rows
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(N, 1, 16, generator=gen, dtype=F64)
    go = torch.randn(N, 1, 16, generator=gen, dtype=F64)
    out = []
    for mode in modes:
        m = build_module(tree_gdn_module_spec(conv_bias=True, gdn_cp_mode=mode), config=cfg_cp, layer_number=1)
        assert isinstance(m, TreeGatedDeltaNet) and m.gdn_cp_mode == mode
        with torch.no_grad():
            for name, p in sorted(m.named_parameters()):  # O(1) weights, the same on both ranks
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)), dtype=F64) * 0.5)
        pg = ProcessGroupCollection(tp=ps.get_tensor_model_parallel_group(), cp=singles[rank])
        ref = build_module(tree_gdn_module_spec(conv_bias=True), config=cfg_one, layer_number=1, pg_collection=pg)
        ref.load_state_dict(m.state_dict())
        x_ref = hidden.clone().requires_grad_(True)
        y_ref, _ = ref(x_ref, packed_seq_params=TreePackedSeqParams(layout=layout))
        (y_ref * go).sum().backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        for kind in ("random", "all_on_1"):
            plan = _plan(layout, kind, 2, 5)
            psp = context_parallel_view(TreePackedSeqParams(layout=layout), plan, rank)
            rows = psp.local_rows
            n = int(rows.numel())
            x = torch.cat([hidden[rows], torch.zeros(psp.num_local_padding, 1, 16)]).requires_grad_(True)
            m.zero_grad()
            y, _ = m(x, packed_seq_params=psp)
            assert y.shape[0] == n + psp.num_local_padding
            (y[:n] * go[rows]).sum().backward()
            err = dict(mode=mode, kind=kind, n=n, pad=psp.num_local_padding,
                       y=float((y[:n] - y_ref[rows]).detach().abs().max()) if n else 0.0,
                       dx=float((x.grad[:n] - x_ref.grad[rows]).abs().max()) if n else 0.0)
            worst = 0.0
            for name, p in m.named_parameters():
                # a rank that owns nothing and exchanges nothing leaves the mixer's own parameters without
                # a gradient (None): it contributes zero to Megatron's DP x CP reduction
                gsum = torch.zeros_like(p) if p.grad is None else p.grad.clone()
                dist.all_reduce(gsum, group=ps.get_context_parallel_group())
                worst = max(worst, float((gsum - ref_grads[name]).abs().max()))
            err["dparams"] = worst
            out.append(err)
    return out


def test_tree_gdn_module_under_cp_each_mode():
    results = run_distributed(_module_body, 2, ("summary", "heads"), timeout=300)
    for per_rank in zip(*results):
        for e in per_rank:
            for m in ("y", "dx", "dparams"):
                assert e[m] < 1e-10, e
    assert results[0][1]["n"] == 0 and results[0][1]["pad"] == 1  # an empty rank still runs the layer
