"""Carry groups cut over data-parallel ranks (issue 38): the assignment, the lock-step schedule and its syncs.

Host side, no model: `tree.carry.assign_carry_ranks` and `cp.planning.carry_ranks.rank_schedule` on GRPO-like and
long-path steps at DP 2/3/4, checked against the rules the executor relies on, written out here independently of
the simulator: every microbatch's items once on its rank, the same number of items on every rank, a remote owner's
state sent at a sync after its fill (or keep) and before its readers' first forward, the readers' gradient returned
at a sync after their last backward and before the owner's restore (or release), the store lifetimes covering
every read. Exactness through Megatron-Core: tests/test_megatron_verify.py (DP2 / DP4 cases with carry_cut) and
tests/test_trainer.py (``--tree-carry-cut always``); the plan's figures: ``plan --carry --dp``.
"""
from __future__ import annotations

import numpy as np
import pytest

from megatron_tree.cp.planning.carry_ranks import (PAD, CarryWork, plan_carry_ranks, rank_lifetimes, rank_schedule,
                                                 split_step_ms)
from megatron_tree.tree import pack
from megatron_tree.tree.carry import assign_carry_groups, assign_carry_ranks


def _grpo(seed=0, groups=2, prompt=40, completions=6, tail=20):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(groups):
        p = rng.integers(1, 100, prompt).tolist()
        out += [p + rng.integers(1, 100, int(rng.integers(tail // 2, tail))).tolist() for _ in range(completions)]
    out.append(rng.integers(1, 100, 90).tolist())  # one long path: a chain of chunks
    return out


def _check_schedule(mbs, ranks, schedule):
    n = len(ranks)
    assert len({len(x) for x in schedule.items}) == 1  # the same number of items on every rank
    for r, idx in enumerate(ranks):
        got = sorted((i, p) for i, p in schedule.items[r] if p != PAD)
        want = sorted([(i, "run") for i in idx if not len(mbs[i].carry.exported)]
                      + [(i, p) for i in idx if len(mbs[i].carry.exported) for p in ("fill", "restore")])
        assert got == want, r
    pos = {(i, p): k for r in range(n) for k, (i, p) in enumerate(schedule.items[r]) if p != PAD}
    rank_of = {i: r for r, idx in enumerate(ranks) for i in idx}
    state_at = {t.owner: k for k, ts in schedule.syncs.items() for t in ts if t.kind == "state"}
    grad_at = {t.owner: k for k, ts in schedule.syncs.items() for t in ts if t.kind == "grad"}
    for i, mb in enumerate(mbs):
        for phase in ("run", "fill", "restore"):
            if (i, phase) not in pos:
                continue
            for o in mb.carry.reads_from:
                if rank_of[o] == rank_of[i]:  # on one rank: the owner's fill comes first
                    assert pos[(o, "fill")] < pos[(i, phase)]
                    continue
                # across ranks: filled, then sent at a sync at or before this item's start
                assert pos[(o, "fill")] < state_at[o] <= pos[(i, phase)], (o, i, phase)
                # and the gradient returns after this item's backward, before the owner's restore
                assert pos[(i, phase)] < grad_at[o] <= pos[(o, "restore")], (o, i, phase)
    for t in (t for ts in schedule.syncs.values() for t in ts):  # only what crosses ranks moves
        assert t.src == rank_of[t.owner] and t.src not in t.ranks and t.ranks
    for r in range(n):  # the store keeps what each item reads until that item's backward is done
        lives = rank_lifetimes(mbs, schedule, r)
        for k, (i, p) in enumerate(schedule.items[r]):
            if p == PAD:
                continue
            for o in mbs[i].carry.reads_from:
                fill, _, _, last, restore = lives[o]
                assert fill <= k <= last and k <= restore, (r, k, o, lives[o])


@pytest.mark.parametrize("cut", ["auto", "always"])
@pytest.mark.parametrize("dp", [2, 3, 4])
@pytest.mark.parametrize("budget", [16, 32])
def test_schedule_sends_state_before_its_readers_and_gradient_before_the_restore(cut, dp, budget):
    mbs = pack(_grpo(seed=dp + budget), budget, carry=True)
    ranks = assign_carry_ranks(mbs, dp, cut=cut)
    assert sorted(i for r in ranks for i in r) == list(range(len(mbs)))  # every microbatch once
    schedule = rank_schedule(mbs, ranks)
    _check_schedule(mbs, ranks, schedule)
    if cut == "always":
        assert schedule.syncs and schedule.cut_owners()


def test_assignment_cuts_only_what_exceeds_a_share_and_balances_better():
    mbs = pack(_grpo(groups=1, completions=12), 16, carry=True)  # one tree: a group far over half the rows
    never, auto = assign_carry_ranks(mbs, 2, cut="never"), assign_carry_ranks(mbs, 2, cut="auto")
    assert never == assign_carry_groups(mbs, 2)
    load = lambda ranks: max(sum(mbs[i].owned_rows for i in r) for r in ranks)
    assert load(auto) < load(never)
    assert rank_schedule(mbs, auto).syncs  # the big group was cut
    small = pack(_grpo(groups=8, completions=2, prompt=6, tail=6), 64, carry=True)  # many small groups: none cut
    assert not rank_schedule(small, assign_carry_ranks(small, 2, cut="auto")).syncs
    with pytest.raises(ValueError, match="carry cut policy"):
        assign_carry_ranks(mbs, 2, cut="sometimes")


def test_pipeline_hands_every_rank_the_same_schedule_and_each_sample_once():
    from megatron_tree.data.pipeline import TreeDataPipeline
    from megatron_tree.tree import Sample

    samples = [Sample(tokens=np.asarray(t), loss_mask=np.r_[False, np.ones(len(t) - 1, bool)]) for t in _grpo()]
    steps = [list(TreeDataPipeline(samples, max_tokens_per_mb=16, global_batch_samples=len(samples), dp_rank=r,
                                   dp_size=2, carry=True, carry_cut="always", carry_schedule_fn=rank_schedule,
                                   num_epochs=1)) for r in (0, 1)]
    for s0, s1 in zip(*steps):
        assert s0.carry_schedule is not None and s0.carry_schedule.items == s1.carry_schedule.items
        assert sorted(s0.rank_sample_ids + s1.rank_sample_ids) == sorted(s0.sample_ids)
        for s in (s0, s1):  # its items: its microbatches, then padding for the rest
            n = s.carry_schedule.num_items
            pads = s.carry_schedule.num_pads(s.dp_rank)
            assert s.num_padding_microbatches == pads
            assert len(s.microbatches) - pads + sum(len(mb.carry.exported) > 0 for mb in s.microbatches
                                                    if mb.carry is not None) == n - pads


def test_plan_predicts_carry_over_dp_against_split_packing(capsys):
    """``plan --carry --dp N``: every row once at every DP size, the summary and rank lines as before, and the
    predicted step of the cut schedule beside split packing's."""
    from megatron_tree.training.plan import run_plan

    for dp in ("1", "4"):
        assert run_plan(["--preset", "long_8k_16x8k", "--scale", "0.125", "--max-tokens-per-mb", "2048", "--carry",
                         "--dp", dp, "--carry-memory", "40"]) == 0
        out = capsys.readouterr().out
        computed = out.split("rows computed ")[1].split(" (unlimited budget: ")
        assert computed[0] == computed[1].split(")")[0]  # rows computed = the unlimited budget's
        assert all(f"rank {r}: " in out for r in range(int(dp)))
        carry = float(out.split(f"DP {dp}: carry predicted step ")[1].split(" ms")[0].replace(",", ""))
        split = float(out.split(f"DP {dp}: split packing predicted step ")[1].split(" ms")[0].replace(",", ""))
        assert carry < split, out


def _exporters(rank):
    return {mb.carry.index for mb in rank if len(mb.carry.exported)}


def _check_kept_schedule(mbs, schedule) -> int:
    """Every backward reading a remote owner (run, restore, a kept graph's release) precedes that owner's gradient
    sync. Returns how many of them are releases."""
    grad_at = {t.owner: k for k, ts in schedule.syncs.items() for t in ts if t.kind == "grad"}
    releases = 0
    for r, items in enumerate(schedule.items):
        for k, (i, p) in enumerate(items):
            for o in (mbs[i].carry.reads_from if p in ("run", "restore", "release") else ()):
                if schedule.rank_of[o] != r:
                    assert k < grad_at[o], (r, k, i, p, o)
                    releases += p == "release"
    return releases


@pytest.mark.parametrize("cut", ["auto", "always"])
@pytest.mark.parametrize("dp", [2, 3, 4])
def test_kept_readers_release_before_their_owners_gradient_crosses(cut, dp):
    """With kept graphs a reader's backward runs at its release, after the group's later forwards and restores: the
    owner's gradient may cross only after it (else the sum misses that reader). Keep then only renames phases:
    the schedule equals the plain one with `with_keep` (what the trainer runs)."""
    for budget in (16, 32):
        mbs = pack(_grpo(seed=dp + budget), budget, carry=True)
        ranks = assign_carry_ranks(mbs, dp, cut=cut)
        keep = [_exporters([mbs[i] for i in idx]) for idx in ranks]
        kept = rank_schedule(mbs, ranks, keep=keep)
        plain = rank_schedule(mbs, ranks)
        for r in range(dp):
            plain = plain.with_keep(r, keep[r])
        assert kept.items == plain.items and kept.syncs == plain.syncs
        assert _check_kept_schedule(mbs, kept) or cut == "auto"  # "always" has kept readers of remote owners


def test_refined_assignment_lowers_the_most_loaded_rank_and_keeps_units_whole():
    """Largest-first puts 3 + 2 + 2 on one rank and 3 + 2 on the other; a swap gives 6 / 6 (the optimum)."""
    from types import SimpleNamespace

    free = [SimpleNamespace(carry=None, owned_rows=w) for w in (3, 3, 2, 2, 2)]
    load = lambda ranks: max(sum(free[i].owned_rows for i in r) for r in ranks)
    assert load(assign_carry_ranks(free, 2)) == 7 and load(assign_carry_ranks(free, 2, refine=True)) == 6
    for dp in (2, 3, 4):  # on carry groups: never worse, every microbatch once, every chain on one rank
        mbs = pack(_grpo(seed=dp, groups=3, completions=8), 16, carry=True)
        plain, refined = assign_carry_ranks(mbs, dp), assign_carry_ranks(mbs, dp, refine=True)
        assert sorted(i for r in refined for i in r) == list(range(len(mbs)))
        rows = lambda ranks: max(sum(mbs[i].owned_rows for i in r) for r in ranks)
        assert rows(refined) <= rows(plain)
        rank_of = {i: r for r, idx in enumerate(refined) for i in idx}
        for i, mb in enumerate(mbs):  # a chain link stays with the owner it alone reads (`_chains`)
            owners = mb.carry.reads_from
            if owners and sum(max(owners) in m.carry.reads_from for m in mbs) == 1:
                assert rank_of[i] == rank_of[max(owners)]
        _check_schedule(mbs, refined, rank_schedule(mbs, refined))


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_plan_prefers_an_even_split_at_the_same_predicted_step(dp):
    """long_8k_16x8k's shape (one prompt, 16 completions as long), scaled down, every graph kept: the fastest
    budget leaves the prompt's rank 1.17x (DP4) / 1.40x (DP8) the mean, since every other rank idles while the
    prompt runs; a finer budget spreads the prompt's chunks over the ranks at the same predicted step (within the
    roofline's resolution), and the plan takes it: slowest rank <= 1.10x the mean, every row once, below split,
    and a valid schedule (the old simulator sent the prompt's gradient before kept readers' releases)."""
    from megatron_tree.cp.planning.carry import CarryGeometry
    from megatron_tree.data.synthetic import make_preset
    from megatron_tree.tree import summarize

    samples = make_preset("long_8k_16x8k", scale=0.125)
    work = CarryWork(CarryGeometry("*" * 32, kv=(8, 128), act_bytes=2), hidden=4096, layers=32)
    kw = dict(choose_keep=_exporters, min_budget=128)
    plan = plan_carry_ranks(samples, 2048, dp, work, **kw)
    fastest = plan_carry_ranks(samples, 2048, dp, work, balance=float("inf"), **kw)  # the choice without balance
    assert plan.balance <= 1.10 and plan.times["step_ms"] <= fastest.times["step_ms"] * 1.005
    if dp > 2:  # the workload tells the rules apart
        assert fastest.balance > 1.10 and plan.budget < fastest.budget
    unlimited = summarize(pack(samples, 1 << 40))["tree_tokens"]
    assert sum(mb.owned_rows for mb in plan.microbatches) == unlimited == sum(
        mb.owned_rows for mb in fastest.microbatches)
    assert plan.times["step_ms"] < split_step_ms(pack(samples, 2048), dp, work)["step_ms"]
    _check_kept_schedule(plan.microbatches, plan.schedule)


def test_work_model_prices_split_packing_as_ranks_that_never_wait():
    mbs = pack(_grpo(), 96)
    work = CarryWork(geometry=None, hidden=64, layers=2)
    one, two = split_step_ms(mbs, 1, work), split_step_ms(mbs, 2, work)
    assert sum(two["rank_ms"]) == pytest.approx(one["step_ms"]) and two["step_ms"] < one["step_ms"]


def _store_body(pattern, keep):
    """DP 2, float64, every microbatch loose: the store each rank held item by item (state, accumulators; copies of
    the other rank's owners included) against `rank_store_timeline`, and the step's loss against whole trees."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_tree.cp.planning.carry_ranks import rank_store_timeline
    from megatron_tree.megatron.carry import carry_geometry, carry_rank_items
    from megatron_tree.training.megatron_init import init_megatron
    from megatron_tree.training.models import ModelArgs, build_model, forward_backward, make_config, report_totals
    from megatron_tree.training.models import wrap_ddp
    from megatron_tree.tree import padding_microbatch

    init_megatron(seed=7, kernels=True)
    torch.set_default_dtype(torch.float64)
    margs = ModelArgs(kind="hybrid", num_layers=len(pattern))
    margs.pattern = pattern
    config = make_config(margs, dtype=torch.float64)
    ddp = wrap_ddp(build_model(config, margs), config)
    samples = _grpo(seed=3, groups=1, prompt=14, completions=5, tail=10)
    mbs = pack(samples, 12, carry=True, pad_to_multiple_of=4)
    ranks = assign_carry_ranks(mbs, 2, cut="always")
    schedule = rank_schedule(mbs, ranks)
    rank = ps.get_data_parallel_rank()
    kept = {i for i in ranks[rank] if len(mbs[i].carry.exported)} if keep else None
    items = carry_rank_items(mbs, schedule, rank, padding_microbatch(12, num_rows=4), ps.get_data_parallel_group(),
                             keep=kept)
    tot = report_totals(forward_backward(ddp, items, loss_type="sft")).clone()
    dist.all_reduce(tot)
    geom = carry_geometry(ddp.module)
    # held as each carry item began (after its sync, before its releases): what the item before held at its end
    measured = [(b, a) for p, b, a in items[0].store.history if p > 0]
    timeline = rank_store_timeline(mbs, schedule.with_keep(rank, kept), rank, geom)
    predicted = [timeline[p - 1] for p, _, _ in items[0].store.history if p > 0]
    whole = report_totals(forward_backward(ddp, pack(samples, 1 << 20, pad_to_multiple_of=4)[rank::2] or
                                           [padding_microbatch(12, num_rows=4)], loss_type="sft")).clone()
    dist.all_reduce(whole)
    ps.destroy_model_parallel()
    torch.set_default_dtype(torch.float32)
    return measured, predicted, float(tot[0] / tot[1]), float(whole[0] / whole[1]), len(schedule.syncs)


@pytest.mark.parametrize("keep", [False, True])
def test_store_held_on_each_rank_is_the_planned_timeline(keep):
    from dist import run_distributed

    for measured, predicted, loss, whole, syncs in run_distributed(_store_body, 2, "MG*E", keep, timeout=600):
        assert syncs > 0 and max(b for b, _ in measured) > 0
        assert len(measured) == len(predicted) and measured == predicted, (measured, predicted)
        assert loss == pytest.approx(whole, rel=1e-12)
