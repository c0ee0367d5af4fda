"""Context-parallel tree DSA (`megatron_tree.cp.tree_dsa_cp`) against single-device `ops.tree_dsa`,
and sensitivity: planted executor bugs (a rank-dependent tie rule, dropped gradient returns) must
make the equivalence fail.

Plans come from `tests.forests.test_plan` (random non-contiguous, chunked, contiguous, zigzag, an
empty rank, all rows on one rank), independent of the planner. gloo ranks, float64, several cases
per spawned run.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_tree.cp import CPPlan, build_schedule, tree_dsa_cp

try:
    from tests.dist import run_distributed
    from tests.forests import random_forest, test_plan
except ImportError:  # run from inside tests/
    from dist import run_distributed
    from forests import random_forest, test_plan


def _forest(seed: int):
    layout, _ = random_forest(seed, num_trees=3, max_len=8, max_depth=3, num_padding=2)
    return layout


def _case(seed, kind, waves, *, topk=4, hq=4, hk=2, d=6, dv=5, hi=2, di=4, loss=True, sparse=False, share=False,
          ties=False, monotone=False, fault=None, plan_seed=0, kv="winners"):
    return dict(seed=seed, kind=kind, waves=waves, topk=topk, hq=hq, hk=hk, d=d, dv=dv, hi=hi, di=di, loss=loss,
                sparse=sparse, share=share, ties=ties, monotone=monotone, fault=fault, plan_seed=plan_seed, kv=kv)


def _make_plan(layout, c, cp):
    if c["kind"] == "planner":  # the balanced planner's own plan for a DSA model
        from megatron_tree.cp import CostModel, DSAWork, plan_context_parallel

        return plan_context_parallel(layout, cp, cost_model=CostModel.cpu(), dsa=DSAWork(topk=c["topk"]),
                                     num_waves=c["waves"], chunk_size=3)
    return test_plan(layout, c["kind"], cp, c["plan_seed"], waves=c["waves"])


def _inputs(c, n):
    g = torch.Generator().manual_seed(500 + c["seed"])
    f64 = dict(generator=g, dtype=torch.float64)
    q = torch.randn(n, c["hq"], c["d"], **f64)
    k = torch.randn(n, c["hk"], c["d"], **f64)
    v = torch.randn(n, c["hk"], c["dv"], **f64)
    iq = torch.randn(n, c["hi"], c["di"], **f64)
    w = torch.randn(n, c["hi"], **f64)
    ik = torch.randn(n, c["di"], **f64)
    if c["ties"]:  # exact ties: every index key is one of two vectors
        ik = torch.randn(2, c["di"], **f64)[torch.randint(0, 2, (n,), generator=g)]
    if c["monotone"]:  # score strictly increasing in the key's row: the winner of topk=1 is the query itself
        u = torch.rand(c["di"], **f64) + 0.5
        ik = (torch.arange(n, dtype=torch.float64) + 1)[:, None] * u
        iq = torch.rand(n, c["hi"], 1, **f64)[:, :, :1] * u + 0.0
        w = torch.rand(n, c["hi"], **f64) + 0.1
    rw = torch.rand(n, **f64) + 0.1
    go = torch.randn(n, c["hq"], c["dv"], **f64)
    share = torch.randn(n, c["di"], **f64)  # other index keys: the "previous layer" of IndexShare
    return q, k, v, iq, w, ik, rw, go, share


def _run_cases(cases):
    import torch.distributed as dist

    import megatron_tree.cp.execution.dsa as cpd
    from megatron_tree.ops import tree_dsa
    from megatron_tree.ops.dsa import tree_dsa_topk

    rank, cp = dist.get_rank(), dist.get_world_size()
    out = []
    for c in cases:
        layout = _forest(c["seed"])
        n = layout.num_rows
        plan = _make_plan(layout, c, cp)
        q, k, v, iq, w, ik, rw, go, share_k = _inputs(c, n)
        scale = c["d"] ** -0.5
        sel_ref_in = tree_dsa_topk(iq, w, share_k, layout, c["topk"])[1] if c["share"] else None
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, iq, w, ik)]
        o_ref, ids_ref, loss_ref = tree_dsa(*leaves, layout, topk=c["topk"], softmax_scale=scale, selected=sel_ref_in,
                                           loss_row_weight=rw if c["loss"] else None, sparse_loss=c["sparse"])
        ((o_ref * go).sum() + (loss_ref if loss_ref is not None else 0)).backward()

        rows = torch.as_tensor(plan.owner_rows(rank))
        mine = [t[rows].clone().requires_grad_(True) for t in (q, k, v, iq, w, ik)]
        cpd._FAULT = c["fault"]
        try:
            o, ids, loss = tree_dsa_cp(*mine, plan, None, topk=c["topk"], softmax_scale=scale,
                                       selected=None if sel_ref_in is None else sel_ref_in[rows],
                                       loss_row_weight=rw[rows] if c["loss"] else None, sparse_loss=c["sparse"],
                                       kv_fetch=c["kv"])
            ((o * go[rows]).sum() + (loss if loss is not None else 0)).backward()
            with torch.no_grad():  # inference: same collectives in forward, no graphs kept
                o_ng, ids_ng, _ = tree_dsa_cp(*mine, plan, None, topk=c["topk"], softmax_scale=scale,
                                              selected=None if sel_ref_in is None else sel_ref_in[rows],
                                              loss_row_weight=rw[rows] if c["loss"] else None,
                                              sparse_loss=c["sparse"], kv_fetch=c["kv"])
        finally:
            cpd._FAULT = None

        def err(a, b):
            if a is None and b is None:
                return 0.0
            a = torch.zeros_like(b) if a is None else a
            return float((a.detach() - b.detach()).abs().max()) if a.numel() else 0.0

        owner = torch.as_tensor(plan.owner, dtype=torch.long)
        sel = ids[ids >= 0]
        out.append(dict(
            ids_equal=bool(torch.equal(ids, ids_ref[rows])) and bool(torch.equal(ids_ng, ids_ref[rows])),
            o=err(o, o_ref[rows]), o_nograd=err(o_ng, o_ref[rows]),
            dq=err(mine[0].grad, leaves[0].grad[rows]), dk=err(mine[1].grad, leaves[1].grad[rows]),
            dv=err(mine[2].grad, leaves[2].grad[rows]),
            diq=err(mine[3].grad, leaves[3].grad[rows] if c["loss"] and not c["share"] else torch.zeros_like(mine[3])),
            dw=err(mine[4].grad, leaves[4].grad[rows] if c["loss"] and not c["share"] else torch.zeros_like(mine[4])),
            dik=err(mine[5].grad, leaves[5].grad[rows] if c["loss"] and not c["share"] else torch.zeros_like(mine[5])),
            loss=None if loss is None else float(loss.detach()),
            loss_ref=None if loss_ref is None else float(loss_ref.detach()),
            n_local=int(rows.numel()), remote_stage_rows=build_schedule(plan, rank).remote_rows_total,
            remote_winners=int((owner[sel] != rank).sum()) if sel.numel() else 0))

    # errors name the rule broken, before any collective
    layout = _forest(1)
    plan = test_plan(layout, "random", cp, 0)
    m = plan.owner_rows(rank).size
    z = torch.zeros(m + 1, 2, 4, dtype=torch.float64)
    try:
        tree_dsa_cp(z, z, z, None, None, None, plan, topk=2, softmax_scale=1.0, selected=None)
        bad = None
    except ValueError as e:
        bad = str(e)
    return dict(cases=out, bad_rows=bad)


_TOL = 1e-11
_METRICS = ("o", "o_nograd", "dq", "dk", "dv", "diq", "dw", "dik")


def _check_exact(results, cases):
    for i, c in enumerate(cases):
        per_rank = [r["cases"][i] for r in results]
        assert all(p["ids_equal"] for p in per_rank), f"case {c}: selected ids differ from single device"
        for m in _METRICS:
            worst = max(p[m] for p in per_rank)
            assert worst < _TOL, f"case {c}: {m} differs by {worst}"
        if c["loss"] and not c["share"]:
            total = sum(p["loss"] for p in per_rank)  # each rank returns its queries' share
            ref = per_rank[0]["loss_ref"]
            assert abs(total - ref) <= 1e-12 * max(1.0, abs(ref)), f"case {c}: loss {total} vs {ref}"
        else:
            assert all(p["loss"] is None for p in per_rank)
    for r in results:
        assert r["bad_rows"] is not None and "owner_rows" in r["bad_rows"]


_FAULT_CASES = [
    # (case, fault, what must break)
    (_case(31, "random", 2, topk=3, ties=True, loss=False), "stage_order_ties", "ids"),
    (_case(32, "random", 2, topk=3), "no_dkv_return", "dk"),
    (_case(33, "chunks", 2, topk=3), "no_dik_return", "dik"),
    (_case(34, "random", 2, topk=3, kv="stages"), "no_dkv_return", "dk"),
    (_case(35, "random", 2, topk=3, kv="stages"), "no_dik_return", "dik"),
]


def _check_faults(results, offset):
    for j, (c, fault, metric) in enumerate(_FAULT_CASES):
        per_rank = [r["cases"][offset + j] for r in results]
        assert max(p["remote_stage_rows"] for p in per_rank) > 0
        if metric == "ids":
            assert not all(p["ids_equal"] for p in per_rank), f"fault {fault!r} went unnoticed"
        else:
            worst = max(p[metric] for p in per_rank)
            assert worst > 1e-3, f"fault {fault!r} went unnoticed: max {metric} error {worst}"


def test_tree_dsa_cp_2_ranks_and_sensitivity():
    cases = [
        _case(1, "random", 1),
        _case(2, "random", 3, topk=6, hq=2, hk=1, sparse=True),
        _case(3, "contiguous", 2, topk=2),
        _case(4, "zigzag", 2, topk=5, loss=False),
        _case(5, "all_on_1", 2),  # rank 0 owns nothing; rank 1 needs nothing remote
        _case(6, "chunks", 2, topk=3, share=True),  # IndexShare: no scoring, only winners' K/V move
        _case(7, "random", 2, topk=3, ties=True),  # exact ties across ranks: canonical ids decide
        _case(8, "contiguous", 2, topk=1, monotone=True),  # stages fetch rows but hold no winner
        _case(9, "random", 2, topk=40),  # topk above most visible counts: NO_ROW slots
        # kv_fetch="stages": every stage row's K|V travels with the candidates
        _case(1, "random", 3, kv="stages"),
        _case(2, "random", 2, topk=6, hq=2, hk=1, sparse=True, kv="stages"),
        _case(6, "chunks", 2, topk=3, share=True, kv="stages"),
        _case(4, "zigzag", 1, topk=5, loss=False, kv="stages"),
    ]
    faults = [dict(c, fault=f) for c, f, _ in _FAULT_CASES]
    results = run_distributed(_run_cases, 2, cases + faults, timeout=150)
    _check_exact(results, cases)
    assert results[0]["cases"][4]["n_local"] == 0 and results[1]["cases"][4]["remote_stage_rows"] == 0
    mono = [r["cases"][7] for r in results]
    assert any(p["remote_stage_rows"] > 0 for p in mono) and all(p["remote_winners"] == 0 for p in mono)
    assert any(r["cases"][0]["remote_winners"] > 0 for r in results)  # winners do move in the plain case
    _check_faults(results, len(cases))


def test_tree_dsa_cp_4_ranks():
    cases = [
        _case(11, "empty_last", 2, topk=3),
        _case(12, "zigzag", 3, topk=4, hq=2, hk=2, sparse=True),
        _case(13, "all_on_2", 2, topk=2),
        _case(14, "random", 4, topk=5, share=True),
        _case(15, "runs", 1, topk=3, ties=True),
        _case(16, "planner", 2, topk=4),
        _case(11, "empty_last", 3, topk=3, kv="stages"),
    ]
    results = run_distributed(_run_cases, 4, cases, timeout=150)
    _check_exact(results, cases)
    assert results[3]["cases"][0]["n_local"] == 0


def test_cp1_without_process_group():
    from megatron_tree.ops import tree_dsa

    layout = _forest(5)
    n = layout.num_rows
    c = _case(5, "all_on_0", 1, topk=3)
    q, k, v, iq, w, ik, rw, go, _ = _inputs(c, n)
    plan = test_plan(layout, "all_on_0", 1)
    o, ids, loss = tree_dsa_cp(q, k, v, iq, w, ik, plan, topk=3, softmax_scale=0.5, loss_row_weight=rw)
    o_r, ids_r, loss_r = tree_dsa(q, k, v, iq, w, ik, layout, topk=3, softmax_scale=0.5, loss_row_weight=rw)
    assert torch.equal(ids, ids_r)
    torch.testing.assert_close(o, o_r, rtol=0, atol=1e-12)
    torch.testing.assert_close(loss, loss_r, rtol=1e-12, atol=0)
    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        tree_dsa_cp(q, k, v, iq, w, ik, test_plan(layout, "random", 2), topk=3, softmax_scale=0.5)
    with pytest.raises(TypeError, match="CPPlan"):
        tree_dsa_cp(q, k, v, iq, w, ik, object(), topk=3, softmax_scale=0.5)
    with pytest.raises(ValueError, match="IndexShare"):
        tree_dsa_cp(q, k, v, None, None, None, plan, topk=3, softmax_scale=0.5)
    with pytest.raises(ValueError, match="canonical global rows"):
        tree_dsa_cp(q, k, v, None, None, None, plan, topk=3, softmax_scale=0.5,
                    selected=torch.full((n, 3), n, dtype=torch.long))
    assert isinstance(plan, CPPlan) and np.array_equal(plan.owner_rows(0), np.arange(n))


# ------------------------------------------------------------------------------ cost model / planner
def test_dsa_cost_model_against_hand_formula():
    import dataclasses

    from megatron_tree.cp.planning.cost_model import CostModel, DSAWork, RankLoads, simulate, simulate_reference

    dsa = DSAWork(topk=16, index_layers_fraction=0.75, index_fwd_ms_per_pair=2e-6, index_bwd_ms_per_pair=3e-6,
                  sel_fwd_ms_per_key=5e-5, sel_bwd_ms_per_key=7e-5, cand_bytes_per_row=100.0,
                  cand_grad_bytes_per_row=40.0, winner_kv_bytes_per_row=1000.0)
    cm = CostModel.gpu(overlap=0.0, dsa=dsa, layers=2)
    rng = np.random.default_rng(0)
    n = np.array([300.0, 200.0])
    m = np.array([[120.0], [0.0]])  # rank 1 needs nothing remote
    send = np.array([[0.0], [120.0]])
    lp, wp, sel = rng.uniform(1e4, 1e5, 2), m * 50, np.array([3000.0, 90.0])
    loads = RankLoads(rows=n, local_pairs=lp, wave_rows=m, wave_pairs=wp, send_rows=send,
                      local_tiles=np.zeros((2, 2)), wave_tiles=np.zeros((2, 1, 2)), sel_keys=sel)
    def staged(r, pair_f, pair_b, fwd_bytes, bwd_bytes):
        """(fwd, bwd) of one indexer layer's local stage + one wave, overlap 0 (by hand)."""
        busy = max(m[r, 0], send[r, 0])
        x = cm.comm_latency_ms + cm.comm_ms_per_byte * busy * fwd_bytes
        xd = cm.comm_latency_ms + cm.comm_ms_per_byte * busy * bwd_bytes
        local_f = cm.fwd_launch_ms + lp[r] * pair_f + cm.stage_row_ms * 2 * n[r]
        local_b = cm.bwd_launch_ms + lp[r] * pair_b + cm.stage_row_ms * 2 * n[r]
        has = m[r, 0] > 0
        rem_f = has * (cm.fwd_launch_ms + wp[r, 0] * pair_f + cm.stage_row_ms * (n[r] + m[r, 0])
                       + cm.merge_fwd_ms_per_row * n[r])
        rem_b = has * (cm.bwd_launch_ms + wp[r, 0] * pair_b + cm.stage_row_ms * (n[r] + m[r, 0])
                       + cm.merge_bwd_ms_per_row * n[r])
        return local_f + x + rem_f, rem_b + xd + local_b

    f, wkv = dsa.index_layers_fraction, dsa.winner_kv_bytes_per_row
    cm_stages = dataclasses.replace(cm, dsa=dataclasses.replace(dsa, kv_with_candidates=True))
    for sim, model in ((simulate, cm), (simulate_reference, cm), (simulate, cm_stages), (simulate_reference, cm_stages)):
        t = sim(model, loads)
        for r in range(2):
            if model.dsa.kv_with_candidates:  # K|V in the waves: no winners' fetch
                sf, sb = staged(r, dsa.index_fwd_ms_per_pair, dsa.index_bwd_ms_per_pair,
                                dsa.cand_bytes_per_row + wkv, dsa.cand_grad_bytes_per_row + wkv)
                kf, kb = staged(r, 0.0, 0.0, wkv, wkv)
                attn_f = f * sf + (1 - f) * kf + dsa.sel_fwd_ms_per_key * sel[r]
                attn_b = dsa.sel_bwd_ms_per_key * sel[r] + f * sb + (1 - f) * kb
            else:
                sf, sb = staged(r, dsa.index_fwd_ms_per_pair, dsa.index_bwd_ms_per_pair, dsa.cand_bytes_per_row,
                                dsa.cand_grad_bytes_per_row)
                win = min(m[r, 0], sel[r]) * wkv * cm.comm_ms_per_byte
                attn_f = f * sf + 3 * cm.comm_latency_ms + win + dsa.sel_fwd_ms_per_key * sel[r]
                attn_b = cm.comm_latency_ms + win + dsa.sel_bwd_ms_per_key * sel[r] + f * sb
            np.testing.assert_allclose(t.attn_fwd[r], attn_f, rtol=1e-12)
            np.testing.assert_allclose(t.attn_bwd[r], attn_b, rtol=1e-12)
            np.testing.assert_allclose(t.total[r], 2 * (attn_f + attn_b + n[r] * (cm.tok_fwd_ms_per_row
                                                                                 + cm.tok_bwd_ms_per_row)), rtol=1e-12)
    with pytest.raises(ValueError, match="sel_keys"):
        simulate(cm, dataclasses.replace(loads, sel_keys=None))
    with pytest.raises(ValueError, match="index_layers_fraction"):
        DSAWork(index_layers_fraction=1.5)
    # the profile round-trips through its dict / JSON form
    assert CostModel.from_dict(cm.to_dict()) == cm


def test_dsa_planner_terms_and_balance():
    from megatron_tree.cp import CostModel, PlanCache, plan_context_parallel
    from megatron_tree.cp.planning.cost_model import DSAWork
    from megatron_tree.cp.planning.planner import evaluate_plan
    from megatron_tree.tree.layout import TreeLayout

    gpu = CostModel.gpu()
    # selected keys per rank against a brute-force count of each row's visible keys
    layout = _forest(3)
    n = layout.num_rows
    vu = layout.visible_until.numpy()
    vis = (np.arange(n)[None, :] <= np.arange(n)[:, None]) & (np.arange(n)[:, None] < vu[None, :])
    dsa = DSAWork(topk=5)
    plan = test_plan(layout, "random", 3, 1)
    _, loads = evaluate_plan(layout, plan, cost_model=gpu, dsa=dsa)
    expect = np.bincount(plan.owner, weights=np.minimum(vis.sum(1), 5), minlength=3)
    np.testing.assert_allclose(loads.sel_keys, expect)
    _, dense_loads = evaluate_plan(layout, plan, cost_model=gpu)
    assert dense_loads.sel_keys is None

    # a DSA plan balances the DSA work; planning it as dense does worse under the DSA model
    chain = TreeLayout.from_segments([40_000], [-1])
    dsa = DSAWork(topk=2048)
    for cp in (4, 16):
        p = plan_context_parallel(chain, cp, cost_model=gpu, dsa=dsa)
        assert p.imbalance <= 1.05, (cp, p.imbalance)
        assert p.stats["dsa_topk"] == 2048 and len(p.stats["dsa_selected_keys_per_rank"]) == cp
        dense = plan_context_parallel(chain, cp, cost_model=gpu)
        assert "dsa_topk" not in dense.stats
        t_dense, _ = evaluate_plan(chain, dense, cost_model=gpu, dsa=dsa)
        assert p.predicted_ms.max() <= t_dense.total.max() * (1 + 1e-9)
    # the DSA terms are part of the cache key; a window does not apply to DSA layers
    cache = PlanCache()
    a = cache.get_or_plan(chain, 4, cost_model=gpu)
    b = cache.get_or_plan(chain, 4, cost_model=gpu, dsa=dsa)
    assert cache.misses == 2 and "dsa_topk" in b.stats and "dsa_topk" not in a.stats
    with pytest.raises(ValueError, match="window"):
        plan_context_parallel(chain, 2, cost_model=gpu, dsa=dsa, window=128)
    with pytest.raises(TypeError, match="DSAWork"):
        plan_context_parallel(chain, 2, cost_model=gpu, dsa=2048)


def test_plans_made_as_a_microbatch_runs_price_the_models_dsa_work(monkeypatch):
    """A carry item's CP plan (`forward_step.carry_cp`, made as the item runs, carried rows included)
    prices DSA's own work for a DSA model, as the data pipeline's plans made ahead do (`dsa_work`), and
    is the plan `planned` hands the trainer's balance metric; a dense model's plan prices none."""
    from types import SimpleNamespace

    from megatron_tree.cp import DSAWork, plan_context_parallel
    from megatron_tree.megatron import forward_step as fs

    layout = _forest(5)
    base = dict(context_parallel_size=2, tensor_model_parallel_size=1, sequence_parallel=False,
                pipeline_model_parallel_size=1)
    for variant, topk in (("dsa", 3), (None, None)):
        config = SimpleNamespace(experimental_attention_variant=variant, dsa_indexer_topk=topk, **base)
        monkeypatch.setattr(fs, "_config_and_cp_group", lambda model, c=config: (c, None))
        plan = fs.carry_cp(None, layout)[0]
        want = plan_context_parallel(layout, 2, dsa=None if topk is None else DSAWork(topk=topk))
        assert plan.stats.get("dsa_topk") == topk
        assert plan.hash == want.hash
        np.testing.assert_array_equal(plan.owner, want.owner)
        assert fs.planned(layout, 2, "balanced", fs.dsa_work(config)) is plan
