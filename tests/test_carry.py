"""Carry (issue 25): every row of a step computed once, at any row budget.

Planner: ``pack(..., carry=True)`` against the unlimited-budget pack of the same samples (rows
computed, occurrences, tokens and depths of every carried row). Execution: float64 models trained
through Megatron's schedule on carry items (GPT with window + learned sinks, hybrids with Gated
DeltaNet and Mamba-2 layers, MambaModel with MoE, MLA; recompute none / selective / full) equal the
same model on the whole trees (unlimited budget; itself equal to per-sample stock training,
`megatron-tree verify`), in loss and every parameter gradient; planted faults (no gradient
restoration, a gradient injected twice) fail; DSA refuses clearly.
"""
from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from dist import init_megatron, run_distributed
from megatron_tree.tree import pack
from megatron_tree.tree.carry import assign_carry_groups, carry_summary


def _samples(seed: int = 0, groups: int = 3, long_path: int = 70):
    """GRPO-like groups (a prompt + completions), one path longer than the budgets used, a duplicate
    and a sample that is a prefix of another (forks inside carried rows)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(groups):
        p = rng.integers(1, 100, size=int(rng.integers(20, 40))).tolist()
        for _ in range(4):
            out.append(p + rng.integers(1, 100, size=int(rng.integers(1, 15))).tolist())
    out.append(out[0])  # a duplicate
    out.append(out[5][:25])  # a prefix of another sample: it ends inside a carried path
    out.append(rng.integers(1, 100, size=long_path).tolist())
    return out


@pytest.mark.parametrize("budget", [8, 16, 24])
def test_carry_plan_computes_every_row_once(budget):
    samples = _samples()
    mbs = pack(samples, budget, carry=True, pad_to_multiple_of=4)
    whole = pack(samples, 10 ** 6)
    assert sum(mb.owned_rows - mb.stats.padding_tokens for mb in mbs) == sum(m.stats.tree_tokens for m in whole)
    assert all(mb.owned_rows <= budget for mb in mbs) and all(mb.owned_rows % 4 == 0 for mb in mbs)
    assert sorted(i for mb in mbs for i in mb.sample_ids) == list(range(len(samples)))
    assert max(len(mb.carry.carried) for mb in mbs) > budget  # a chain of 3+ microbatches
    # every occurrence once, predicted from a row of the same token path
    got, want = [], []
    for mb in mbs:
        mb.layout.validate()
        lm = mb.loss_map
        for s, p, t, r in zip(lm.sample_index.tolist(), lm.positions.tolist(), lm.targets.tolist(), lm.source_rows.tolist()):
            assert r in set(mb.carry.own.tolist())
            got.append((s, p, t))
            assert int(mb.layout.position_ids[r]) == p - 1 and int(mb.layout.input_ids[r]) == samples[s][p - 1]
    for mb in whole:
        lm = mb.loss_map
        want += list(zip(lm.sample_index.tolist(), lm.positions.tolist(), lm.targets.tolist()))
    assert sorted(got) == sorted(want)
    # carried rows: one root path per reading unit, owned by an earlier microbatch, same token and depth there
    by_key = {}
    for mb in mbs:
        for r in mb.carry.own.tolist():
            k = int(mb.carry.keys[r])
            if k >= 0:
                by_key[k] = (mb.carry.index, int(mb.layout.input_ids[r]), int(mb.layout.position_ids[r]))
    for mb in mbs:
        c = mb.carry
        for r, o in zip(c.carried.tolist(), c.carried_owner.tolist()):
            owner, tok, depth = by_key[int(c.keys[r])]
            assert owner == o < c.index
            assert (tok, depth) == (int(mb.layout.input_ids[r]), int(mb.layout.position_ids[r]))
    # each sample's path inside every microbatch it crosses is a prefix of its tokens
    for mb in mbs:
        for i in mb.carry.path_sample_ids:
            rows = mb.sample_rows(i)
            assert mb.layout.input_ids[rows].tolist() == samples[i][: len(rows)]
    s = carry_summary(mbs, bytes_per_row=10)
    assert s["rows_computed"] == sum(mb.owned_rows for mb in mbs) and s["store_bytes"] == 10 * s["stored_rows"]


def test_carry_groups_stay_on_one_rank():
    mbs = pack(_samples(), 16, carry=True)
    ranks = assign_carry_groups(mbs, 2)
    assert sorted(i for r in ranks for i in r) == list(range(len(mbs)))
    for r in ranks:
        have = {mbs[i].carry.index for i in r}
        for i in r:
            assert set(mbs[i].carry.reads_from) <= have


def test_route_aware_carry_cuts_the_route_forest_and_gives_every_row_its_routes():
    """Routing replay with carry: the (token, route) forest is cut, so carry computes its rows once
    (more than the token forest's where routes fork inside a shared prompt), and every microbatch's
    ``routes`` give each sample crossing it (carried rows included) that sample's own routes."""
    rng = np.random.default_rng(3)

    def route(n):  # distinct experts per token and MoE layer: 2 layers, top-2 of 4
        return np.stack([rng.permutation(4)[:2] for _ in range(2 * n)]).reshape(n, 2, 2)

    samples = []
    for g in range(3):
        prompt, proutes = rng.integers(1, 50, 20).tolist(), route(20)
        for c in range(3):
            comp = rng.integers(1, 50, int(rng.integers(5, 30))).tolist()
            r = np.concatenate([proutes, route(len(comp))])
            if c == 2:  # this rollout was routed differently at prompt token 10: the route forest forks there
                r[10] = r[10, :, ::-1]
            samples.append(dict(tokens=prompt + comp, loss_mask=[0] * 20 + [1] * len(comp), routed_experts=r))
    mbs = pack(samples, 16, carry=True, route_aware=True, pad_to_multiple_of=4)
    rows = sum(mb.owned_rows - mb.stats.padding_tokens for mb in mbs)
    route_forest = pack(samples, 10 ** 6, route_aware=True)[0].stats.tree_tokens
    token_forest = pack(samples, 10 ** 6)[0].stats.tree_tokens
    # each group's forked rollout owns the prompt's last 10 rows (and shares nothing after them)
    assert rows == route_forest >= token_forest + 3 * 10, (rows, route_forest, token_forest)
    assert sum(1 for mb in mbs if mb.carry.reads_from) >= 3
    seen = set()
    for mb in mbs:
        assert mb.routes.shape == (mb.layout.num_rows, 2, 2)
        assert (mb.routes[mb.layout.num_rows - mb.stats.padding_tokens:] == torch.arange(2)).all()  # padding
        for i in mb.carry.path_sample_ids:
            r = mb.routes[mb.sample_rows(i)].numpy()
            assert np.array_equal(r, samples[i]["routed_experts"][: len(r)]), (mb.carry.index, i)
            seen.add(i)
    assert seen == set(range(len(samples)))


def test_without_carry_a_long_sample_is_refused_and_carry_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="sample 0"):
        pack([list(range(1, 40))], 16)
    with pytest.raises(ValueError, match="mtp_tail"):
        pack([list(range(1, 40))], 16, carry=True, mtp_tail=1)
    # every layer kind carries under CP x PP; MTP with DSA (its tail rows) and interleaved pipelining are
    # refused before any rank starts, in the hooks' / train's arguments
    from megatron_tree.training.arguments import add_tree_args, validate_tree_args

    args = add_tree_args(argparse.ArgumentParser()).parse_args(["--tree-packing", "--tree-max-tokens-per-mb", "64",
                                                                "--tree-carry"])
    args.context_parallel_size, args.tree_hybrid_pattern, args.pipeline_model_parallel_size = 2, "MG*-", 2
    validate_tree_args(args)
    args.tree_hybrid_pattern, args.mtp_num_layers = None, 1
    validate_tree_args(args)  # GPT with MTP
    args.experimental_attention_variant, args.num_layers_per_virtual_pipeline_stage = "dsa", 1
    with pytest.raises(ValueError, match="(?s)not interleaved virtual stages.*tail rows its indexer loss reads"):
        validate_tree_args(args)
    # expert parallelism: DP ranks run different items at one position, the EP all-to-alls would not pair
    args.experimental_attention_variant, args.num_layers_per_virtual_pipeline_stage, args.mtp_num_layers = None, None, 0
    args.expert_model_parallel_size = 2
    with pytest.raises(ValueError, match="expert parallelism .* is refused"):
        validate_tree_args(args)


def _train_body(cases):
    from megatron.core import parallel_state as ps

    from megatron_tree.cp.execution import carry as carry_exec
    from megatron_tree.cp.planning.carry import carry_store_bytes, carry_store_timeline
    from megatron_tree.megatron.carry import carry_geometry, carry_items
    from megatron_tree.training.models import ModelArgs, build_model, forward_backward, make_config, report_totals
    from megatron_tree.training.models import wrap_ddp

    out = []
    samples = _samples(1)
    for case in cases:
        res = {}
        for side in ("carry", "whole"):
            init_megatron(seed=7, kernels=True)
            if case.get("kind") == "dsa":
                from megatron_tree.cpu import dsa as cpu_dsa

                cpu_dsa.enable()  # the torch Hadamard rotation (stock's needs bf16 and CUDA) and loss tracker
            torch.set_default_dtype(torch.float64)
            margs = ModelArgs(kind=case.get("kind", "gpt"), num_layers=2, window_size=case.get("window"),
                              sinks=case.get("sinks", False))
            if "pattern" in case:
                margs.pattern = case["pattern"]
            config = make_config(margs, dtype=torch.float64, recompute=case.get("recompute", "none"))
            ddp = wrap_ddp(build_model(config, margs), config)
            carry_exec._FAULT = case.get("fault") if side == "carry" else None
            if side == "carry":
                mbs = pack(samples, case["budget"], carry=True, pad_to_multiple_of=4)
                items = carry_items(mbs, keep=case.get("keep"))
                try:
                    reports = forward_backward(ddp, items, loss_type="sft")
                    geom = carry_geometry(ddp.module)
                    # what the store held at the end of each item but the last (recorded as the next began)
                    res["store"] = ([(b, a) for _, b, a in items[0].store.history[1:]],
                                    carry_store_timeline(mbs, geom, keep=case.get("keep"))[:-1],
                                    sum(carry_store_bytes(mbs, geom)))
                    res["phases"] = sorted({item.phase for item in items})
                except ValueError as e:  # a layer kind that refuses carry
                    out.append(dict(error=str(e)))
                    ps.destroy_model_parallel()
                    torch.set_default_dtype(torch.float32)
                    break
            else:
                reports = forward_backward(ddp, pack(samples, 10 ** 6, pad_to_multiple_of=4), loss_type="sft")
            carry_exec._FAULT = None
            res[side] = dict(loss=report_totals(reports).clone(),
                             grads={n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()})
            ps.destroy_model_parallel()
            torch.set_default_dtype(torch.float32)
        if "carry" not in res:
            continue
        a, b = res["carry"], res["whole"]
        err = max(float((a["grads"][n] - g).abs().max() / g.abs().max().clamp(min=1e-30)) for n, g in b["grads"].items())
        out.append(dict(loss=float(abs(a["loss"][0] / a["loss"][1] - b["loss"][0] / b["loss"][1])),
                        tokens=(float(a["loss"][1]), float(b["loss"][1])), grads=err, store=res["store"],
                        phases=res["phases"]))
    return out


# `megatron-tree verify --carry` (tests/test_megatron_verify.py) checks GPT with window + sinks, MG*-*E,
# MLA, qwen3next, TP2 + SP, DP2, full recompute and the stale-store and detach faults against per-sample
# stock training; these cases add what it does not: GDN under full recompute, MambaModel, DSA (its K / V
# and indexer keys carried) under full recompute, the store's predicted bytes, the injected-twice fault on
# attention and Mamba state. ``keep``: every exporter runs once with its graph kept until its release (no fill
# forward), on Mamba-2 + GDN + attention + MoE and MambaModel, and the injected-twice fault there.
CASES = [dict(budget=8, kind="hybrid", pattern="GG", recompute="full"),
         dict(budget=8, kind="mamba", pattern="MM*E", recompute="selective"),
         dict(budget=12, fault="twice"), dict(budget=12, kind="hybrid", pattern="MM", fault="twice"),
         dict(budget=12, kind="dsa", recompute="full"),
         dict(budget=8, kind="hybrid", pattern="MG*E", keep=True), dict(budget=8, kind="mamba", pattern="MM*E", keep=True),
         dict(budget=12, kind="hybrid", pattern="MG*-", fault="twice", keep=True)]
FAULTS = [k for k, c in enumerate(CASES) if "fault" in c]


@pytest.fixture(scope="module")
def trained():
    return run_distributed(_train_body, 1, CASES, timeout=600)[0]


@pytest.mark.parametrize("k", [k for k in range(len(CASES)) if k not in FAULTS])
def test_carry_training_equals_whole_trees(trained, k):
    r = trained[k]
    assert r["tokens"][0] == r["tokens"][1]
    # verify's float64 tolerance (1e-9): GDN's decay gradients (A_log, dt_bias) are sums with heavy
    # cancellation, and a recurrence cut at a microbatch boundary chunks differently (2e-10 measured);
    # attention-only models agree to ~1e-15
    assert r["loss"] < 1e-12 and r["grads"] < 1e-9, (CASES[k], r)
    # the store item by item, state and accumulators, equals the plan's prediction exactly
    # (`carry_store_timeline`): state released after its last reader's backward, accumulators after the
    # owner's restore; the peak stays below everything the step's fills write
    measured, predicted, filled = r["store"]
    assert measured == predicted and max(b for b, _ in measured) > 0, r
    assert max(b + a for b, a in measured) < 2 * filled, r
    assert measured[-1][0] < filled, r  # by the last restores, released state is gone
    # a kept step runs no fill and no restore forward: keep / release in their places
    assert set(r["phases"]) <= ({"keep", "release", "run"} if CASES[k].get("keep") else {"fill", "restore", "run"})
    assert {"keep", "release"} <= set(r["phases"]) or not CASES[k].get("keep"), r["phases"]


@pytest.mark.parametrize("k", FAULTS)
def test_planted_carry_faults_fail(trained, k):
    assert trained[k]["grads"] > 1e-3, (CASES[k], trained[k])


def _pp_store_body():
    """Hybrid ``MG*-`` on two 1F1B stages (Mamba-2 + GDN | attention + MLP), carry at a 12-row budget: what
    each stage's store held when each item began, against the plan's timeline of that stage's layers with
    1F1B's pending backwards (stage 0: 1)."""
    import torch

    from megatron_tree.cp.planning.carry import carry_store_timeline
    from megatron_tree.megatron.carry import carry_geometry, carry_items
    from megatron_tree.training.models import ModelArgs, build_model, forward_backward, make_config, wrap_ddp

    ps = init_megatron(pp=2, seed=7, kernels=True)
    torch.set_default_dtype(torch.float64)
    margs = ModelArgs(kind="hybrid", num_layers=4)
    margs.pattern = "MG*-"
    ddp = wrap_ddp(build_model(make_config(margs, pp=2, dtype=torch.float64), margs),
                   make_config(margs, pp=2, dtype=torch.float64))
    mbs = pack(_samples(1), 12, carry=True, pad_to_multiple_of=4)
    items = carry_items(mbs)
    forward_backward(ddp, items, loss_type="sft")
    stage = ps.get_pipeline_model_parallel_rank()
    predicted = carry_store_timeline(mbs, carry_geometry(ddp.module), pending=1 - stage)
    # history: (position - pending, state, accumulators) as each item began, recorded before its releases
    measured = [(b, a) for _, b, a in items[0].store.history[1:]]
    unpipelined = carry_store_timeline(mbs, carry_geometry(ddp.module))
    torch.set_default_dtype(torch.float32)
    return stage, measured, predicted[:-1], unpipelined[:-1], carry_geometry(ddp.module).pattern


def test_pipelined_store_follows_the_plans_timeline_with_pending_backwards():
    for stage, measured, predicted, unpipelined, pattern in run_distributed(_pp_store_body, 2, timeout=600):
        assert pattern == ("MG" if stage == 0 else "*")  # (MLPs store nothing)
        assert len(measured) == len(predicted) and max(b for b, _ in measured) > 0
        # state: written by the fills, released 1F1B's pending backwards later than without pipelining: exactly
        # the plan's; accumulators appear at a reader's backward, which 1F1B runs after later items' forwards:
        # the plan counts them from the reader's item, an upper bound
        assert [b for b, _ in measured] == [b for b, _ in predicted], (stage, measured, predicted)
        assert all(a <= p for (_, a), (_, p) in zip(measured, predicted)), (stage, measured, predicted)
        if stage == 0:  # one pending backward: state held longer than the unpipelined timeline says
            assert any(b > u for (b, _), (u, _) in zip(measured, unpipelined)), (measured, unpipelined)
        else:  # the last stage has none: the unpipelined timeline
            assert [b for b, _ in measured] == [u for u, _ in unpipelined]


def test_data_pipeline_with_carry_shards_groups_and_equalises_items():
    from megatron_tree.data.pipeline import TreeDataPipeline
    from megatron_tree.megatron.carry import carry_items

    samples = _samples(2) * 2  # two windows
    steps = []
    for rank in (0, 1):
        pipe = TreeDataPipeline(samples, max_tokens_per_mb=16, global_batch_samples=len(samples) // 2, dp_rank=rank,
                                dp_size=2, carry=True, num_epochs=1, pad_to_multiple_of=4)
        steps.append(list(pipe))
    for s0, s1 in zip(*steps):
        assert s0.sample_ids == s1.sample_ids
        assert sorted(s0.rank_sample_ids + s1.rank_sample_ids) == sorted(s0.sample_ids)  # every sample once
        n0, n1 = len(carry_items(s0.microbatches)), len(carry_items(s1.microbatches))
        assert n0 == n1  # the same number of schedule items on every rank
        for s in (s0, s1):
            real = [mb for mb in s.microbatches if mb.carry is not None]
            have = {mb.carry.index for mb in real}
            assert all(set(mb.carry.reads_from) <= have for mb in real)
            for mb in real:  # dataset ids, for the loss map and the carried paths alike
                assert set(mb.loss_map.sample_index.tolist()) <= set(s.sample_ids)
                assert set(mb.carry.path_sample_ids) <= set(s.sample_ids)
                for i in mb.carry.path_sample_ids:
                    assert mb.layout.input_ids[mb.sample_rows(i)].tolist() == list(samples[i][: len(mb.sample_rows(i))])
        assert s0.num_samples_with_targets == len(s0.sample_ids)


def test_plan_carry_cli_reports_every_rank(capsys):
    from megatron_tree.training.plan import run_plan

    assert run_plan(["--preset", "long_8k_16x8k", "--scale", "0.05", "--max-tokens-per-mb", "256", "--carry",
                     "--dp", "2", "--pattern", "*G-M"]) == 0
    out = capsys.readouterr().out
    assert "rank 0:" in out and "rank 1:" in out and "restore" in out and "fill" in out
    assert "(pattern *G-M)" in out
    # two 1F1B stages: each stage's store peak (its layers, its releases 1F1B's pending backwards later); the first
    # stage holds attention and GDN, the second Mamba-2 (MLPs store nothing)
    assert run_plan(["--preset", "long_8k_16x8k", "--scale", "0.05", "--max-tokens-per-mb", "256", "--carry",
                     "--pattern", "*G-M", "--pp", "2"]) == 0
    peaks = {line.split(" (")[0]: float(line.split("peak ")[1].split(" MiB")[0])
             for line in capsys.readouterr().out.splitlines() if line.startswith("rank 0 stage")}
    assert set(peaks) == {"rank 0 stage 0", "rank 0 stage 1"} and min(peaks.values()) > 0, peaks
    assert run_plan(["--preset", "long_8k_16x8k", "--carry", "--max-tokens-per-mb", "256", "--pattern", "*G-",
                     "--pp", "2"]) == 2  # 3 layers do not split over 2 stages
    assert "--pp 2 must divide the 3 layers" in capsys.readouterr().err
    # kept graphs: none by default (each exporter forwards twice), every one with room for them (no extra forward
    # rows, keep / release in the schedule), some under a budget between
    extra, kept = {}, {}
    for mem in ("0", "1000", "0.2"):
        assert run_plan(["--preset", "long_8k_16x8k", "--scale", "0.05", "--max-tokens-per-mb", "256", "--carry",
                         "--pattern", "*G-M", "--carry-memory", mem]) == 0
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.startswith("rank 0: kept graphs"))
        kept[mem] = tuple(int(v) for v in line.split("kept graphs ")[1].split(" exporters")[0].split(" of "))
        extra[mem] = int(line.split("extra forward rows ")[1].replace(",", ""))
        assert ("keep" in out and "release" in out) == (kept[mem][0] > 0), out
    assert kept["0"][0] == 0 and extra["0"] > 0 and kept["1000"][0] == kept["1000"][1] > 0 and extra["1000"] == 0
    assert 0 < kept["0.2"][0] < kept["0.2"][1] and 0 < extra["0.2"] < extra["0"], (kept, extra)
