"""Value models (PPO critics) and reward models on a tree: `megatron.value_head` through `megatron_tree.rl`,
against **stock** Megatron-Core per rollout.

The rollouts of tests/test_rl.py (a GRPO group sharing more than its prompt, a duplicate, a rollout longer than
the budget, an unrelated one), each with per-token returns and old values. Oracle: stock ``GPTModel`` (float64,
the same weights) on each rollout alone, its final hidden states (the decoder's output) read through the same
head ``V = h . w + b`` at each target's source row, PPO's clipped value loss written out here, averaged over
every target of the batch, and its gradients (the transformer's, the head's; the LM head gets none).

The reward model (``loss="rm"``): the same head read at each rollout's last row (`RolloutBatch.reward_positions`),
Bradley-Terry over tests/test_rl_objectives.py's preference pairs (a pair's rollouts on different ranks or cut by
carry), and over ranked groups (every two rollouts of a group with different scores: 7 pairs from groups of 5 with
a tie and of 2), against stock's rewards per rollout.

The trainer's path (`train --tree-loss value|rm`: records with ``returns`` / ``old_values``, ``pair_id`` / ``chosen``
or ``group`` / ``score`` as JSONL keys, `training.objectives`, `megatron.loss.tree_loss_func`) against the same
oracle, DP 2 with carry at 8 rows.

One spawn of 2 gloo ranks: DP 2 with the API sharding the batch, carry at 8 rows (rollouts cut over
microbatches), then CP 2, then PP 2 (the head on the last stage, the values sent to both), then TP 2 with
sequence parallelism (the stock weights split over TP, the head
replicated: every rank's gradient shard compared); forward-only values equal stock's per rollout. A planted fault (each occurrence's
value read one row late) is caught.
"""
from __future__ import annotations

import dataclasses
import traceback

import numpy as np
import pytest
import torch

try:
    from dist import init_megatron, run_distributed
except ImportError:  # run from the repository root as tests.*
    from tests.dist import init_megatron, run_distributed

from test_rl import _grads, _rollouts, _stock_model, _tree_model
from test_rl_objectives import PAIRS, _pair_fields

GRAD = dict(rtol=1e-9, atol=1e-11)
VCLIP = 0.2


def rel_err(got: dict, want: dict) -> float:
    """Max over parameters of |got - want| / max(|want|, 1e-3 x the largest gradient): relative, except that a
    gradient far below the others' is measured against that floor (a reward bias under Bradley-Terry: zero in exact
    arithmetic, 3e-17 of rounding noise here, which would otherwise dominate). The pass criterion is allclose."""
    scale = 1e-3 * max(float(g.abs().max()) for g in want.values())
    return max(float((got[k] - g).abs().max()) / max(float(g.abs().max()), scale) for k, g in want.items())


def _value_fields():
    """Per rollout: returns and old values, one per token, spread so that the clip binds on some targets."""
    toks, masks, *_ = _rollouts()
    rng = np.random.default_rng(3)
    returns = [rng.normal(0.0, 1.0, len(t)) for t in toks]
    old = [rng.normal(0.0, 0.3, len(t)) for t in toks]
    return toks, masks, returns, old


def _head_state(hidden: int) -> dict:
    g = torch.Generator().manual_seed(9)
    return {"value_head.weight": torch.randn(hidden, generator=g, dtype=torch.float64) / hidden ** 0.5,
            "value_head.bias": torch.tensor([0.3], dtype=torch.float64)}


def _oracle():
    """Stock per rollout: values at the targets' source rows, the clipped value loss's gradients."""
    toks, masks, returns, old = _value_fields()
    stock = _stock_model()
    state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in stock.state_dict().items()}
    head = {k: v.clone().requires_grad_(True) for k, v in _head_state(stock.config.hidden_size).items()}
    seen = {}
    stock.decoder.register_forward_hook(lambda mod, args, out: seen.__setitem__("h", out))
    stock.zero_grad()
    losses, values, clipped, n = [], [], 0, 0
    for t, m, r, o in zip(toks, masks, returns, old):
        x = torch.tensor(t)
        stock(x[None], torch.arange(len(x))[None], None)
        pos = torch.tensor(np.flatnonzero(m))
        v = seen["h"][pos - 1, 0] @ head["value_head.weight"] + head["value_head.bias"]
        rr, oo = torch.tensor(r)[pos], torch.tensor(o)[pos]
        unclipped = (v - rr) ** 2
        clip = (oo + torch.clamp(v - oo, -VCLIP, VCLIP) - rr) ** 2
        clipped += int((clip > unclipped).sum())
        losses.append(0.5 * torch.maximum(unclipped, clip))
        values.append(v.detach().numpy().copy())
        n += len(pos)
    (torch.cat(losses).sum() / n).backward()
    grads = {k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for k, p in stock.named_parameters()}
    grads.update({k: p.grad.clone() for k, p in head.items()})
    state.update({k: v.detach().clone() for k, v in head.items()})
    return {"state": state, "grads": grads, "values": values, "clipped": clipped, "rm": _rm_oracle(stock, head),
            "rm_groups": _rm_oracle(stock, head, groups=True)}


# ranked groups over all seven rollouts: the five sharing a prompt (one tie: rollout 4 repeats rollout 1 and scores
# the same) and the two unrelated ones
GROUPS, SCORES = [0, 0, 0, 0, 0, 1, 1], [0.3, 1.2, -0.5, 2.0, 1.2, 0.1, -0.4]


def _rm_oracle(stock, head, groups: bool = False) -> dict:
    """Stock per rollout as a reward model: each rollout's reward at its last row, Bradley-Terry over
    tests/test_rl_objectives.py's pairs (first six rollouts), or (``groups``) over every two rollouts of a ranked
    group with different scores, the mean over pairs; its gradients."""
    toks, *_ = _value_fields()
    if groups:
        pairs = [(i, j) for i in range(len(toks)) for j in range(len(toks))
                 if GROUPS[i] == GROUPS[j] and SCORES[i] > SCORES[j]]
    else:
        toks, pairs = toks[:6], PAIRS
    seen = {}
    hook = stock.decoder.register_forward_hook(lambda mod, args, out: seen.__setitem__("h", out))
    stock.zero_grad()
    for p in head.values():
        p.grad = None
    rewards = []
    for t in toks:
        x = torch.tensor(t)
        stock(x[None], torch.arange(len(x))[None], None)
        rewards.append(seen["h"][len(t) - 1, 0] @ head["value_head.weight"] + head["value_head.bias"][0])
    hook.remove()
    loss = torch.stack([-torch.nn.functional.logsigmoid(rewards[c] - rewards[r]) for c, r in pairs]).mean()
    loss.backward()
    grads = {k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for k, p in stock.named_parameters()}
    grads.update({k: p.grad.clone() for k, p in head.items()})
    return {"grads": grads, "values": [np.array([float(r)]) for r in rewards]}


def pp2_stage_names(oracle_keys, first: bool, last: bool) -> dict:
    """{this PP 2 stage's parameter name: the world-size-1 name} for test_rl's 2-layer GPT, one layer per stage
    (the stage's layer is its local layer 0; a value head on the last stage)."""
    keep = "decoder.layers.0." if first else "decoder.layers.1."
    return {k.replace(keep, "decoder.layers.0."): k for k in oracle_keys
            if k.startswith(keep) or (first and k.startswith("embedding."))
            or (last and k.startswith(("decoder.final_layernorm.", "output_layer.", "value_head.")))}


def _run(oracle, *, rank, dp, budget, carry=False, cp=1, fault=False, loss="value", pp=1):
    from megatron_tree import rl
    from megatron_tree.megatron.value_head import add_value_head
    from megatron_tree.training.models import wrap_ddp

    toks, masks, returns, old = _value_fields()
    state = {k: v for k, v in oracle["state"].items() if not k.startswith("value_head.")}
    tree, cfg = _tree_model(cp, state, pp=pp)
    add_value_head(tree)
    if getattr(tree, "value_head", None) is not None:  # (the last pipeline stage)
        tree.value_head.load_state_dict({k.removeprefix("value_head."): v for k, v in oracle["state"].items()
                                         if k.startswith("value_head.")})
    if fault:  # planted: each occurrence reads the value of the row after its source row
        from megatron_tree.megatron import value_head as vh

        def late(model, hidden, loss_map, _orig=vh.occurrence_values):
            rows = (loss_map.source_rows + 1).clamp(max=hidden.shape[0] - 1)
            return _orig(model, hidden, dataclasses.replace(loss_map, source_rows=rows))
        vh.occurrence_values, restore = late, vh.occurrence_values
    try:
        ddp = wrap_ddp(tree, cfg)
        if loss == "rm":
            ids, chosen = _pair_fields()
            batch = rl.RolloutBatch.from_lists(toks[:6], pair_ids=ids, chosen=chosen).reward_positions()
        elif loss == "rm_groups":
            batch = rl.RolloutBatch.from_lists(toks, group_ids=GROUPS, scores=SCORES).reward_positions()
        else:
            batch = rl.RolloutBatch.from_lists(toks, loss_mask=masks, returns=returns, old_values=old)
        mbs = rl.build_microbatches(batch, budget, dp_rank=rank if dp > 1 else 0, dp_size=dp, carry=carry)
        values = rl.forward_backward(ddp, mbs, forward_only=True).per_rollout("values")
        ddp.zero_grad_buffer()
        rl.forward_backward(ddp, mbs, loss="rm" if loss == "rm_groups" else loss,
                            **({"value_clip": VCLIP} if loss == "value" else {}))
    finally:
        if fault:
            vh.occurrence_values = restore
    got = _grads(ddp)
    want = oracle[loss]["grads"] if loss.startswith("rm") else oracle["grads"]
    if pp > 1:
        names = pp2_stage_names(want, tree.pre_process, tree.post_process)
        want = {local: want[full] for local, full in names.items()}
    if loss.startswith("rm"):
        oracle = oracle[loss]
    err = rel_err(got, want)
    ok = sorted(got) == sorted(want) and all(torch.allclose(got[k], g, **GRAD) for k, g in want.items())
    verr = max(float(np.abs(values[i] - oracle["values"][i]).max()) for i in mbs.rollout_ids.tolist())
    cut = sum(1 for mb in mbs.microbatches if mb.carry is not None and len(mb.carry.carried)) if carry else 0
    head = got.get("value_head.weight", got.get("decoder.layers.0.self_attention.linear_qkv.weight"))
    worst = max(want, key=lambda k: float((got[k] - want[k]).abs().max()) / max(float(want[k].abs().max()), 1e-300))
    return dict(ok=ok, err=err, worst=(worst, float(want[worst].abs().max())), value_err=verr, ids=mbs.rollout_ids.tolist(), cut=cut,
                head_grad=float(head.abs().max()))


def trainer_dp2_carry(samples, rank: int, budget: int = 8) -> list:
    """This DP rank's share of ``samples`` packed as `train --tree-carry` packs a step at ``budget`` rows (every
    record cut over microbatches, carry groups spread over 2 DP ranks)."""
    from megatron_tree.tree import pack
    from megatron_tree.tree.carry import assign_carry_groups

    mbs = pack(samples, budget, pad_to_multiple_of=8, carry=True)
    return [mbs[i] for i in assign_carry_groups(mbs, 2)[rank]]


def _run_trainer(oracle, *, rank, loss):
    """`train --tree-loss value|rm`'s path: records with their fields as JSONL keys (``Sample.meta``), checked and
    made into what trains by `training.objectives`, DP 2 with carry at 8 rows; the value loss through
    `tree_loss_func(token_fields=)` per occurrence, Bradley-Terry (pairs or ranked groups) through the trainer's stats
    pass (`pair_stats_pass`) and `tree_loss_func(pair_factors=)`."""
    from types import SimpleNamespace

    from megatron_tree.megatron.carry import carry_items
    from megatron_tree.megatron.value_head import add_value_head
    from megatron_tree.tree import Sample
    from megatron_tree.training.models import forward_backward, wrap_ddp
    from megatron_tree.training.objectives import check_loss_fields, objective_samples, pair_stats_pass, token_fields

    toks, masks, returns, old = _value_fields()
    name = "rm" if loss.startswith("rm") else "value"
    if loss == "value":
        records = [Sample(tokens=t, loss_mask=m, meta={"returns": r.tolist(), "old_values": o.tolist()})
                   for t, m, r, o in zip(toks, masks, returns, old)]
    elif loss == "rm":
        ids, chosen = _pair_fields()
        records = [Sample(tokens=t, meta={"pair_id": int(p), "chosen": bool(c)}) for t, p, c in zip(toks[:6], ids, chosen)]
    else:
        records = [Sample(tokens=t, group=g, meta={"score": sc}) for t, g, sc in zip(toks, GROUPS, SCORES)]
    clip = VCLIP if name == "value" else None
    check_loss_fields(name, records, value_clip=clip)
    samples = objective_samples(name, records)
    mine = trainer_dp2_carry(samples, rank)
    tree, cfg = _tree_model(1, {k: v for k, v in oracle["state"].items() if not k.startswith("value_head.")})
    add_value_head(tree)
    tree.value_head.load_state_dict({k.removeprefix("value_head."): v for k, v in oracle["state"].items()
                                     if k.startswith("value_head.")})
    ddp = wrap_ddp(tree, cfg)
    ddp.zero_grad_buffer()
    kw = dict(loss_type=name, return_entropy=True, token_fields=token_fields(name, samples), value_clip=clip)
    extra = {}
    if name == "rm":
        step = SimpleNamespace(microbatches=mine, sample_ids=tuple(range(len(samples))))
        args = SimpleNamespace(tree_carry=True, tree_loss="rm")
        extra["pair_factors"] = pair_stats_pass(ddp, step, carry_items(mine), args, kw, samples)
    forward_backward(ddp, carry_items(mine), **kw, **extra)
    got = _grads(ddp)
    want = oracle[loss]["grads"] if name == "rm" else oracle["grads"]
    ok = sorted(got) == sorted(want) and all(torch.allclose(got[k], g, **GRAD) for k, g in want.items())
    cut = sum(1 for mb in mine if mb.carry is not None and len(mb.carry.carried))
    return dict(ok=ok, err=rel_err(got, want), value_err=0.0, ids=sorted(i for mb in mine for i in mb.sample_ids),
                cut=cut, head_grad=float(got["value_head.weight"].abs().max()))


def tp2_sp_model(state: dict, value_head: bool = False):
    """(model, config, mine) under TP 2 with sequence parallelism (the world's two ranks): test_rl's GPT with the
    world-size-1 weights ``state`` split over TP (no gated MLP: every split parameter is a plain chunk on its
    partition dim; a value head replicated); ``mine(name, full)`` is this rank's part of a full tensor."""
    from megatron.core import parallel_state as ps

    from megatron_tree.megatron.model import TreeGPTModel
    from megatron_tree.megatron.specs import get_tree_gpt_decoder_block_spec
    from megatron_tree.megatron.value_head import add_value_head
    from megatron_tree.training.models import ModelArgs, make_config
    from test_rl import V

    cfg = make_config(ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=48, vocab_size=V), tp=2, sp=True, dtype=torch.float64)
    tree = TreeGPTModel(cfg, get_tree_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm"),
                        vocab_size=V, max_sequence_length=64, position_embedding_type="rope")
    if value_head:
        add_value_head(tree)
    rank = ps.get_tensor_model_parallel_rank()
    params = dict(tree.named_parameters())

    def mine(name, full):
        p = params[name]
        return full.chunk(2, dim=p.partition_dim)[rank] if getattr(p, "tensor_model_parallel", False) else full

    with torch.no_grad():
        for name, p in params.items():
            p.copy_(mine(name, state[name]))
    return tree, cfg, mine


def _run_tp2_sp(oracle):
    """TP 2 with sequence parallelism: values and every gradient (each rank's shard) equal stock's."""
    from megatron_tree import rl
    from megatron_tree.training.models import wrap_ddp

    toks, masks, returns, old = _value_fields()
    tree, cfg, mine = tp2_sp_model(oracle["state"], value_head=True)
    ddp = wrap_ddp(tree, cfg)
    batch = rl.RolloutBatch.from_lists(toks, loss_mask=masks, returns=returns, old_values=old)
    mbs = rl.build_microbatches(batch, 32)
    values = rl.forward_backward(ddp, mbs, forward_only=True).per_rollout("values")
    ddp.zero_grad_buffer()
    rl.forward_backward(ddp, mbs, loss="value", value_clip=VCLIP)
    got = _grads(ddp)
    want = {k: mine(k, g) for k, g in oracle["grads"].items()}
    err = rel_err(got, want)
    ok = sorted(got) == sorted(want) and all(torch.allclose(got[k], g, **GRAD) for k, g in want.items())
    verr = max(float(np.abs(values[i] - oracle["values"][i]).max()) for i in range(len(toks)))
    return dict(ok=ok, err=err, value_err=verr, ids=list(range(len(toks))), cut=0,
                head_grad=float(got["value_head.weight"].abs().max()))


def _body():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    init_megatron(tp=1, kernels=True)
    torch.set_default_dtype(torch.float64)
    rank = dist.get_rank()
    oracle = _oracle()
    res = {"clipped": oracle["clipped"]}
    for key, kw in (("dp2", dict(dp=2, budget=32)), ("carry", dict(dp=2, budget=8, carry=True)),
                    ("fault", dict(dp=2, budget=32, fault=True)), ("rm_dp2", dict(dp=2, budget=32, loss="rm")),
                    ("rm_carry", dict(dp=2, budget=8, carry=True, loss="rm")),
                    ("rm_groups_dp2", dict(dp=2, budget=32, loss="rm_groups")),
                    ("rm_groups_carry", dict(dp=2, budget=8, carry=True, loss="rm_groups"))):
        try:
            res[key] = _run(oracle, rank=rank, **kw)
        except Exception:  # noqa: BLE001 - reported by the test of that run
            res[key] = {"error": traceback.format_exc()}
    for loss in ("value", "rm", "rm_groups"):
        try:
            res[f"trainer/{loss}"] = _run_trainer(oracle, rank=rank, loss=loss)
        except Exception:  # noqa: BLE001
            res[f"trainer/{loss}"] = {"error": traceback.format_exc()}
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    for key, loss in (("cp2", "value"), ("rm_cp2", "rm")):
        try:
            res[key] = _run(oracle, rank=rank, dp=1, budget=32, cp=2, loss=loss)
        except Exception:  # noqa: BLE001
            res[key] = {"error": traceback.format_exc()}
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    for key, loss in (("pp2", "value"), ("rm_pp2", "rm")):
        try:
            res[key] = _run(oracle, rank=rank, dp=1, budget=32, pp=2, loss=loss)
        except Exception:  # noqa: BLE001
            res[key] = {"error": traceback.format_exc()}
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    try:
        res["tp2_sp"] = _run_tp2_sp(oracle)
    except Exception:  # noqa: BLE001
        res["tp2_sp"] = {"error": traceback.format_exc()}
    return res


@pytest.fixture(scope="module")
def results():
    return run_distributed(_body, 2, timeout=600)


def _get(results, rank, key):
    r = results[rank][key]
    if "error" in r:
        pytest.fail(f"{key} on rank {rank} raised:\n{r['error']}")
    return r


@pytest.mark.parametrize("key", ["dp2", "carry", "cp2", "tp2_sp", "pp2", "rm_dp2", "rm_carry", "rm_cp2", "rm_pp2",
                                 "rm_groups_dp2", "rm_groups_carry", "trainer/value", "trainer/rm",
                                 "trainer/rm_groups"])
@pytest.mark.parametrize("rank", [0, 1])
def test_value_model_gradients_and_values_equal_stock_per_rollout(results, key, rank):
    r = _get(results, rank, key)
    print(f"\nvalue model {key} rank {rank}: max rel grad error vs stock per rollout {r['err']:.1e}, max value "
          f"error {r['value_err']:.1e} {r.get('worst')}")
    assert r["ok"], r["err"]
    assert r["value_err"] < 1e-12 and r["head_grad"] > 1e-3, r
    if key in ("dp2", "carry", "rm_dp2", "rm_carry", "rm_groups_dp2", "rm_groups_carry") or key.startswith("trainer"):
        other = _get(results, 1 - rank, key)  # split over 2 DP ranks
        assert r["ids"] and other["ids"] and not set(r["ids"]) & set(other["ids"])
    if key.endswith("carry") or key.startswith("trainer"):
        assert r["cut"] + _get(results, 1 - rank, key)["cut"] > 0


def test_the_clip_binds_and_a_value_read_one_row_late_is_caught(results):
    assert results[0]["clipped"] > 0, results[0]["clipped"]
    for rank in (0, 1):
        r = _get(results, rank, "fault")
        assert not r["ok"] and r["err"] > 1e-3, r["err"]


def test_value_fields_are_checked():
    from megatron_tree import rl

    with pytest.raises(ValueError, match=r"rollout 1: returns needs one value per token \(3\)"):
        rl.RolloutBatch.from_lists([[1, 2, 3], [4, 5, 6]], returns=[[0.0, 1.0, 2.0], [1.0, 2.0]])
    with pytest.raises(ValueError, match="rollout 0: old_values is not finite at a target"):
        rl.RolloutBatch.from_lists([[1, 2, 3]], returns=[[0.0, 1.0, 2.0]], old_values=[[0.0, float("nan"), 1.0]])
