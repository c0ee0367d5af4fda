"""The CP planner: closed-form pair counts, the vectorised evaluation against its loop reference, the
simulator against its loop reference, the plan's invariants, determinism and hashing, the
baselines' shapes, "balanced is never predicted slower", edge cases, the cache and the plan_fn.

Brute force here (dense row masks) is test-only; the planner never forms an N x N object.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from forests import random_forest
from megatron_tree.cp import CPPlan, CostModel, PlanCache, make_plan_fn, plan_context_parallel
from megatron_tree.cp.planning.cost_model import RankLoads, simulate, simulate_reference
from megatron_tree.cp.planning.evaluate import rank_key_work, rank_loads, rank_loads_reference
from megatron_tree.cp.planning.pairs import (chunk_grid, default_num_chunks, layout_arrays, snapped_grid,
                                    visible_pairs)
from megatron_tree.ops.blocks import block_pairs
from megatron_tree.cp.planning.planner import STRATEGIES, _evaluate, evaluate_plan, layout_key
from megatron_tree.tree.layout import TreeLayout

CPU = CostModel.cpu()
GPU = CostModel.gpu()


def _mask(la, window=None):
    """[N, N] bool: query q (row) sees key k (column) -- the layout predicate, brute force."""
    N = la.num_rows
    q = np.arange(N)[:, None]
    k = np.arange(N)[None, :]
    m = (k <= q) & (q < la.visible_until[None, :])
    if window is not None:
        m &= (la.position_ids[:, None] - la.position_ids[None, :]) < window
    return m


def _grids(la, seed):
    n = la.num_rows
    yield chunk_grid(n, 1)
    yield chunk_grid(n, 1 + seed % 5)
    yield snapped_grid(la, chunk_size=3 + seed % 4)
    yield snapped_grid(la, num_chunks=max(1, n // 4))


def _forest(seed):
    layout, _ = random_forest(seed, num_trees=1 + seed % 3, max_depth=2 + seed % 3, num_padding=seed % 3)
    return layout


def _chain(n, pad=0):
    return TreeLayout.from_segments([n], [-1], num_padding=pad)


# ---------------------------------------------------------------------------------------------- pairs
@pytest.mark.parametrize("window", [None, 1, 2, 5])
def test_pairs_equal_brute_force(window):
    for seed in range(25):
        la = layout_arrays(_forest(seed))
        mask = _mask(la, window)
        qi, ki = np.nonzero(mask)
        for grid in _grids(la, seed):
            W = visible_pairs(la, grid, window=window)
            M = grid.num_chunks
            ref = np.zeros((M, M), np.int64)
            np.add.at(ref, (grid.chunk_of_row(qi), grid.chunk_of_row(ki)), 1)
            np.testing.assert_array_equal(W.dense(), ref, err_msg=f"seed {seed} grid {grid.starts}")
            # every non-zero entry is stored; stored entries are sorted by (q, k) with k <= q
            stored = np.zeros((M, M), bool)
            stored[W.q, W.k] = True
            assert not (ref.astype(bool) & ~stored).any()
            assert (W.k <= W.q).all() and (np.diff(W.q * M + W.k) > 0).all()
            # rows of key chunk j seen by query chunk i (no window): brute force at stored entries
            seen = np.zeros((M, M), np.int64)
            nw = _mask(la)
            for i in range(M):
                qs = slice(grid.starts[i], grid.ends[i])
                cols = nw[qs].any(0)
                seen[i] = np.bincount(grid.chunk_of_row(np.nonzero(cols)[0]), minlength=M)
            np.testing.assert_array_equal(W.need_table[W.q, W.k], seen[W.q, W.k])


def test_tiles_equal_the_kernels_blocks():
    """On chunks of whole blocks, the tiles of any set of chunks a rank owns (full and all) are
    exactly the tiles `ops.blocks.block_pairs` lists for the rank's concatenated rows."""
    import torch

    rng = np.random.default_rng(4)
    for seed in range(8):
        layout, _ = random_forest(seed, num_trees=2 + seed % 3, max_len=30, max_depth=3, num_padding=seed % 3)
        la = layout_arrays(layout)
        for B, C in ((4, 4), (4, 12), (8, 16)):
            grid = chunk_grid(la.num_rows, C)
            W = visible_pairs(la, grid, tile_rows=B)
            for _ in range(3):
                mine = np.nonzero(rng.random(grid.num_chunks) < 0.5)[0]
                if not len(mine):
                    continue
                rows = torch.from_numpy(np.concatenate([np.arange(grid.starts[c], grid.ends[c]) for c in mine]))
                bp = block_pairs(rows, rows, layout.visible_until[rows], block_q=B, block_k=B)
                sel = np.isin(W.q, mine) & np.isin(W.k, mine)
                assert W.full_tiles[sel].sum() == int(bp.full.sum())
                assert W.full_tiles[sel].sum() + W.part_tiles[sel].sum() == bp.num_pairs


def test_pairs_chain_is_dense_triangle():
    la = layout_arrays(_chain(40))
    W = visible_pairs(la, chunk_grid(40, 8))
    assert W.nnz == 5 * 6 // 2
    assert W.total_pairs == 40 * 41 // 2


def test_default_grid_rule():
    assert default_num_chunks(100, 4) == 64
    assert default_num_chunks(10, 8) == 10  # never more chunks than rows
    for cp in (2, 4, 8, 16, 32):
        m = default_num_chunks(10**6, cp)
        assert m % (2 * cp) == 0 and 64 <= m <= 1024
    la = layout_arrays(_chain(1000))
    g = snapped_grid(la, num_chunks=64)
    assert g.num_chunks == 64 and g.rows.max() - g.rows.min() <= 1  # near-equal on a chain


def test_snapped_grid_keeps_big_trees_whole():
    # three trees of 30, 5 and 40 rows, nominal chunks of 16 rows
    layout = TreeLayout.from_segments([30, 5, 40], [-1, -1, -1])
    g = snapped_grid(layout_arrays(layout), chunk_size=16)
    assert {0, 30, 35}.issubset(set(g.starts.tolist()))


# ---------------------------------------------------------------------------------------------- evaluation
@pytest.mark.parametrize("window", [None, 3])
def test_vectorised_loads_equal_loop_reference(window):
    rng = np.random.default_rng(0)
    for seed in range(10):
        la = layout_arrays(_forest(seed))
        grid = chunk_grid(la.num_rows, 2 + seed % 4) if seed % 2 else snapped_grid(la, num_chunks=la.num_rows // 3)
        W = visible_pairs(la, grid, window=window, tile_rows=4)
        for cp, nw in ((1, 1), (2, 2), (3, 3), (5, 1 + seed % 3)):
            co = rng.integers(0, cp, grid.num_chunks)
            a = rank_loads(W, co, cp, nw)
            b = rank_loads_reference(la, grid, grid.row_owner(co), cp, nw, window=window, tile_rows=W.tile_rows)
            for f in ("rows", "local_pairs", "wave_rows", "wave_pairs", "send_rows", "local_tiles", "wave_tiles"):
                np.testing.assert_allclose(getattr(a, f), getattr(b, f), err_msg=f"{f} seed {seed} cp {cp}")


def _random_loads(rng, cp, nw):
    rows = rng.integers(0, 5000, cp)
    wave_rows = rng.integers(0, 3000, (cp, nw)).astype(float)
    wave_rows[:, rng.integers(0, nw)] *= rng.integers(0, 2)  # some empty waves
    return RankLoads(rows=rows, local_pairs=rng.integers(0, 10**7, cp).astype(float), wave_rows=wave_rows,
                     wave_pairs=wave_rows * rng.integers(0, 4000, (cp, nw)), send_rows=rng.integers(0, 3000, (cp, nw)).astype(float),
                     local_tiles=rng.integers(0, 900, (cp, 2)).astype(float),
                     wave_tiles=rng.integers(0, 300, (cp, nw, 2)) * (wave_rows > 0)[..., None])


def test_simulate_equals_loop_reference():
    rng = np.random.default_rng(1)
    models = [GPU, CPU, dataclasses.replace(GPU, overlap=0.0), dataclasses.replace(GPU, overlap=0.5, bwd_refetch=False),
              dataclasses.replace(CPU, underfill_tiles=50.0, layers=3)]
    for cm in models:
        for cp in (1, 2, 4, 7):
            for nw in (1, 2, 4):
                loads = _random_loads(rng, cp, nw)
                a, b = simulate(cm, loads), simulate_reference(cm, loads)
                for f in ("tok_fwd", "attn_fwd", "tok_bwd", "attn_bwd", "total"):
                    np.testing.assert_allclose(getattr(a, f), getattr(b, f), rtol=1e-12, err_msg=f"{f} {cm.name}")


def test_overlap_hides_transfers():
    loads = _random_loads(np.random.default_rng(2), 4, 2)
    serial = simulate(dataclasses.replace(GPU, overlap=0.0), loads).total
    hidden = simulate(dataclasses.replace(GPU, overlap=1.0), loads).total
    assert (hidden <= serial + 1e-12).all() and (hidden < serial).any()


def test_incremental_move_equals_full_evaluation():
    la = layout_arrays(_forest(3))
    grid = snapped_grid(la, num_chunks=12)
    W = visible_pairs(la, grid)
    rng = np.random.default_rng(3)
    cp = 3
    co = rng.integers(0, cp, grid.num_chunks)
    cand = _evaluate(W, co, cp, CPU, (2,), "t")
    for _ in range(10):
        a = int(rng.integers(grid.num_chunks))
        r = int(cand.co[a])
        s = int((r + 1 + rng.integers(cp - 1)) % cp)
        theirs = np.nonzero(cand.co == s)[0]
        b = int(theirs[0]) if len(theirs) and rng.random() < 0.5 else -1
        cand = cand.moved(a, b, r, s, CPU)
        full = _evaluate(W, cand.co, cp, CPU, (2,), "t")
        np.testing.assert_allclose(cand.A, rank_key_work(W, cand.co, cp), atol=1e-9)
        for f in ("rows", "local_pairs", "wave_rows", "wave_pairs", "send_rows", "local_tiles", "wave_tiles"):
            np.testing.assert_allclose(getattr(cand.loads, f), getattr(full.loads, f))
        np.testing.assert_allclose(cand.times.total, full.times.total)


# ---------------------------------------------------------------------------------------------- plans
def _layouts():
    from megatron_tree.data.synthetic import make_preset
    from megatron_tree.tree import pack

    out = [("chain", _chain(3000)), ("chain+pad", _chain(777, pad=9)), ("forest", _forest(5))]
    for name, scale in (("varied_5k_16x100", 0.05), ("dominant_14745_16x921", 0.03), ("agent_multiturn", 0.5)):
        out.append((name, pack(make_preset(name, seed=1, scale=scale), 1 << 30)[0].layout))
    return out


def _check_plan(plan: CPPlan, layout):
    N = layout.num_rows
    assert plan.owner.shape == (N,) and plan.owner.dtype == np.int32
    assert plan.owner.min() >= 0 and plan.owner.max() < plan.cp_size
    rows = np.concatenate([plan.owner_rows(r) for r in range(plan.cp_size)])
    np.testing.assert_array_equal(np.sort(rows), np.arange(N))  # every row owned exactly once
    for r in range(plan.cp_size):
        assert (np.diff(plan.owner_rows(r)) > 0).all()
    np.testing.assert_array_equal(plan.visible_until, layout.visible_until.numpy())
    np.testing.assert_array_equal(plan.position_ids, layout.position_ids.numpy())
    assert plan.predicted_ms.shape == (plan.cp_size,) and (plan.predicted_ms > 0).all()
    # ownership is constant on the plan's chunks
    starts = plan.chunk_starts if plan.chunk_starts is not None else np.arange(0, N, plan.chunk_size)
    ends = np.append(starts[1:], N)
    first = plan.owner[starts]
    np.testing.assert_array_equal(np.repeat(first, ends - starts), plan.owner)
    # the stored prediction is the evaluation of the plan
    times, loads = evaluate_plan(layout, plan, cost_model=CPU, window=plan.stats["window"])
    np.testing.assert_allclose(times.total, plan.predicted_ms, rtol=1e-9)
    assert plan.stats["remote_kv_rows"] == int(round(loads.wave_rows.sum()))


def test_plans_are_valid_and_balanced_never_worse():
    for name, layout in _layouts():
        for cp in (2, 3, 4, 8):
            plans = {s: plan_context_parallel(layout, cp, strategy=s, cost_model=CPU) for s in STRATEGIES}
            for p in plans.values():
                _check_plan(p, layout)
            best_base = min(plans["zigzag"].predicted_ms.max(), plans["contiguous"].predicted_ms.max())
            assert plans["balanced"].predicted_ms.max() <= best_base * (1 + 1e-9), (name, cp)
            s = plans["balanced"].stats
            for key in ("planning_ms", "search_steps", "pair_balance", "row_balance", "neutral_balance",
                        "remote_kv_rows", "remote_kv_bytes", "peak_remote_kv_rows", "max_wave_rows"):
                assert key in s, key


def test_balanced_beats_folds_on_a_skewed_tree():
    from megatron_tree.data.synthetic import make_preset
    from megatron_tree.tree import pack

    layout = pack([x for seed in range(4) for x in make_preset("dominant_14745_16x921", seed=seed, scale=0.2)],
                  1 << 30)[0].layout
    plans = {s: plan_context_parallel(layout, 4, strategy=s, cost_model=GPU) for s in STRATEGIES}
    assert plans["balanced"].imbalance <= 1.05
    assert plans["balanced"].predicted_ms.max() < 0.985 * min(p.predicted_ms.max() for s, p in plans.items()
                                                            if s != "balanced")


def test_zigzag_and_contiguous_shapes():
    layout = _chain(103)
    cp = 4
    z = plan_context_parallel(layout, cp, strategy="zigzag", cost_model=CPU)
    c = plan_context_parallel(layout, cp, strategy="contiguous", cost_model=CPU)
    piece = -(-103 // (2 * cp))
    for r in range(cp):
        expect = np.concatenate([np.arange(r * piece, (r + 1) * piece),
                                 np.arange((2 * cp - 1 - r) * piece, min((2 * cp - r) * piece, 103))])
        np.testing.assert_array_equal(z.owner_rows(r), np.sort(expect))
        span = -(-103 // cp)
        np.testing.assert_array_equal(c.owner_rows(r), np.arange(r * span, min((r + 1) * span, 103)))
    assert z.strategy == "zigzag" and c.strategy == "contiguous"


def test_windowed_plan():
    layout = _forest(7)
    p = plan_context_parallel(layout, 3, cost_model=CPU, window=4)
    _check_plan(p, layout)
    assert p.stats["window"] == 4
    full = plan_context_parallel(layout, 3, cost_model=CPU)
    assert p.stats["visible_pairs"] < full.stats["visible_pairs"]


# ---------------------------------------------------------------------------------------------- identity
def test_deterministic_and_hash_changes_with_the_plan():
    layout = _layouts()[3][1]
    a = plan_context_parallel(layout, 4, cost_model=CPU)
    b = plan_context_parallel(layout, 4, cost_model=CPU)
    assert a.hash == b.hash and np.array_equal(a.owner, b.owner) and a.num_waves == b.num_waves
    moved = a.owner.copy()
    moved[0] = (moved[0] + 1) % 4
    assert dataclasses.replace(a, owner=moved).hash != a.hash
    assert dataclasses.replace(a, num_waves=a.num_waves + 1).hash != a.hash
    assert plan_context_parallel(layout, 3, cost_model=CPU).hash != a.hash


def test_same_hash_in_another_process():
    code = ("import sys; sys.path.insert(0, 'tests');"
            "from test_cp_planner import _layouts, CPU;"
            "from megatron_tree.cp import plan_context_parallel;"
            "print(plan_context_parallel(_layouts()[3][1], 4, cost_model=CPU).hash)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    here = plan_context_parallel(_layouts()[3][1], 4, cost_model=CPU).hash
    assert out.stdout.strip().splitlines()[-1] == here


# ---------------------------------------------------------------------------------------------- edges
def test_edge_cases():
    # cp_size = 1: one rank owns everything, nothing remote
    layout = _forest(2)
    p = plan_context_parallel(layout, 1, cost_model=CPU)
    assert (p.owner == 0).all() and p.stats["remote_kv_rows"] == 0 and p.imbalance == 1.0
    # more ranks than chunks: some ranks own nothing, every row still owned once
    tiny = _chain(5)
    for s in STRATEGIES:
        p = plan_context_parallel(tiny, 8, strategy=s, cost_model=CPU)
        _check_plan(p, tiny)
        assert (p.rows_per_rank() == 0).any()
    # padding rows and a single unbranched chain
    for lay in (_chain(500, pad=37), _chain(2048)):
        for cp in (2, 5):
            _check_plan(plan_context_parallel(lay, cp, cost_model=CPU), lay)
    # a fixed wave count is honoured
    assert plan_context_parallel(_chain(800), 4, cost_model=CPU, num_waves=3).num_waves == 3


def test_errors():
    layout = _chain(10)
    with pytest.raises(ValueError, match="balanced, zigzag, contiguous"):
        plan_context_parallel(layout, 2, strategy="ring")
    for kw in ({"chunk_size": 0}, {"window": 0}, {"num_waves": 0}):
        with pytest.raises(ValueError):
            plan_context_parallel(layout, 2, cost_model=CPU, **kw)
    with pytest.raises(ValueError, match="cp_size"):
        plan_context_parallel(layout, 0, cost_model=CPU)


# ---------------------------------------------------------------------------------------------- cost model IO
def test_cost_model_json_roundtrip(tmp_path):
    path = tmp_path / "cm.json"
    GPU.to_json(str(path))
    assert CostModel.from_json(str(path)) == GPU
    data = json.loads(path.read_text())
    data["bogus"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="bogus"):
        CostModel.from_json(str(path))
    with pytest.raises(ValueError):
        CostModel(overlap=1.5)
    assert CPU.name.startswith("cpu")


# ---------------------------------------------------------------------------------------------- cache, plan_fn
def test_plan_cache_and_plan_fn_in_the_pipeline():
    from megatron_tree.data import TreeDataPipeline, make_preset

    layout = _layouts()[3][1]
    cache = PlanCache(maxsize=2)
    a = cache.get_or_plan(layout, 2, cost_model=CPU)
    b = cache.get_or_plan(layout, 2, cost_model=CPU)
    assert a is b and cache.hits == 1 and cache.misses == 1
    assert cache.get_or_plan(layout, 2, cost_model=CPU, strategy="zigzag") is not a
    assert layout_key(layout) == layout_key(TreeLayout(**{f: getattr(layout, f) for f in (
        "input_ids", "position_ids", "segment_offsets", "segment_parent", "subtree_end", "visible_until",
        "path_prev")}, num_padding=layout.num_padding))

    fn = make_plan_fn(2, cost_model=CPU)
    samples = make_preset("agent_multiturn", seed=0, scale=0.25)
    pipe = TreeDataPipeline(samples, max_tokens_per_mb=1024, global_batch_samples=len(samples), plan_fn=fn,
                            lookahead=1)
    step = next(iter(pipe))
    assert len(step.plans) == len(step.microbatches)
    for mb, plan in zip(step.microbatches, step.plans):
        assert isinstance(plan, CPPlan) and plan.num_rows == mb.num_rows
        assert plan.hash == plan_context_parallel(mb.layout, 2, cost_model=CPU).hash
    with pytest.raises(ValueError, match="choose one of"):
        make_plan_fn(2, strategy="nope")


# ---------------------------------------------------------------------------------------------- contract
def test_model_matches_the_executor_schedule():
    """Without a window, the rows the planner prices per rank and wave (received and sent) are the
    rows the executor's schedule moves: the plan's wave rule and needs are one contract."""
    schedule = pytest.importorskip("megatron_tree.cp.planning.schedule")
    for name, layout in _layouts():
        for cp, strategy in ((2, "balanced"), (3, "zigzag"), (4, "balanced"), (5, "contiguous")):
            plan = plan_context_parallel(layout, cp, strategy=strategy, cost_model=CPU)
            _, loads = evaluate_plan(layout, plan, cost_model=CPU)
            for r in range(cp):
                sched = schedule.build_schedule(plan, r)
                got = [w.rows.shape[0] for w in sched.waves]
                np.testing.assert_array_equal(loads.wave_rows[r], got, err_msg=f"{name} cp {cp} rank {r}")
                sent = [w.send_local.shape[0] for w in sched.waves]
                np.testing.assert_array_equal(loads.send_rows[r], sent, err_msg=f"{name} cp {cp} rank {r}")


# ---------------------------------------------------------------------------------------------- plan command
def test_plan_command(tmp_path, capsys):
    from megatron_tree.training.plan import build_plan_parser, run_plan

    png = tmp_path / "plan.png"
    argv = ["--preset", "agent_multiturn", "--scale", "0.25", "--cp", "1,2,4", "--cost-model", "cpu",
            "--plot", str(png)]
    assert run_plan(argv) == 0
    out = capsys.readouterr().out
    assert "CP capacity plan" in out and "imb zigzag" in out and "remote KV rows" in out
    assert len([ln for ln in out.splitlines() if ln.strip().startswith(("1 ", "2 ", "4 "))]) == 3
    pytest.importorskip("matplotlib")
    assert png.exists() and png.stat().st_size > 0
    # a parsed namespace works too; bad arguments are usage errors
    assert run_plan(build_plan_parser().parse_args(["--preset", "many_small_64_4x16", "--scale", "0.25", "--cp", "2",
                                                    "--strategy", "zigzag,contiguous", "--cost-model", "gpu"])) == 0
    with pytest.raises(SystemExit):
        build_plan_parser().parse_args(["--preset", "agent_multiturn", "--strategy", "ring"])
    assert run_plan(["--preset", "agent_multiturn", "--cost-model", str(tmp_path / "missing.json")]) == 2
