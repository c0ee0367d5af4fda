"""Context-parallel tree attention (`megatron_tree.cp.tree_attention_cp`) against single-device
`ops.tree_attention`, its KV schedule against a brute-force dense mask, and sensitivity: planted
executor bugs must make the equivalence fail.

Plans are built directly as `CPPlan` objects (random, chunked, contiguous, zigzag-like, everything
on one rank, empty ranks), independent of the planner. The distributed checks run on gloo in float64,
several cases per spawned run (spawning costs seconds).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_tree.cp import CPPlan, build_schedule, schedule_figures, tree_attention_cp
from megatron_tree.cp.planning.schedule import remote_needs

try:
    from tests.dist import run_distributed
    from tests.forests import random_forest, test_plan
except ImportError:  # run from inside tests/
    from dist import run_distributed
    from forests import random_forest, test_plan


# ------------------------------------------------------------------------------ plans for tests
def _plan(layout, kind: str, cp: int, waves: int, seed: int = 0) -> CPPlan:
    return test_plan(layout, kind, cp, seed, waves=waves)


def _forest(seed: int):
    layout, _ = random_forest(seed, num_trees=3, max_len=8, max_depth=3, num_padding=2)
    return layout


def _dense_visible(layout, window):
    n = layout.num_rows
    q = np.arange(n)[:, None]
    k = np.arange(n)[None, :]
    vu = layout.visible_until.numpy()[None, :]
    vis = (k <= q) & (q < vu)
    if window is not None:
        pos = layout.position_ids.numpy()
        vis &= (pos[:, None] - pos[None, :]) < window
    return vis


# ------------------------------------------------------------------------------ schedule (no dist)
@pytest.mark.parametrize("window", [None, 1, 3, 6])
def test_schedule_matches_dense_mask(window):
    for seed in range(4):
        layout = _forest(seed)
        vis = _dense_visible(layout, window)
        for cp, kind, waves in [(2, "random", 1), (3, "chunks", 2), (4, "zigzag", 3), (4, "empty_last", 2),
                                (3, "contiguous", 4), (2, "all_on_1", 2)]:
            plan = _plan(layout, kind, cp, waves, seed)
            needs = remote_needs(plan, window)
            scheds = [build_schedule(plan, r, window=window) for r in range(cp)]
            figs = schedule_figures(plan, window)
            for r in range(cp):
                mine = plan.owner == r
                expect = np.flatnonzero(vis[mine].any(0) & ~mine)
                np.testing.assert_array_equal(needs[r], expect, err_msg=f"{kind} cp={cp} rank={r} w={window}")
                s = scheds[r]
                np.testing.assert_array_equal(s.owned, np.flatnonzero(mine))
                # waves: contiguous near-equal parts of the sorted needs (np.array_split)
                parts = np.array_split(expect, waves)
                assert s.num_waves == waves
                for wave, part in zip(s.waves, parts):
                    np.testing.assert_array_equal(wave.rows, part)
                    assert sum(wave.recv_splits) == part.shape[0]
                    np.testing.assert_array_equal(wave.rows[wave.recv_order][wave.sorted_from_recv], wave.rows)
                    np.testing.assert_array_equal(wave.visible_until, plan.visible_until[part])
                assert s.remote_rows_total == expect.shape[0] == figs["remote_rows"][r]
                assert s.remote_rows_peak == max(p.shape[0] for p in parts) == figs["peak_remote_rows"][r]
                assert s.sent_rows_total == figs["sent_rows"][r]
            # every send matches the receiver's slot: what s sends r in wave w is what r expects from s
            for w in range(waves):
                total = sum(scheds[r].waves[w].rows.shape[0] for r in range(cp))
                for r in range(cp):
                    wr = scheds[r].waves[w]
                    assert wr.global_rows == total
                    recv_rows = wr.rows[wr.recv_order]
                    roff = np.concatenate([[0], np.cumsum(wr.recv_splits)])
                    for src in range(cp):
                        ws = scheds[src].waves[w]
                        soff = np.concatenate([[0], np.cumsum(ws.send_splits)])
                        sent = scheds[src].owned[ws.send_local[soff[r]:soff[r + 1]]]
                        np.testing.assert_array_equal(sent, recv_rows[roff[src]:roff[src + 1]])
                        assert (plan.owner[sent] == src).all()


def test_schedule_window_fetches_less_and_waves_bound_peak():
    layout = _forest(11)
    plan1 = _plan(layout, "random", 4, 1, 3)
    plan4 = _plan(layout, "random", 4, 4, 3)
    f1, f4 = schedule_figures(plan1), schedule_figures(plan4)
    np.testing.assert_array_equal(f1["remote_rows"], f4["remote_rows"])
    assert (f4["peak_remote_rows"] <= -(-f1["remote_rows"] // 4)).all()
    assert (f4["peak_remote_rows"] < f1["peak_remote_rows"]).any()
    fw = schedule_figures(plan1, window=2)
    assert (fw["remote_rows"] <= f1["remote_rows"]).all() and fw["remote_rows"].sum() < f1["remote_rows"].sum()
    # cached per (plan hash, rank, window)
    assert build_schedule(plan1, 2) is build_schedule(plan1, 2)
    assert build_schedule(plan1, 2, window=2) is not build_schedule(plan1, 2)
    with pytest.raises(ValueError, match="outside the CP group"):
        build_schedule(plan1, 4)
    with pytest.raises(ValueError, match="window"):
        build_schedule(plan1, 0, window=0)


def test_cp1_without_process_group_and_errors():
    from megatron_tree.ops import tree_attention

    layout = _forest(5)
    n = layout.num_rows
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    plan = _plan(layout, "all_on_0", 1, 2)
    torch.testing.assert_close(tree_attention_cp(q, k, v, plan, window=3),
                               tree_attention(q, k, v, layout, window=3, backend="torch"))
    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        tree_attention_cp(q, k, v, _plan(layout, "random", 2, 1))
    with pytest.raises(ValueError, match="owner_rows"):
        tree_attention_cp(q[1:], k[1:], v[1:], plan)
    with pytest.raises(TypeError, match="CPPlan"):
        tree_attention_cp(q, k, v, object())


# ------------------------------------------------------------------------------ distributed equivalence
def _case(seed, kind, waves, *, window=None, sinks=False, hq=2, hkv=2, d=8, dv=8, recompute=False, fault=None,
          plan_seed=0, softcap=None):
    return dict(seed=seed, kind=kind, waves=waves, window=window, sinks=sinks, hq=hq, hkv=hkv, d=d, dv=dv,
                recompute=recompute, fault=fault, plan_seed=plan_seed, softcap=softcap)


def _run_cases(cases):
    """On every rank: run each case through tree_attention_cp and compare with the single-device
    reference on this rank's rows. Returns per case the max errors and this rank's sinks grad."""
    import torch.distributed as dist

    import megatron_tree.cp.execution.attention as cpa
    from megatron_tree.cp.execution.comm import fetch_rows
    from megatron_tree.ops import tree_attention

    rank, cp = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    out = []
    for c in cases:
        layout = _forest(c["seed"])
        n = layout.num_rows
        plan = _plan(layout, c["kind"], cp, c["waves"], c["plan_seed"])
        g = torch.Generator().manual_seed(1000 + c["seed"])
        f64 = dict(generator=g, dtype=torch.float64)
        q = torch.randn(n, c["hq"], c["d"], **f64)
        k = torch.randn(n, c["hkv"], c["d"], **f64)
        v = torch.randn(n, c["hkv"], c["dv"], **f64)
        go = torch.randn(n, c["hq"], c["dv"], **f64)
        glse = torch.randn(n, c["hq"], **f64)
        sinks = torch.randn(c["hq"], **f64) if c["sinks"] else None
        q, k, v, go, glse = (t.to(dev) for t in (q, k, v, go, glse))
        sinks = None if sinks is None else sinks.to(dev)

        # reference: the whole layout on one device
        qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
        sr = None if sinks is None else sinks.clone().requires_grad_(True)
        o_ref, lse_ref = tree_attention(qr, kr, vr, layout.to(dev), window=c["window"], sinks=sr, return_lse=True,
                                        backend="torch", softcap=c["softcap"])
        ((o_ref * go).sum() + (lse_ref * glse).sum()).backward()

        rows = torch.as_tensor(plan.owner_rows(rank), device=dev)
        ql, kl, vl = (t[rows].clone().requires_grad_(True) for t in (q, k, v))
        sl = None if sinks is None else sinks.clone().requires_grad_(True)
        cpa._FAULT = c["fault"]
        try:
            o, lse = tree_attention_cp(ql, kl, vl, plan, None, window=c["window"], sinks=sl, return_lse=True,
                                       recompute=c["recompute"], backend="torch", softcap=c["softcap"])
            ((o * go[rows]).sum() + (lse * glse[rows]).sum()).backward()
            with torch.no_grad():  # inference: no stage graphs kept, same collectives in forward
                o_ng = tree_attention_cp(ql, kl, vl, plan, None, window=c["window"], sinks=sl, backend="torch",
                                         softcap=c["softcap"])
        finally:
            cpa._FAULT = None

        def err(a, b):
            return float((a.detach() - b.detach()).abs().max()) if a.numel() else 0.0

        out.append(dict(
            o=err(o, o_ref[rows]), o_nograd=err(o_ng, o_ref[rows]), lse=err(lse, lse_ref[rows]),
            dq=err(ql.grad, qr.grad[rows]),
            dk=err(kl.grad, kr.grad[rows]), dv=err(vl.grad, vr.grad[rows]),
            # (a planted "sinks_per_stage" fault detaches the sinks: no gradient reaches them)
            sinks_grad=None if sl is None else (torch.zeros_like(sl) if sl.grad is None else sl.grad).cpu(),
            sinks_ref=None if sr is None else sr.grad.cpu(),
            n_local=int(rows.numel()), remote=build_schedule(plan, rank, window=c["window"]).remote_rows_total))

    # the autograd all-to-all of comm.py: fetch wave 0 of a 1-wave plan, gradient added by the owners
    layout = _forest(3)
    plan = _plan(layout, "random", cp, 1, 7)
    s = build_schedule(plan, rank)
    wave = s.waves[0]
    x_glob = torch.arange(layout.num_rows, dtype=torch.float64).unsqueeze(1).repeat(1, 3).to(dev)
    x = x_glob[torch.as_tensor(s.owned, device=dev)].clone().requires_grad_(True)
    got = fetch_rows(x, torch.as_tensor(wave.send_local, device=dev), wave.send_splits, wave.recv_splits)
    recv_rows = torch.as_tensor(wave.rows[wave.recv_order], device=dev)
    fetch_ok = bool(torch.equal(got, x_glob[recv_rows]))
    (got * (recv_rows.unsqueeze(1).double() + 1)).sum().backward()
    needs = remote_needs(plan)
    times = np.zeros(layout.num_rows)
    for r in range(cp):
        times[needs[r]] += 1
    expect = torch.as_tensor((times[s.owned] * (s.owned + 1.0))[:, None].repeat(3, 1), device=dev)
    fetch_grad_ok = bool(torch.allclose(x.grad, expect))

    # overlap order: each fetch is issued before the compute it overlaps (forward: local stage, then
    # wave w while wave w + 1 moves; backward: wave w's dK/dV return while the next stage computes)
    import megatron_tree.cp.execution.comm as cps  # forward fetches go through comm.start_fetch

    events = []
    real_x, real_s = cpa.start_exchange, cpa.tree_attention_partial
    cpa.start_exchange = cps.start_exchange = lambda *a, **kw: (events.append("x"), real_x(*a, **kw))[1]
    cpa.tree_attention_partial = lambda *a, **kw: (events.append("s"), real_s(*a, **kw))[1]
    try:
        layout = _forest(2)
        plan = _plan(layout, "random", cp, 3, 1)
        rows = torch.as_tensor(plan.owner_rows(rank), device=dev)
        x = torch.randn(layout.num_rows, 2, 4, dtype=torch.float64, device=dev)[rows].requires_grad_(True)
        o = tree_attention_cp(x, x, x, plan)
        events.append("|")
        o.sum().backward()
    finally:
        cpa.start_exchange, cpa.tree_attention_partial = real_x, real_s
        cps.start_exchange = real_x

    # a second backward through a retained graph (the kept stage graphs are gone: it recomputes)
    g1 = x.grad.clone()
    x.grad = None
    o = tree_attention_cp(x, x, x, plan)
    o.sum().backward(retain_graph=True)
    o.sum().backward()
    twice_ok = bool(torch.allclose(x.grad, 2 * g1, rtol=1e-12, atol=1e-12))

    # a wrong row count fails with a clear error on the rank that has it, before any collective
    try:
        z = torch.zeros(plan.owner_rows(rank).size + 1, 2, 4, dtype=torch.float64, device=dev)
        tree_attention_cp(z, z, z, plan)
        bad_rows = None
    except ValueError as e:
        bad_rows = str(e)
    return dict(cases=out, fetch_ok=fetch_ok, fetch_grad_ok=fetch_grad_ok, bad_rows=bad_rows, events="".join(events),
                twice_ok=twice_ok)


_TOL = 1e-10
_METRICS = ("o", "o_nograd", "lse", "dq", "dk", "dv")


def _check_exact(results, cases):
    for i, c in enumerate(cases):
        per_rank = [r["cases"][i] for r in results]
        for m in _METRICS:
            worst = max(p[m] for p in per_rank)
            assert worst < _TOL, f"case {c}: {m} differs by {worst}"
        if c["sinks"]:
            total = sum(p["sinks_grad"] for p in per_rank)  # each rank's sinks grad covers its own queries
            torch.testing.assert_close(total, per_rank[0]["sinks_ref"], rtol=0, atol=_TOL)
    for r in results:
        assert r["fetch_ok"] and r["fetch_grad_ok"] and r["twice_ok"]
        assert r["bad_rows"] is not None and "owner_rows" in r["bad_rows"]


_FAULT_CASES = [
    # each fault with the metric it must break
    (_case(21, "random", 2), "skip_merge", "o"),
    (_case(22, "random", 3), "drop_wave", "o"),
    (_case(23, "random", 2), "no_dkv_return", "dk"),
    (_case(24, "random", 2, sinks=True), "sinks_per_stage", "o"),
]


def test_cp_attention_2_ranks_and_sensitivity():
    cases = [
        _case(1, "random", 1),
        _case(2, "random", 3, window=4, sinks=True, hq=4, hkv=2, d=8, dv=5),
        _case(3, "contiguous", 2, window=3),
        _case(4, "zigzag", 2, sinks=True, hq=4, hkv=1),
        _case(5, "all_on_1", 2, sinks=True),  # rank 0 owns nothing; rank 1 needs nothing remote
        _case(6, "all_on_0", 1),
        _case(2, "random", 3, window=4, sinks=True, hq=4, hkv=2, d=8, dv=5, recompute=True),
        _case(7, "chunks", 4, hq=4, hkv=2, dv=6, recompute=True),
        _case(8, "random", 2, window=4, sinks=True, hq=4, hkv=2, softcap=0.7),  # Gemma 2's soft-cap, per stage
        _case(9, "zigzag", 3, softcap=1.5, recompute=True),
    ]
    faults = [dict(c, fault=f) for c, f, _ in _FAULT_CASES]
    results = run_distributed(_run_cases, 2, cases + faults, timeout=120)
    _check_exact(results, cases)
    assert results[0]["cases"][4]["n_local"] == 0 and results[1]["cases"][4]["remote"] == 0
    # forward: fetch 0, local stage, then per wave "issue the next fetch, compute this wave";
    # backward (kept graphs, no recompute): per wave its dK/dV return is issued after its stage
    for r in results:
        assert r["events"] == "xsxsxss|xxx", r["events"]
    for j, (c, fault, metric) in enumerate(_FAULT_CASES):
        per_rank = [r["cases"][len(cases) + j] for r in results]
        assert max(p["remote"] for p in per_rank) > 0
        worst = max(p[metric] for p in per_rank)
        assert worst > 1e-3, f"fault {fault!r} went unnoticed: max {metric} error {worst}"


def test_cp_attention_4_ranks():
    cases = [
        _case(8, "empty_last", 2, window=5, sinks=True, hq=4, hkv=2, d=6, dv=4),
        _case(9, "zigzag", 3, recompute=True, hq=2, hkv=1),
        _case(10, "contiguous", 1, sinks=True),  # rank 0 needs nothing remote
        _case(11, "all_on_2", 2),
        _case(12, "random", 4, window=2, hq=4, hkv=2, dv=3),
    ]
    results = run_distributed(_run_cases, 4, cases, timeout=150)
    _check_exact(results, cases)
    assert results[3]["cases"][0]["n_local"] == 0
    assert results[0]["cases"][2]["remote"] == 0 and any(r["cases"][2]["remote"] > 0 for r in results)
