"""Route-aware packing (routing replay, issue 18 point 1) against brute force: pure numpy / data."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_tree.data.io import ReadReport, read_jsonl, write_jsonl
from megatron_tree.tree import Sample, pack
from megatron_tree.tree.packing import PrefixPlan
from megatron_tree.tree.routes import RouteSpec, route_sharing_cost, route_symbols

LAYERS, TOPK, EXPERTS = 3, 2, 5


def _route(rng, n):
    """[n, LAYERS, TOPK] distinct experts per (token, layer)."""
    return np.argsort(rng.random((n, LAYERS, EXPERTS)), axis=2)[:, :, :TOPK]


def grpo_batch(seed: int, groups: int = 4, per_group: int = 5, disagree: int = 2):
    """GRPO-shaped: each group shares a prompt (and one routing of it); ``disagree`` rollouts per group
    had the prompt prefilled elsewhere and differ at one position; completions share prefixes too
    (a second-level fork with routes that agree on the shared part, a duplicate, a prefix sample)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(groups):
        p = rng.integers(0, 6, int(rng.integers(3, 9)))
        pr = _route(rng, len(p))
        comps = []
        for _ in range(per_group):
            n = int(rng.integers(1, 6))
            comps.append((rng.integers(0, 6, n), _route(rng, n)))
        c0 = comps[0]
        k = max(1, len(c0[0]) // 2)
        comps.append((np.concatenate([c0[0][:k], rng.integers(0, 6, 2)]), np.concatenate([c0[1][:k], _route(rng, 2)])))
        comps.append(c0)  # duplicate
        comps.append((c0[0][:k], c0[1][:k]))  # prefix
        for j, (ct, cr) in enumerate(comps):
            r = np.concatenate([pr, cr])
            if j < disagree:  # routed differently at one prompt position
                r = r.copy()
                t = int(rng.integers(0, len(p)))
                r[t, int(rng.integers(0, LAYERS))] = np.roll(np.arange(EXPERTS), -int(rng.integers(1, EXPERTS)))[:TOPK]
            out.append(Sample(tokens=np.concatenate([p, ct]), routed_experts=r))
    return out


def naive_trie(samples, with_routes: bool):
    """Nodes of the trie of (token[, routes]) sequences: a set of prefixes (plain Python)."""
    nodes = set()
    for s in samples:
        key = []
        for t in range(len(s)):
            key.append((int(s.tokens[t]),) + (tuple(s.routed_experts[t].reshape(-1).tolist()) if with_routes else ()))
            nodes.add(tuple(key))
    return nodes


@pytest.mark.parametrize("budget", [16, 24, 40, 256])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_route_aware_rows_equal_brute_force(seed, budget):
    samples = grpo_batch(seed)
    budget = max(budget, max(len(s) for s in samples))
    mbs = pack(samples, budget, pad_to_multiple_of=8 if budget % 8 == 0 else 1, route_aware=True)
    seen = []
    for mb in mbs:
        assert mb.routes is not None and mb.routes.dtype == torch.int64
        assert tuple(mb.routes.shape) == (mb.num_rows, LAYERS, TOPK)
        n_real = mb.num_rows - mb.layout.num_padding
        for i in mb.sample_ids:
            rows = mb.sample_rows(i)
            # every row's routes are the sample's routes at that position, its token the sample's token
            assert np.array_equal(mb.routes[rows].numpy(), samples[i].routed_experts)
            assert np.array_equal(mb.layout.input_ids[rows].numpy(), samples[i].tokens)
            seen.append(i)
        # rows = the (token, route) trie of the microbatch's samples
        assert n_real == mb.stats.tree_tokens == len(naive_trie([samples[i] for i in mb.sample_ids], True))
        # padding rows hold a valid route: distinct experts in range
        pad = mb.routes[n_real:]
        assert (pad >= 0).all() and (pad < TOPK).all()
        assert (pad.sort(-1).values[..., 1:] != pad.sort(-1).values[..., :-1]).all()
    assert sorted(seen) == list(range(len(samples)))
    if budget >= 256:  # one microbatch holds the forest: its rows are the whole (token, route) trie
        assert sum(mb.stats.tree_tokens for mb in mbs) == len(naive_trie(samples, True))
    # the planner prices the same microbatches
    toks = [s.tokens.astype(np.int64) for s in samples]
    plan = PrefixPlan(toks, [s.routed_experts for s in samples])
    assert plan.microbatch_rows(budget, 8 if budget % 8 == 0 else 1) == [mb.num_rows for mb in mbs]


def test_routes_fork_the_trie_and_cost_rows():
    samples = grpo_batch(3)
    token_rows = sum(mb.stats.tree_tokens for mb in pack(samples, 1024))
    route_rows = sum(mb.stats.tree_tokens for mb in pack(samples, 1024, route_aware=True))
    assert token_rows == len(naive_trie(samples, False)) < route_rows == len(naive_trie(samples, True))
    c = route_sharing_cost(samples)
    assert (c["token_rows"], c["route_rows"]) == (token_rows, route_rows)
    assert c["route_extra_rows"] == route_rows - token_rows
    assert c["flat_rows"] == sum(len(s) for s in samples)
    # forks by brute force: children of one (token, route) node that share a token but not the routes
    nodes = naive_trie(samples, True)
    children: dict = {}
    for n in nodes:
        children.setdefault(n[:-1], []).append(n[-1][0])
    forks = sum(len(c) - len(set(c)) for c in children.values())
    assert c["route_forks"] == forks > 0


def test_agreeing_routes_change_nothing():
    samples = grpo_batch(4, disagree=0)
    # completions drawn independently may share a token with different routes: give each token one route
    table = _route(np.random.default_rng(9), 6)
    for s in samples:
        s.routed_experts = table[s.tokens]
    a = pack(samples, 64, route_aware=True)
    b = pack(samples, 64)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.sample_ids == y.sample_ids
        assert torch.equal(x.layout.input_ids, y.layout.input_ids)
        assert torch.equal(x.layout.segment_offsets, y.layout.segment_offsets)
        n_real = x.num_rows - x.layout.num_padding
        assert np.array_equal(x.routes[:n_real].numpy(), table[x.layout.input_ids[:n_real].numpy()])
    assert route_sharing_cost(samples)["route_forks"] == 0


def test_route_aware_pack_is_order_independent():
    samples = grpo_batch(5)
    perm = np.random.default_rng(0).permutation(len(samples))
    a = pack(samples, 40, route_aware=True)
    b = pack([samples[i] for i in perm], 40, route_aware=True)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert sorted(perm[list(y.sample_ids)].tolist()) == list(x.sample_ids)
        assert torch.equal(x.layout.input_ids, y.layout.input_ids) and torch.equal(x.routes, y.routes)


@pytest.mark.parametrize("collide", [False, True])
def test_route_symbols_equal_iff_token_and_routes_equal(collide, monkeypatch):
    """Symbols come from a 64-bit key per position, checked; colliding keys (forced here by zero
    multipliers) fall back to the exact row-wise unique."""
    from megatron_tree.tree import routes as R

    if collide:
        monkeypatch.setattr(R, "_hash_multipliers", lambda w: np.zeros(w, np.int64))
    rng = np.random.default_rng(0)
    toks = [rng.integers(0, 3, 20) for _ in range(3)]
    routes = [rng.integers(0, 2, (20, 2, 1)) for _ in range(3)]
    syms = np.concatenate(route_symbols(toks, routes))
    keys = [(int(t),) + tuple(r.reshape(-1)) for T, R in zip(toks, routes) for t, r in zip(T, R)]
    for i in range(len(keys)):
        for j in range(len(keys)):
            assert (syms[i] == syms[j]) == (keys[i] == keys[j])
            assert (syms[i] < syms[j]) == (keys[i] < keys[j])  # (token, routes) order


def test_route_errors_name_the_sample():
    good = grpo_batch(0, groups=1)
    with pytest.raises(ValueError, match=r"sample 2: route_aware packing .* needs routed_experts"):
        pack(good[:2] + [Sample(tokens=[1, 2, 3])], 64, route_aware=True)
    bad = Sample(tokens=[1, 2, 3], routed_experts=np.zeros((3, LAYERS + 1, TOPK), int) + np.arange(TOPK))
    with pytest.raises(ValueError, match=r"sample 1: routed_experts has \[moe_layers, topk\] = \[4, 2\] but sample 0"):
        pack([good[0], bad], 64, route_aware=True)
    cases = [
        (np.zeros((2, LAYERS, TOPK), int), r"routed_experts has 2 entries but the sample has 3 tokens"),
        (np.zeros((3, LAYERS, TOPK), int), r"repeats an expert within the top-2 of token 0, MoE layer 0"),
        (np.full((3, LAYERS, TOPK), -1), r"negative expert id at token 0"),
        (np.zeros((3, LAYERS), int), r"must have shape \[tokens, moe_layers, topk\]"),
        ([[[0, 1]], [[0, 1], [1, 2]], [[0, 1]]], r"ragged"),
        (np.full((3, LAYERS, TOPK), 0.5), r"integer expert ids"),
    ]
    for routes, msg in cases:
        with pytest.raises(ValueError, match=r"sample 0: .*" + msg):
            pack([Sample(tokens=[1, 2, 3], routed_experts=routes)], 64)
    ok = np.broadcast_to(np.arange(TOPK), (3, LAYERS, TOPK)) + 3
    for spec, msg in [(RouteSpec(moe_layers=2), "3 MoE layers per token but the model has 2"),
                      (RouteSpec(topk=1), "top-2 per token and layer but the model routes top-1"),
                      (RouteSpec(num_experts=4), "expert id 4 at token 0, but the model has 4 experts")]:
        with pytest.raises(ValueError, match=msg):
            pack([Sample(tokens=[1, 2, 3], routed_experts=ok)], 64, route_spec=spec)


def test_files_carry_routes_with_file_line_errors(tmp_path):
    pytest.importorskip("pyarrow")
    from megatron_tree.data.parquet import read_parquet, write_parquet

    samples = grpo_batch(1, groups=2) + [Sample(tokens=[4, 5])]
    spec = RouteSpec(LAYERS, TOPK, EXPERTS)
    for write, read, name in ((write_jsonl, read_jsonl, "a.jsonl"), (write_parquet, read_parquet, "a.parquet")):
        write(samples, tmp_path / name)
        back = read(tmp_path / name, route_spec=spec)
        for a, b in zip(back, samples):
            assert (a.routed_experts is None) == (b.routed_experts is None)
            if b.routed_experts is not None:
                assert np.array_equal(a.routed_experts, b.routed_experts)
        with pytest.raises(ValueError, match=rf"{name}:(row )?[01]: routed_experts has 3 MoE layers per token but the "
                                             "model has 2"):
            read(tmp_path / name, route_spec=RouteSpec(moe_layers=2))
    lines = [{"tokens": [1, 2], "routed_experts": [[[0, 1]], [[1, 2]]]},
             {"tokens": [1, 2], "routed_experts": [[[0, 1]], [[1]]]},
             {"tokens": [1, 2, 3], "routed_experts": [[[0, 1]], [[1, 2]]]}]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(ValueError, match=r"b.jsonl:2: routed_experts must be a list per token"):
        read_jsonl(tmp_path / "b.jsonl")
    rep = ReadReport()
    assert len(read_jsonl(tmp_path / "b.jsonl", bad_sample="skip", report=rep)) == 1
    assert [w for w, _ in rep.skipped] == [f"{tmp_path / 'b.jsonl'}:2", f"{tmp_path / 'b.jsonl'}:3"]
    assert "2 entries but the sample has 3 tokens" in rep.skipped[1][1]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"tokens": [[1, 2], [3]], "routed_experts": [[[[0, 1]], [[0]]], [[[1, 2], [0, 1]]]]}),
                   tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b.parquet:row 0: routed_experts must have the same top-k"):
        read_parquet(tmp_path / "b.parquet")


def test_pipeline_packs_route_aware(tmp_path):
    from megatron_tree.data.pipeline import TreeDataPipeline

    samples = grpo_batch(2)
    write_jsonl(samples, tmp_path / "r.jsonl")
    pipe = TreeDataPipeline.from_files([tmp_path / "r.jsonl"], max_tokens_per_mb=48, global_batch_samples=12,
                                       dp_size=2, microbatches_per_rank=3, route_aware=True,
                                       route_spec=RouteSpec(LAYERS, TOPK, EXPERTS), pad_to_multiple_of=8)
    n = 0
    for step in pipe:
        for mb in step.microbatches:
            assert mb.routes is not None and mb.routes.shape[0] == mb.num_rows
            for i in mb.sample_ids:
                assert np.array_equal(mb.routes[mb.sample_rows(i)].numpy(), samples[i].routed_experts)
                n += 1
    assert n == len(samples) // 2 or n > 0
    write_jsonl(samples[:3] + [Sample(tokens=[1, 2])], tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match=r"m.jsonl:4: has no routed_experts, but routing replay"):
        TreeDataPipeline.from_files([tmp_path / "m.jsonl"], max_tokens_per_mb=48, global_batch_samples=4,
                                    route_aware=True)


def test_stats_reports_route_forks(tmp_path):
    samples = grpo_batch(3)
    write_jsonl(samples, tmp_path / "r.jsonl")
    out = subprocess.run([sys.executable, "-m", "megatron_tree", "stats", "--data", str(tmp_path / "r.jsonl")],
                         capture_output=True, text=True, check=True).stdout
    c = route_sharing_cost(samples)
    assert f"route forks                   {c['route_forks']:,}" in out
    assert f"trie rows token-only          {c['token_rows']:,}" in out
    assert f"trie rows route-aware         {c['route_rows']:,}" in out
    assert f"rows cost by route forks      {c['route_extra_rows']:,}" in out


def test_token_only_sharing_would_replay_the_wrong_routes():
    """The planted fault of this module's oracle: rows from token-only sharing cannot hold every
    sample's routes (two samples disagree on a shared row), which `row_routes` refuses."""
    from megatron_tree.tree.routes import row_routes

    samples = grpo_batch(0)
    for mb in pack(samples, 1024):  # token-only
        with pytest.raises(AssertionError, match="disagree on its routes"):
            row_routes(np.concatenate([mb.sample_rows(i).numpy() for i in mb.sample_ids]),
                       [samples[i].routed_experts for i in mb.sample_ids], mb.num_rows)
