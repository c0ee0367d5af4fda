"""Sequence-level objectives and loss aggregations of `megatron_tree.rl` against **stock** Megatron-Core per rollout.

The rollouts of tests/test_rl.py (a GRPO group sharing more than its prompt, a duplicate, a rollout longer
than the budget, an unrelated one). Oracle: stock ``GPTModel`` (float64, the same weights) on each rollout
alone, the objective written out here from its definition with autograd (GSPO's sequence ratio
``exp(mean(logp - old))`` clipped per rollout; DPO / IPO / SimPO from each pair's summed log-probs; the
aggregations as verl defines them), and its gradients.

One spawn of 2 gloo ranks: DP 2 with the API sharding the global batch, at a budget that packs whole
rollouts and under carry at a budget of 8 rows (rollouts, preference pairs included, cut over microbatches
and the pair's two rollouts on different ranks or not); then CP 2. Planted faults: a rollout's statistic
taken from part of its occurrences, and each chosen rollout paired with another pair's rejected one.
"""
from __future__ import annotations

import traceback

import numpy as np
import pytest
import torch

try:
    from dist import init_megatron, run_distributed
except ImportError:  # run from the repository root as tests.*
    from tests.dist import init_megatron, run_distributed

from test_rl import CLIP, ENT, KL, _grads, _rollouts, _stock, _stock_model, _tree_model

GRAD = dict(rtol=1e-9, atol=1e-11)
BETA, GAMMA, NORM = 0.5, 0.3, 50.0
# old log-probs of test_rl's rollouts shifted so that sequence ratios fall on both sides of the clip range
OLD_SHIFT = -1.2


def _rollouts_here():
    toks, masks, adv, old, ref = _rollouts()
    return toks, masks, adv, [o + OLD_SHIFT for o in old], ref
# preference pairs over the first six rollouts: (chosen, rejected); rollout 4 repeats rollout 1's tokens and
# rollout 5 is longer than the budget
PAIRS = ((0, 1), (3, 2), (4, 5))


def _pair_fields():
    ids, chosen = np.zeros(6, np.int64), np.zeros(6, bool)
    for p, (c, r) in enumerate(PAIRS):
        ids[[c, r]] = 10 + p
        chosen[c] = True
    return ids, chosen


def _objective(name, rows, adv, old, ref):
    """The step's loss from per-rollout (positions, log-probs, entropies) of the stock model, by definition."""
    sums = [lp.sum() for _, lp, _ in rows]
    counts = [len(lp) for _, lp, _ in rows]
    if name in ("dpo", "ipo", "simpo"):
        out = []
        for c, r in PAIRS:
            if name == "simpo":
                z = BETA * (sums[c] / counts[c] - sums[r] / counts[r]) - GAMMA
                out.append(-torch.nn.functional.logsigmoid(z))
                continue
            rc, rr = torch.tensor(ref[c])[rows[c][0]].sum(), torch.tensor(ref[r])[rows[r][0]].sum()
            h = (sums[c] - rc) - (sums[r] - rr)
            out.append(-torch.nn.functional.logsigmoid(BETA * h) if name == "dpo" else (h - 1 / (2 * BETA)) ** 2)
        return torch.stack(out).mean()
    kind, agg = name.split(":")
    per_rollout = []
    for i, (pos, lp, ent) in enumerate(rows):
        o, rf, a = torch.tensor(old[i])[pos], torch.tensor(ref[i])[pos], float(adv[i])
        d = rf - lp
        tok = KL * (torch.exp(d) - d - 1) - ENT * ent
        if kind == "gspo":  # one clipped ratio per rollout, its value on every target of the rollout
            s = torch.exp((lp - o).mean())
            _SEQ_RATIOS[i] = (float(s), a)
            seq = -torch.minimum(s * a, torch.clamp(s, 1 - CLIP, 1 + CLIP) * a)
            per_rollout.append(seq * torch.ones_like(lp) + tok)
        else:  # grpo
            r = torch.exp(lp - o)
            per_rollout.append(-torch.minimum(r * a, torch.clamp(r, 1 - CLIP, 1 + CLIP) * a) + tok)
    B, N = len(rows), sum(counts)
    if agg == "token-mean":
        return torch.cat(per_rollout).sum() / N
    if agg == "seq-mean-token-sum":
        return torch.stack([p.sum() for p in per_rollout]).mean()
    if agg == "seq-mean-token-mean":
        return torch.stack([p.mean() for p in per_rollout]).mean()
    return torch.stack([p.sum() for p in per_rollout]).sum() / (B * NORM)  # seq-mean-token-sum-norm


_SEQ_RATIOS: dict = {}

CASES = ("gspo:seq-mean-token-mean", "gspo:token-mean", "grpo:seq-mean-token-sum", "grpo:seq-mean-token-mean",
         "grpo:seq-mean-token-sum-norm", "dpo", "ipo", "simpo")


def _oracle():
    toks, masks, adv, old, ref = _rollouts_here()
    stock = _stock_model()
    out = {"state": {k: (v.clone() if torch.is_tensor(v) else v) for k, v in stock.state_dict().items()},
           "seq_ratios": _SEQ_RATIOS}
    for name in CASES:
        n = 6 if name in ("dpo", "ipo", "simpo") else len(toks)
        stock.zero_grad()
        loss = _objective(name, _stock(stock, toks[:n], masks[:n]), adv, old, ref)
        loss.backward()
        out[name] = {k: p.grad.clone() for k, p in stock.named_parameters()}
    return out


def _run(name, oracle, *, rank, dp, budget, carry=False, fault=None, cp=1):
    from megatron_tree import rl
    from megatron_tree.rl import objectives
    from megatron_tree.training.models import wrap_ddp

    toks, masks, adv, old, ref = _rollouts_here()
    pairs = name in ("dpo", "ipo", "simpo")
    n = 6 if pairs else len(toks)
    ids, chosen = _pair_fields() if pairs else (None, None)
    batch = rl.RolloutBatch.from_lists(toks[:n], loss_mask=masks[:n], advantages=adv[:n], old_logprobs=old[:n],
                                       ref_logprobs=ref[:n], pair_ids=ids, chosen=chosen)
    tree, cfg = _tree_model(cp, oracle["state"])
    ddp = wrap_ddp(tree, cfg)
    mbs = rl.build_microbatches(batch, budget, dp_rank=rank if dp > 1 else 0, dp_size=dp, carry=carry)
    ddp.zero_grad_buffer()
    if pairs:
        kw = dict(loss=name, beta=BETA, simpo_gamma=GAMMA)
    else:
        kind, agg = name.split(":")
        kw = dict(loss=kind, loss_agg=agg, loss_agg_norm=NORM if agg.endswith("-norm") else None, clip_eps=CLIP,
                  kl_coef=KL, entropy_coef=ENT)
    objectives._FAULT = fault
    try:
        rl.forward_backward(ddp, mbs, **kw)
    finally:
        objectives._FAULT = None
    got = _grads(ddp)
    err = max(float((got[k] - g).abs().max() / max(float(g.abs().max()), 1e-30)) for k, g in oracle[name].items())
    ok = all(torch.allclose(got[k], g, **GRAD) for k, g in oracle[name].items())
    cut = sum(1 for mb in mbs.microbatches if mb.carry is not None and len(mb.carry.carried)) if carry else 0
    return dict(ok=ok, err=err, ids=mbs.rollout_ids.tolist(), cut=cut)


def _run_trainer(oracle, *, rank, carry: bool, loss: str = "gspo"):
    """The trainer's two passes, DP 2: GSPO (`train --tree-loss gspo --loss-agg seq-mean-token-mean`: the data
    pipeline's exact per-sample weights, `training.objectives.gspo_stats_pass`, then the graded pass with each sample's
    ratio) or DPO (`train --tree-loss dpo`: records with pair_id / chosen, `training.objectives.pair_stats_pass`, then the
    graded pass with each sample's pair factors)."""
    from types import SimpleNamespace

    from megatron_tree.megatron.carry import carry_items
    from megatron_tree.tree import Sample, pack
    from megatron_tree.tree.carry import assign_carry_groups
    from megatron_tree.tree.loss_agg import with_loss_agg
    from megatron_tree.training.models import forward_backward, wrap_ddp
    from megatron_tree.training.objectives import check_loss_fields, gspo_stats_pass, pair_stats_pass

    toks, masks, adv, old, ref = _rollouts_here()
    if loss == "dpo":
        ids, chosen = _pair_fields()
        samples = [Sample(tokens=t, loss_mask=m, ref_logprobs=r, meta={"pair_id": int(p), "chosen": bool(c)})
                   for t, m, r, p, c in zip(toks[:6], masks[:6], ref[:6], ids, chosen)]
        check_loss_fields("dpo", samples)
    else:
        samples = with_loss_agg([Sample(tokens=t, loss_mask=m, advantage=float(a), old_logprobs=o, ref_logprobs=r)
                                 for t, m, a, o, r in zip(toks, masks, adv, old, ref)], "seq-mean-token-mean")
    if carry:
        mbs = pack(samples, 8, pad_to_multiple_of=8, carry=True)
        mine = [mbs[i] for i in assign_carry_groups(mbs, 2)[rank]]
    else:
        mine = pack(samples, 48, pad_to_multiple_of=8)[rank::2]
    tree, cfg = _tree_model(1, oracle["state"])
    ddp = wrap_ddp(tree, cfg)
    ddp.zero_grad_buffer()
    items = carry_items(mine) if carry else mine
    step = SimpleNamespace(microbatches=mine, sample_ids=tuple(range(len(samples))))
    if loss == "dpo":
        kw = dict(loss_type="dpo", return_entropy=True)
        args = SimpleNamespace(tree_carry=carry, tree_loss="dpo", tree_dpo_beta=BETA, tree_simpo_gamma=GAMMA)
        extra = {"pair_factors": pair_stats_pass(ddp, step, items, args, kw, samples)}
        name = "dpo"
    else:
        kw = dict(loss_type="gspo", clip_eps=CLIP, kl_coef=KL, entropy_coef=ENT, return_entropy=True)
        extra = {"sequence_ratios": gspo_stats_pass(ddp, step, items, SimpleNamespace(tree_carry=carry), kw)}
        name = "gspo:seq-mean-token-mean"
    forward_backward(ddp, carry_items(mine) if carry else mine, **extra, **kw)
    got = _grads(ddp)
    err = max(float((got[k] - g).abs().max() / max(float(g.abs().max()), 1e-30)) for k, g in oracle[name].items())
    ok = all(torch.allclose(got[k], g, **GRAD) for k, g in oracle[name].items())
    return dict(ok=ok, err=err, ids=sorted(i for mb in mine for i in mb.sample_ids), cut=0)


def _body():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    init_megatron(tp=1, kernels=True)
    torch.set_default_dtype(torch.float64)
    rank = dist.get_rank()
    oracle = _oracle()
    res = {"seq_ratios": dict(oracle["seq_ratios"])}
    runs = [(f"dp2/{c}", c, dict(dp=2, budget=32)) for c in CASES]
    runs += [(f"carry/{c}", c, dict(dp=2, budget=8, carry=True)) for c in ("gspo:seq-mean-token-mean", "dpo", "simpo",
                                                                         "grpo:seq-mean-token-mean")]
    runs += [("fault/one_microbatch", "gspo:seq-mean-token-mean", dict(dp=2, budget=8, carry=True,
                                                                      fault="one_microbatch")),
             ("fault/wrong_partner", "dpo", dict(dp=2, budget=32, fault="wrong_partner"))]
    for key, name, kw in runs:
        try:
            res[key] = _run(name, oracle, rank=rank, **kw)
        except Exception:  # noqa: BLE001 - reported by the test of that run
            res[key] = {"error": traceback.format_exc()}
    for key, carry, loss in (("trainer/gspo", False, "gspo"), ("trainer_carry/gspo", True, "gspo"),
                             ("trainer/dpo", False, "dpo"), ("trainer_carry/dpo", True, "dpo")):
        try:
            res[key] = _run_trainer(oracle, rank=rank, carry=carry, loss=loss)
        except Exception:  # noqa: BLE001
            res[key] = {"error": traceback.format_exc()}
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    for name in ("gspo:seq-mean-token-mean", "dpo"):
        try:
            res[f"cp2/{name}"] = _run(name, oracle, rank=rank, dp=1, budget=32, cp=2)
        except Exception:  # noqa: BLE001
            res[f"cp2/{name}"] = {"error": traceback.format_exc()}
    return res


@pytest.fixture(scope="module")
def results():
    return run_distributed(_body, 2, timeout=600)


def _get(results, rank, key):
    r = results[rank][key]
    if "error" in r:
        pytest.fail(f"{key} on rank {rank} raised:\n{r['error']}")
    return r


@pytest.mark.parametrize("key", [f"dp2/{c}" for c in CASES] + [
    f"carry/{c}" for c in ("gspo:seq-mean-token-mean", "dpo", "simpo", "grpo:seq-mean-token-mean")] + [
    "cp2/gspo:seq-mean-token-mean", "cp2/dpo", "trainer/gspo", "trainer_carry/gspo", "trainer/dpo",
    "trainer_carry/dpo"])
@pytest.mark.parametrize("rank", [0, 1])
def test_gradients_equal_stock_per_rollout(results, key, rank):
    r = _get(results, rank, key)
    print(f"\n{key} rank {rank}: max rel grad error vs stock per rollout {r['err']:.1e}")
    assert r["ok"], r["err"]
    if key.startswith("dp2/") or key.startswith("carry/"):  # the step's rollouts were split over the two ranks
        other = _get(results, 1 - rank, key)
        assert r["ids"] and other["ids"] and not set(r["ids"]) & set(other["ids"]), (r["ids"], other["ids"])
    if key.startswith("carry/"):  # some microbatch read rows carried from another: rollouts cut
        assert r["cut"] + _get(results, 1 - rank, key)["cut"] > 0


def test_gspo_clips_some_rollouts_and_not_others(results):
    """The GSPO cases exercise both branches: the clipped term (no gradient) for some rollouts, not for others."""
    ratio, adv = np.array(list(results[0]["seq_ratios"].values())).T
    clipped = np.clip(ratio, 1 - CLIP, 1 + CLIP) * adv < ratio * adv  # the min takes the clipped term: no gradient
    print(f"\nGSPO sequence ratios {np.round(ratio, 3).tolist()}, clipped {clipped.tolist()}")
    assert clipped.any() and not clipped.all(), (ratio, adv)


@pytest.mark.parametrize("key", ["fault/one_microbatch", "fault/wrong_partner"])
def test_planted_faults_are_caught(results, key):
    r = _get(results, 0, key)
    print(f"\n{key}: max rel grad error vs stock per rollout {r['err']:.1e}")
    assert not r["ok"] and r["err"] > 1e-3, r["err"]


def test_bad_pairs_are_named():
    from megatron_tree import rl

    toks = [[1, 2, 3], [1, 2, 4], [1, 5, 6]]
    with pytest.raises(ValueError, match=r"pair 7: rollout 0, rollout 1 \(chosen: \[True, True\]\)"):
        rl.RolloutBatch.from_lists(toks, pair_ids=[7, 7, 8], chosen=[True, True, False])
    with pytest.raises(ValueError, match=r"pair 8: rollout 2 \(chosen: \[False\]\)"):
        rl.RolloutBatch.from_lists(toks, pair_ids=[7, 7, 8], chosen=[True, False, False])
    with pytest.raises(ValueError, match="pair_ids and chosen go together"):
        rl.RolloutBatch.from_lists(toks, pair_ids=[7, 7, 8])
