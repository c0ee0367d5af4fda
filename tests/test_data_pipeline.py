"""Training data pipeline: readers, DP sharding, exactly-once epochs, resume, lookahead, balance.

Oracles are independent of the pipeline: the dataset itself (tokens, masks, advantages of each
sample by dataset index), per-sample loss computed token by token with a toy model, and
brute-force optimal assignments for the balancer.
"""
from __future__ import annotations

import itertools
import json
import threading
import time

import numpy as np
import pytest
import torch

from megatron_tree.data.io import ReadReport, write_jsonl
from megatron_tree.data.lookahead import Lookahead
from megatron_tree.data.pipeline import TreeDataPipeline, read_samples
from megatron_tree.data.sharding import balance, microbatch_cost
from megatron_tree.tree import padding_microbatch
from megatron_tree.data.synthetic import make_preset
from megatron_tree.tree import Sample, gather_logprobs, policy_loss, sft_loss

VOCAB = 40
BUDGET = 32


def _dataset(seed: int = 0, families: int = 14) -> list[Sample]:
    """Small families sharing prompts (and, through a small vocabulary, sometimes first tokens across
    families), with duplicates, prefix samples, samples without targets, scalar and per-token
    advantages, and samples without a group."""
    rng = np.random.default_rng(seed)
    out: list[Sample] = []
    for g in range(families):
        prompt = rng.integers(1, VOCAB, int(rng.integers(1, 12)))
        base = None
        for j in range(int(rng.integers(1, 6))):
            if j == 1 and base is not None:
                toks, mask = base.tokens.copy(), base.loss_mask.copy()  # duplicate
            elif j == 2:
                toks = prompt[: max(1, len(prompt) // 2)].copy()  # a prefix of the prompt: no targets
                mask = np.zeros(len(toks), bool)
            else:
                toks = np.concatenate([prompt, rng.integers(1, VOCAB, int(rng.integers(0, 9)))])
                mask = np.zeros(len(toks), bool)
                mask[len(prompt):] = True
                mask[0] = False
            adv = float(rng.normal()) if j % 2 else rng.normal(size=len(toks))
            s = Sample(tokens=toks, loss_mask=mask, advantage=adv, old_logprobs=-rng.exponential(size=len(toks)),
                       group=g if g % 4 else None)
            base = base or s
            out.append(s)
    return out


def _pipes(samples, dp_size, **kw):
    return [TreeDataPipeline(samples, dp_rank=r, dp_size=dp_size, **kw) for r in range(dp_size)]


def _check_microbatch(mb, samples):
    """Every sample of ``mb`` (by dataset index) has its tokens, positions and loss entries."""
    mb.layout.validate()
    lm = mb.loss_map
    assert list(mb.sample_ids) == sorted(mb.sample_ids)
    assert set(lm.sample_index.tolist()) <= set(mb.sample_ids)
    for sid in mb.sample_ids:
        s = samples[sid]
        rows = mb.sample_rows(sid)
        assert mb.layout.input_ids[rows].tolist() == s.tokens.tolist()
        assert mb.layout.position_ids[rows].tolist() == list(range(len(s)))
        sel = lm.sample_index == sid
        t = np.flatnonzero(s.target_mask())
        assert lm.positions[sel].tolist() == t.tolist()
        assert lm.targets[sel].tolist() == s.tokens[t].tolist()
        assert lm.source_rows[sel].tolist() == rows[t - 1].tolist()
        np.testing.assert_array_equal(lm.advantages[sel].numpy(), s.per_token("advantage", 0.0)[t])
        np.testing.assert_array_equal(lm.old_logprobs[sel].numpy(), s.old_logprobs[t])


def _same_microbatch(a, b):
    assert a.sample_ids == b.sample_ids and a.stats == b.stats
    for f in ("input_ids", "position_ids", "segment_offsets", "segment_parent", "visible_until", "path_prev"):
        assert torch.equal(getattr(a.layout, f), getattr(b.layout, f))
    for f in ("source_rows", "targets", "sample_index", "positions", "weights", "advantages", "old_logprobs"):
        assert torch.equal(getattr(a.loss_map, f), getattr(b.loss_map, f))


def _same_step(a, b):
    assert (a.epoch, a.step, a.global_step, a.sample_ids, a.num_targets) == \
        (b.epoch, b.step, b.global_step, b.sample_ids, b.num_targets)
    assert len(a.microbatches) == len(b.microbatches) and a.state == b.state
    for x, y in zip(a.microbatches, b.microbatches):
        _same_microbatch(x, y)


# ------------------------------------------------------------------------------------ exactly once
@pytest.mark.parametrize("dp_size,gbs,keep_groups", [(1, 9, True), (3, 16, False), (4, 16, True), (4, 7, True)])
def test_exactly_once_over_epochs_across_dp_ranks(dp_size, gbs, keep_groups):
    samples = _dataset(1)
    n = len(samples)
    pipes = _pipes(samples, dp_size, max_tokens_per_mb=BUDGET, global_batch_samples=gbs, seed=5, num_epochs=2,
                   keep_groups=keep_groups)
    runs = [list(p) for p in pipes]
    assert all(len(r) == len(runs[0]) == 2 * pipes[0].steps_per_epoch for r in runs)
    orders = {0: [], 1: []}
    for steps in zip(*runs):
        window = steps[0].sample_ids
        assert all(st.sample_ids == window and st.num_targets == steps[0].num_targets for st in steps)
        # equal microbatch counts; ranks partition the window
        assert len({len(st.microbatches) for st in steps}) == 1
        owned = [i for st in steps for mb in st.microbatches for i in mb.sample_ids]
        assert sorted(owned) == list(window)
        for st in steps:
            assert st.rank_sample_ids == tuple(sorted(i for mb in st.microbatches for i in mb.sample_ids))
            assert st.num_padding_microbatches == sum(mb.stats.num_samples == 0 for mb in st.microbatches)
            for mb in st.microbatches:
                _check_microbatch(mb, samples)
        # global denominators, from the dataset
        assert steps[0].num_targets == sum(int(samples[i].target_mask().sum()) for i in window)
        assert steps[0].num_targets == sum(st.local_num_targets for st in steps)
        assert steps[0].flat_tokens == sum(len(samples[i]) for i in window)
        assert steps[0].num_samples_with_targets == sum(bool(samples[i].target_mask().any()) for i in window)
        # the step's target weights by source depth (a target at position t has its source at depth t - 1),
        # from the dataset; the same array on every rank and every microbatch (MTP's step-wide logging)
        want = np.zeros(max(len(samples[i]) for i in window))
        for i in window:
            t = np.flatnonzero(samples[i].target_mask())
            np.add.at(want, t - 1, samples[i].per_token("weight", 1.0)[t])
        for st in steps:
            np.testing.assert_allclose(np.pad(st.target_weight_by_depth, (0, len(want) - len(st.target_weight_by_depth))),
                                       want, rtol=1e-12)
            assert all(mb.step_weight_by_depth is st.target_weight_by_depth for mb in st.microbatches)
        orders[steps[0].epoch] += list(window)
    for e in (0, 1):
        assert sorted(orders[e]) == list(range(n))  # exactly once per epoch
    assert orders[0] != orders[1]  # a new order each epoch


def test_windows_keep_groups_together_and_order_is_seeded():
    samples = [s for s in make_preset("many_small_64_4x16", scale=0.25) if s.group < 12]  # 12 groups of 4, shuffled
    assert len(samples) == 48
    p = TreeDataPipeline(samples, max_tokens_per_mb=64, global_batch_samples=8, seed=3)
    for st in p:
        groups = [samples[i].group for i in st.sample_ids]
        assert all(groups.count(g) == 4 for g in set(groups)) and len(set(groups)) == 2
        # the two families share their prompts: tree rows < flat tokens
        assert st.tree_tokens == 2 * (16 + 4 * 4) < st.flat_tokens
    same = TreeDataPipeline(samples, max_tokens_per_mb=64, global_batch_samples=8, seed=3)
    other = TreeDataPipeline(samples, max_tokens_per_mb=64, global_batch_samples=8, seed=4)
    assert np.array_equal(p.epoch_order(0), same.epoch_order(0))
    assert not np.array_equal(p.epoch_order(0), other.epoch_order(0))
    assert not np.array_equal(p.epoch_order(0), p.epoch_order(1))
    assert np.array_equal(TreeDataPipeline(samples, max_tokens_per_mb=64, global_batch_samples=8,
                                           shuffle=False).epoch_order(2), np.arange(48))


def test_drop_last_and_fixed_microbatch_count():
    samples = _dataset(2)
    n = len(samples)
    p = TreeDataPipeline(samples, max_tokens_per_mb=BUDGET, global_batch_samples=10, drop_last=True,
                         microbatches_per_rank=4, dp_size=2, dp_rank=1)
    steps = list(p)
    assert len(steps) == p.steps_per_epoch == n // 10
    assert all(len(st.microbatches) == 4 and st.num_samples == 10 for st in steps)
    assert len({i for st in steps for i in st.sample_ids}) == 10 * (n // 10)
    with pytest.raises(ValueError, match="do not fit 2 ranks x microbatches_per_rank=1"):
        list(TreeDataPipeline(samples, max_tokens_per_mb=BUDGET, global_batch_samples=40, microbatches_per_rank=1,
                              dp_size=2))


@pytest.mark.parametrize("pad_to_budget", [False, True])
def test_padding_shapes_follow_pack_options(pad_to_budget):
    samples = _dataset(12)
    pipes = _pipes(samples, 4, max_tokens_per_mb=BUDGET, global_batch_samples=9, pad_to_multiple_of=8,
                   pad_to_budget=pad_to_budget, pad_id=3)
    padded = 0
    for steps in zip(*pipes):
        per_rank = len(steps[0].microbatches)
        assert sum(st.num_padding_microbatches for st in steps) == 4 * per_rank - steps[0].num_microbatches
        padded += sum(st.num_padding_microbatches for st in steps)
        for mb in (mb for st in steps for mb in st.microbatches):
            assert mb.num_rows == BUDGET if pad_to_budget else (mb.num_rows % 8 == 0 and mb.num_rows <= BUDGET)
            assert (mb.layout.input_ids[mb.layout.is_padding] == 3).all()
            _check_microbatch(mb, samples)
    assert padded > 0


# ------------------------------------------------------------------------------------ loss oracle
def test_step_loss_and_gradient_match_per_sample_oracle():
    """Summed over all ranks' microbatches with the step's global denominator, the tree loss and its
    gradient equal the per-sample token-mean NLL of the window (a toy model: logits = E[token])."""
    samples = _dataset(3)
    dp = 3
    torch.manual_seed(0)
    E = torch.randn(VOCAB, VOCAB, dtype=torch.float64)
    for steps in itertools.islice(zip(*[iter(p) for p in _pipes(samples, dp, max_tokens_per_mb=BUDGET,
                                                                   global_batch_samples=12, seed=1)]), 3):
        e_tree = E.clone().requires_grad_(True)
        tree = 0.0
        for st in steps:
            for mb in st.microbatches:
                lp = gather_logprobs(e_tree[mb.layout.input_ids], mb.loss_map.source_rows, mb.loss_map.targets)
                tree = tree + sft_loss(lp, mb.loss_map, denominator=st.num_targets)
        tree.backward()
        e_ref = E.clone().requires_grad_(True)
        ref, count = 0.0, 0
        for i in steps[0].sample_ids:
            s = samples[i]
            for t in np.flatnonzero(s.target_mask()).tolist():
                ref = ref - torch.log_softmax(e_ref[int(s.tokens[t - 1])], -1)[int(s.tokens[t])]
                count += 1
        ref = ref / count
        ref.backward()
        assert abs(tree.item() - ref.item()) < 1e-10
        torch.testing.assert_close(e_tree.grad, e_ref.grad, atol=1e-10, rtol=0)


def test_padding_microbatch_is_a_real_zero_loss_microbatch():
    mb = padding_microbatch(64, num_rows=8, pad_id=7, float_fields=("advantages", "old_logprobs"))
    mb.layout.validate()
    assert mb.num_rows == 8 and mb.layout.num_padding == 8 and mb.layout.visible_pairs() == 0
    assert mb.layout.input_ids.tolist() == [7] * 8 and mb.layout.dense_mask().equal(torch.eye(8, dtype=torch.bool))
    assert len(mb.loss_map) == 0 and mb.sample_ids == () and mb.stats.padding_tokens == 8
    logits = torch.randn(8, VOCAB, dtype=torch.float64, requires_grad=True)
    lp = gather_logprobs(logits, mb.loss_map.source_rows, mb.loss_map.targets)
    loss = sft_loss(lp, mb.loss_map, denominator=17) + policy_loss(lp, mb.loss_map, denominator=17)[0]
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))
    with pytest.raises(KeyError):
        mb.sample_rows(0)


# ------------------------------------------------------------------------------------ resume
@pytest.mark.parametrize("lookahead", [0, 3])
def test_resume_mid_epoch_gives_exactly_the_remaining_steps(lookahead):
    samples = _dataset(4)
    kw = dict(max_tokens_per_mb=BUDGET, global_batch_samples=6, dp_size=2, dp_rank=1, seed=9, num_epochs=2)
    full = list(TreeDataPipeline(samples, **kw))
    k = len(full) // 2 - 1  # mid-epoch 0
    a = TreeDataPipeline(samples, lookahead=lookahead, **kw)
    it = iter(a)
    head = [next(it) for _ in range(k)]
    if lookahead:
        time.sleep(0.05)  # let the thread run ahead: the state must still count consumed steps only
    state = json.loads(json.dumps(a.state_dict()))
    assert state == head[-1].state and state["cursor"] == 6 * k and state["epoch"] == 0
    a.close()
    b = TreeDataPipeline(samples, lookahead=lookahead, **kw)
    b.load_state_dict(state)
    tail = list(b)
    assert len(head) + len(tail) == len(full)
    for x, y in zip(head + tail, full):
        _same_step(x, y)
    assert b.state_dict()["epoch"] == 2 and list(b) == []  # finished: nothing more


def test_resume_with_other_dp_size_is_still_exactly_once():
    samples = _dataset(5)
    kw = dict(max_tokens_per_mb=BUDGET, global_batch_samples=8, seed=2)
    first = TreeDataPipeline(samples, dp_size=2, **kw)
    it = iter(first)
    seen = [i for _ in range(2) for i in next(it).sample_ids]
    state = first.state_dict()
    for r in range(3):
        p = TreeDataPipeline(samples, dp_size=3, dp_rank=r, **kw)
        p.load_state_dict(state)
        seen += [i for st in p for i in st.rank_sample_ids]
    assert sorted(seen) == list(range(len(samples)))
    with pytest.raises(ValueError, match="different dataset"):
        TreeDataPipeline(samples[:-1], dp_size=2, **kw).load_state_dict(state)


def test_load_state_dict_supersedes_a_running_iteration():
    samples = _dataset(6)
    p = TreeDataPipeline(samples, max_tokens_per_mb=BUDGET, global_batch_samples=5, lookahead=2)
    it = iter(p)
    first = next(it)
    p.load_state_dict(first.state)
    assert list(it) == []  # the old iterator stops
    assert next(iter(p)).step == 1


# ------------------------------------------------------------------------------------ lookahead
def _lookahead_threads():
    return [t for t in threading.enumerate() if t.name == "megatron-tree-lookahead" and t.is_alive()]


def test_lookahead_yields_the_same_steps_and_plans_as_synchronous():
    samples = _dataset(7)
    plan = lambda mb: (mb.num_rows, mb.sample_ids)
    kw = dict(max_tokens_per_mb=BUDGET, global_batch_samples=7, dp_size=2, seed=4, num_epochs=2, plan_fn=plan)
    sync = list(TreeDataPipeline(samples, **kw))
    for depth in (1, 4):
        ahead = list(TreeDataPipeline(samples, lookahead=depth, **kw))
        assert len(ahead) == len(sync)
        for x, y in zip(ahead, sync):
            _same_step(x, y)
            assert x.plans == y.plans == [plan(mb) for mb in y.microbatches]
    assert not _lookahead_threads()


def test_lookahead_propagates_errors_and_shuts_down_cleanly():
    samples = _dataset(8)
    calls = []

    def plan(mb):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("planner failed")
        return len(calls)

    p = TreeDataPipeline(samples, max_tokens_per_mb=BUDGET, global_batch_samples=5, microbatches_per_rank=1,
                         dp_size=2, lookahead=2, plan_fn=plan)
    got = []
    with pytest.raises(RuntimeError, match="planner failed"):
        for st in p:
            got.append(st.plans)
    assert got == [[1], [2]]  # the steps before the failure arrive, in order
    assert p.state_dict()["epoch_step"] == 2
    assert not _lookahead_threads()

    # breaking out of the loop, or closing, stops the producer even when its queue is full
    p = TreeDataPipeline(samples, max_tokens_per_mb=BUDGET, global_batch_samples=2, lookahead=2, num_epochs=None)
    for st in p:
        time.sleep(0.05)
        break
    p.close()
    assert not _lookahead_threads()
    with Lookahead(lambda: iter(range(10**9)), depth=1) as la:
        assert next(la) == 0 and next(la) == 1
    assert not la.alive and list(la) == []


def test_timing_and_lookahead_builds_ahead():
    """Timing fields add up, and lookahead really builds ahead: once the consumer holds step 0 the
    thread builds steps 1 and 2 (depth 2) without being asked, and never more than depth + 1 ahead.
    Counted, not timed, so a loaded machine cannot fail it."""
    samples = _dataset(9)
    slow_plan = lambda mb: time.sleep(0.02)
    kw = dict(max_tokens_per_mb=BUDGET, global_batch_samples=10, dp_size=2, plan_fn=slow_plan)
    sync = TreeDataPipeline(samples, **kw)
    want = [st.sample_ids for st in sync]
    t = sync.timing
    n = sync.steps_per_epoch
    assert n >= 4 and t.steps == n and t.plan_s >= 0.02 * t.steps and t.produce_s == t.pack_s + t.plan_s
    assert t.wait_s >= t.produce_s  # without lookahead the consumer does the work (nested timers)

    ahead = TreeDataPipeline(samples, lookahead=2, **kw)
    built, cv = [], threading.Condition()
    build = ahead._build

    def counting_build(state, order):  # runs in the lookahead thread
        step = build(state, order)
        with cv:
            built.append(step.global_step)
            cv.notify_all()
        return step

    ahead._build = counting_build
    it = iter(ahead)
    got = [next(it)]
    with cv:
        assert cv.wait_for(lambda: len(built) >= 3, timeout=60), built  # steps 1, 2 queued unasked
        assert len(built) <= 1 + 2 + 1, built  # step 0 handed out, 2 queued, at most 1 in the making
    assert ahead.timing.steps == 1 and ahead.state_dict()["global_step"] == 1  # only handed-out steps count
    got += list(it)
    assert [st.sample_ids for st in got] == want and built == list(range(n))
    t = ahead.timing
    assert t.steps == n and t.plan_s >= 0.02 * n and t.produce_s == t.pack_s + t.plan_s
    assert t.wait_s >= 0 and 0 <= t.max_wait_s <= t.wait_s and 0.0 <= t.hidden_fraction <= 1.0
    assert all(st.wait_s >= 0 and st.pack_s > 0 and st.plan_s >= 0.02 * len(st.microbatches) for st in got)


# ------------------------------------------------------------------------------------ balance
def test_balance_against_brute_force_optimum():
    rng = np.random.default_rng(0)
    for trial in range(150):
        m = int(rng.integers(2, 4))
        n = int(rng.integers(1, 8))
        c = [rng.exponential(1, n), rng.integers(1, 10, n).astype(float), rng.pareto(1.0, n) + 0.01][trial % 3]
        cap = -(-n // m)
        A = np.array(list(itertools.product(range(m), repeat=n)))
        onehot = A[:, :, None] == np.arange(m)
        feasible = (onehot.sum(1) <= cap).all(1)
        opt = (onehot * c[None, :, None]).sum(1)[feasible].max(1).min()
        assign = balance(c, m)
        assert sorted(i for a in assign for i in a) == list(range(n)) and all(len(a) <= cap for a in assign)
        assert max(c[a].sum() for a in assign) <= 4 / 3 * opt + 1e-12
    assert balance([5, 1, 1, 1, 1, 1], 2) == [[0, 4, 5], [1, 2, 3]]
    assert balance([5, 1, 1, 1, 1, 1], 2, per_rank=3) == [[0, 4, 5], [1, 2, 3]]
    with pytest.raises(ValueError, match="do not fit"):
        balance([1, 1, 1], 2, per_rank=1)


def test_balance_on_skewed_preset():
    """One dominant family (split over microbatches) plus small families, 4 DP ranks: the slowest
    rank stays within 4/3 of the lower bound max(largest microbatch, mean load), and windows too
    small for one full microbatch per rank are spread over every rank instead of leaving ranks idle."""
    samples = make_preset("dominant_14745_16x921", scale=0.05, vocab=1000)
    samples += make_preset("many_small_64_4x16", scale=0.5, seed=1, vocab=1000)[:96]
    kw = dict(max_tokens_per_mb=1024, global_batch_samples=32, dp_size=4, seed=0)
    ranks = [list(TreeDataPipeline(samples, dp_rank=r, **kw)) for r in range(4)]
    unbalanced = list(TreeDataPipeline(samples, balance_budget=False, **kw))
    assert len(unbalanced) == len(ranks[0]) == 5
    for steps, ub in zip(zip(*ranks), unbalanced):
        st = steps[0]
        assert st.sample_ids == ub.sample_ids and st.num_targets == ub.num_targets
        costs = [microbatch_cost(mb) for s in steps for mb in s.microbatches if mb.stats.num_samples]
        assert [sum(microbatch_cost(mb) for mb in s.microbatches) for s in steps] == pytest.approx(st.rank_costs)
        lower = max(max(costs), sum(st.rank_costs) / 4)
        assert max(st.rank_costs) <= 4 / 3 * lower
        assert max(st.rank_costs) <= max(ub.rank_costs) + 1e-9
        assert all(s.num_padding_microbatches < len(s.microbatches) for s in steps)  # no rank idles
    assert np.mean([st.balance_ratio for st in ranks[0]]) < 1.2
    assert np.mean([ub.balance_ratio for ub in unbalanced]) > 2  # without the smaller budget ranks idle


# ------------------------------------------------------------------------------------ readers
def _parquet_tools():
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from megatron_tree.data.parquet import read_parquet, write_parquet

    return pa, pq, read_parquet, write_parquet


def test_parquet_roundtrip_and_pipeline_from_files(tmp_path):
    _, _, read_parquet, write_parquet = _parquet_tools()
    samples = _dataset(10)
    write_parquet(samples[:20], tmp_path / "a.parquet", row_group_size=7)
    write_jsonl(samples[20:], tmp_path / "b.jsonl")
    back = read_parquet(tmp_path / "a.parquet", batch_size=5)
    assert len(back) == 20
    for s, b in zip(samples, back):
        assert b.tokens.tolist() == s.tokens.tolist() and b.group == s.group
        np.testing.assert_array_equal(b.target_mask(), s.target_mask())
        np.testing.assert_array_equal(b.per_token("advantage", 0.0), s.per_token("advantage", 0.0))
        np.testing.assert_array_equal(b.old_logprobs, s.old_logprobs)
    rep = ReadReport()
    both = read_samples(tmp_path, report=rep)  # a directory: files in name order
    assert [s.tokens.tolist() for s in both] == [s.tokens.tolist() for s in samples]
    assert rep.sources[0] == f"{tmp_path}/a.parquet:row 0" and rep.sources[19] == f"{tmp_path}/a.parquet:row 19"
    assert rep.sources[20] == f"{tmp_path}/b.jsonl:1"
    p = TreeDataPipeline.from_files([tmp_path / "a.parquet", tmp_path / "b.jsonl"], max_tokens_per_mb=BUDGET,
                                    global_batch_samples=8, vocab_size=VOCAB)
    assert sorted(i for st in p for i in st.sample_ids) == list(range(len(samples)))
    # problems the readers cannot see are reported with the sample's file position
    with pytest.raises(ValueError, match=r"b.jsonl:\d+: \d+ tokens exceed max_tokens_per_mb=8"):
        TreeDataPipeline.from_files(tmp_path / "b.jsonl", max_tokens_per_mb=8, global_batch_samples=8)
    with pytest.raises(ValueError, match=r"a.parquet:row 0: token id \d+ >= vocab size 3"):
        TreeDataPipeline(back, sources=rep.sources[:20], vocab_size=3, max_tokens_per_mb=BUDGET,
                         global_batch_samples=4)


def test_parquet_bad_rows_error_and_skip(tmp_path):
    pa, pq, read_parquet, _ = _parquet_tools()
    rows = [
        dict(tokens=[1, 2, 3], loss_mask=[False, True, True], advantage=0.5, group="g0"),  # row 0 ok
        dict(tokens=[], loss_mask=[], advantage=0.1, group="g0"),  # row 1 empty
        dict(tokens=[1, 2, 3], loss_mask=[False, True], advantage=0.1, group="g1"),  # row 2 mask length
        dict(tokens=[4, 5], loss_mask=[False, True], advantage=float("nan"), group="g1"),  # row 3 nan adv
        dict(tokens=[4, 99], loss_mask=[False, True], advantage=1.0, group="g2"),  # row 4 vocab
        dict(tokens=None, loss_mask=None, advantage=1.0, group="g2"),  # row 5 null tokens
        dict(tokens=[4, None], loss_mask=[False, True], advantage=1.0, group="g2"),  # row 6 null token
        dict(tokens=[7, 8, 9], loss_mask=None, advantage=None, group="g3"),  # row 7 ok (defaults)
    ]
    table = pa.table({k: [r[k] for r in rows] for k in rows[0]})
    path = tmp_path / "bad.parquet"
    pq.write_table(table, path)
    with pytest.raises(ValueError, match=r"bad.parquet:row 1: empty sample"):
        read_parquet(path, vocab_size=50)
    rep = ReadReport()
    kept = read_parquet(path, vocab_size=50, bad_sample="skip", report=rep, batch_size=3)
    assert [s.tokens.tolist() for s in kept] == [[1, 2, 3], [7, 8, 9]]
    assert rep.sources == [f"{path}:row 0", f"{path}:row 7"]
    assert [w for w, _ in rep.skipped] == [f"{path}:row {i}" for i in range(1, 7)]
    reasons = [r for _, r in rep.skipped]
    assert "empty sample" in reasons[0] and "loss_mask has shape" in reasons[1]
    assert "advantage has a non-finite value" in reasons[2] and "vocab size 50" in reasons[3]
    assert "tokens is null" in reasons[4] and "tokens contains a null value" in reasons[5]
    assert kept[0].group == "g0" and float(kept[0].advantage) == 0.5
    pq.write_table(pa.table({"ids": [[1, 2]]}), tmp_path / "nocol.parquet")
    with pytest.raises(ValueError, match="nocol.parquet: missing required column 'tokens'"):
        read_parquet(tmp_path / "nocol.parquet", bad_sample="skip")
    with pytest.raises(ValueError, match="bad_sample must be"):
        read_parquet(path, bad_sample="ignore")


def test_jsonl_bad_lines_through_read_samples(tmp_path):
    p = tmp_path / "d.jsonl"
    with open(p, "w") as f:
        f.write(json.dumps({"tokens": [1, 2, 3], "advantage": 0.5}) + "\n")
        f.write(json.dumps({"tokens": [1, 2], "advantage": float("inf")}).replace("Infinity", "1e999") + "\n")
        f.write(json.dumps({"tokens": [5, 60]}) + "\n")
    with pytest.raises(ValueError, match="d.jsonl:2: advantage has a non-finite value"):
        read_samples(p, vocab_size=50)
    rep = ReadReport()
    kept = read_samples([p], vocab_size=50, bad_sample="skip", report=rep)
    assert len(kept) == 1 and [w for w, _ in rep.skipped] == [f"{p}:2", f"{p}:3"]
    assert "vocab size 50" in rep.skipped[1][1]
    # from_files keeps the report: the count and the summary of what was dropped
    pipe = TreeDataPipeline.from_files([p], vocab_size=50, bad_sample="skip", max_tokens_per_mb=BUDGET,
                                       global_batch_samples=4)
    assert pipe.skipped == 2 and pipe.read_report.skipped == rep.skipped and pipe.sources == [f"{p}:1"]
    assert pipe.read_report.summary().splitlines() == [
        "skipped 2 bad samples (--tree-bad-sample skip):", f"  {p}:2: advantage has a non-finite value at a "
        "target position (per-sample value inf)", f"  {p}:3: token id 60 >= vocab size 50"]
    assert TreeDataPipeline(kept, max_tokens_per_mb=BUDGET, global_batch_samples=4).skipped == 0
    with pytest.raises(ValueError, match="unknown file type"):
        read_samples(tmp_path / "x.csv")


def test_inconsistent_optional_fields_are_rejected_up_front():
    samples = _dataset(11)[:6]
    samples[4] = Sample(tokens=samples[4].tokens, loss_mask=samples[4].loss_mask, advantage=1.0)  # no old_logprobs
    with pytest.raises(ValueError, match="x.jsonl:5: has no old_logprobs"):
        TreeDataPipeline(samples, sources=[f"x.jsonl:{i + 1}" for i in range(6)], max_tokens_per_mb=BUDGET,
                         global_batch_samples=4)
