"""`megatron_tree.rl` against unpacked per-rollout computation with **stock** Megatron-Core.

Rollouts: a GRPO group (one prompt, completions that share more than the prompt), a completion that
appears twice, a rollout longer than the token budget (it runs alone, never truncated), an unrelated
one; per-rollout advantages, per-token old / reference log-probs, prompt tokens loss-masked.
Oracle: Megatron-Core's own ``GPTModel`` (local block spec, float64, the same weights) run on each
rollout alone; log-probs / entropies with plain torch; the GRPO per-token loss written out here
(``-min(r A, clip(r) A) + kl * k3 - c H``) and a REINFORCE ``loss_fn``; gradients of their mean over
every target of the global batch.

One spawn of 2 gloo ranks: (a) DP 2, the API sharding a global batch (`from_lists`), GRPO with KL
and entropy terms through DDP: every rank's per-rollout log-probs / entropies / per-token losses and
the DP-reduced gradients; (b) tree CP 2 on a padded batch (`from_padded`, left and right padding):
forward-only ``to_padded`` outputs, and a user ``loss_fn`` trained under CP; (c) PP 2, forward only:
the per-rollout outputs on both stages; (d) routing replay: a MoE model replaying per-rollout routes
(prefix routes that disagree) equals every rollout alone with its routes. Planted fault: outputs
mapped one column off (``rl.batch._FAULT``) must fail the comparison.
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

from per_sample import randomize  # tests/per_sample.py

V = 64
BUDGET = 32
F64 = dict(rtol=1e-10, atol=1e-10)
GRAD = dict(rtol=1e-9, atol=1e-11)
CLIP, KL, ENT = 0.2, 0.1, 0.05


def _rollouts():
    rng = np.random.default_rng(11)
    prompt = rng.integers(1, V, 8).tolist()
    stem = rng.integers(1, V, 3).tolist()
    toks = [prompt + stem + rng.integers(1, V, int(k)).tolist() for k in (4, 6, 2)]
    toks += [prompt + rng.integers(1, V, 5).tolist(), list(toks[1])]  # another branch; a duplicate
    toks += [rng.integers(1, V, 40).tolist()]  # longer than the budget
    toks += [rng.integers(1, V, 7).tolist()]
    masks = [[False] * 8 + [True] * (len(t) - 8) if t[:8] == prompt else [False] + [True] * (len(t) - 1)
             for t in toks]
    adv = rng.normal(size=len(toks))
    old = [rng.normal(-4.0, 0.5, len(t)) for t in toks]
    ref = [rng.normal(-4.0, 0.5, len(t)) for t in toks]
    return toks, masks, adv, old, ref


def _padded(toks, masks, old, ref):
    """The same rollouts in a [B, T] layout with left and right padding."""
    B, T = len(toks), max(len(t) for t in toks) + 4
    starts = [(3 * b) % (T - len(t) + 1) for b, t in enumerate(toks)]
    ids, am, lm = np.zeros((B, T), np.int64), np.zeros((B, T), bool), np.zeros((B, T), bool)
    o, r = np.zeros((B, T)), np.zeros((B, T))
    for b, (t, s) in enumerate(zip(toks, starts)):
        ids[b, s:s + len(t)], am[b, s:s + len(t)], lm[b, s:s + len(t)] = t, True, masks[b]
        o[b, s:s + len(t)], r[b, s:s + len(t)] = old[b], ref[b]
    return ids, am, lm, o, r, np.array(starts)


def _config(cp: int, pp: int = 1):
    from megatron_tree.training.models import ModelArgs, make_config

    return make_config(ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                 ffn_hidden_size=48, vocab_size=V), cp=cp, pp=pp, dtype=torch.float64)


def _stock_model():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    cfg = _config(1)
    stock = GPTModel(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm"),
                     vocab_size=V, max_sequence_length=64, position_embedding_type="rope")
    randomize(stock, seed=5)
    return stock


def _tree_model(cp: int, state_dict, pp: int = 1):
    from megatron.core import parallel_state as ps

    from megatron_tree.megatron.model import TreeGPTModel
    from megatron_tree.megatron.specs import get_tree_gpt_decoder_block_spec

    cfg = _config(cp, pp)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    tree = TreeGPTModel(cfg, get_tree_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                                             normalization="RMSNorm"),
                        vocab_size=V, max_sequence_length=64, position_embedding_type="rope",
                        pre_process=first, post_process=last)
    if pp > 1:  # 2 layers, one per stage: the stock layer of this stage is local layer 0
        keep = "decoder.layers.0." if first else "decoder.layers.1."
        state_dict = {k.replace(keep, "decoder.layers.0."): v for k, v in state_dict.items()
                      if k.startswith(keep) or (first and k.startswith("embedding."))
                      or (last and k.startswith(("decoder.final_layernorm.", "output_layer.")))}
    tree.load_state_dict(state_dict, strict=True)
    return tree, cfg


def _oracle():
    """Everything the stock model says (run while the parallel state is TP1 / CP1): its weights,
    per-rollout (positions, log-probs, entropies, GRPO per-token losses), and the gradients of the
    GRPO and REINFORCE means over all targets."""
    toks, masks, adv, old, ref = _rollouts()
    stock = _stock_model()
    out = {"state": {k: (v.clone() if torch.is_tensor(v) else v) for k, v in stock.state_dict().items()}}
    for loss in ("grpo", "reinforce"):
        stock.zero_grad()
        rows = _stock(stock, toks, masks)
        if loss == "grpo":
            per = [_grpo(lp, ent, float(adv[i]), torch.tensor(old[i])[pos], torch.tensor(ref[i])[pos])
                   for i, (pos, lp, ent) in enumerate(rows)]
            out["rows"] = [(pos, lp.detach(), ent.detach(), p.detach()) for (pos, lp, ent), p in zip(rows, per)]
        else:
            per = [-float(adv[i]) * lp for i, (pos, lp, ent) in enumerate(rows)]
        (torch.cat(per).sum() / sum(len(p) for p in per)).backward()
        out[loss] = {n: p.grad.clone() for n, p in stock.named_parameters()}
    return out


def _stock(stock, toks, masks):
    """Per rollout: (target positions, log-probs, entropies) of stock GPTModel on that rollout alone."""
    out = []
    for t, m in zip(toks, masks):
        x = torch.tensor(t)
        logits = stock(x[None], torch.arange(len(x))[None], None)[0].double()
        logp = torch.log_softmax(logits, -1)
        ent = -(torch.softmax(logits, -1) * logp).sum(-1)
        pos = torch.tensor(np.flatnonzero(m))
        out.append((pos, logp[pos - 1, x[pos]], ent[pos - 1]))
    return out


def _grpo(lp, ent, adv, old, ref):  # noqa: D103 - the per-token GRPO loss, written out
    r = torch.exp(lp - old)
    pg = -torch.minimum(r * adv, torch.clamp(r, 1 - CLIP, 1 + CLIP) * adv)
    d = ref - lp
    return pg + KL * (torch.exp(d) - d - 1) - ENT * ent


def _grads(model):
    out = {}
    for n, p in model.named_parameters():
        g = getattr(p, "main_grad", None)
        out[n.removeprefix("module.")] = (g if g is not None else p.grad).detach().clone()
    return out


def _part_dp(rank, oracle):
    import torch.distributed as dist

    from megatron_tree import rl
    from megatron_tree.training.models import wrap_ddp

    toks, masks, adv, old, ref = _rollouts()
    tree, cfg = _tree_model(1, oracle["state"])
    ddp = wrap_ddp(tree, cfg)
    batch = rl.RolloutBatch.from_lists(toks, loss_mask=masks, advantages=adv, old_logprobs=old, ref_logprobs=ref)
    mbs = rl.build_microbatches(batch, BUDGET, dp_rank=rank, dp_size=2)
    ddp.zero_grad_buffer()
    out = rl.forward_backward(ddp, mbs, loss="grpo", clip_eps=CLIP, kl_coef=KL, entropy_coef=ENT)
    tree_grads = _grads(ddp)
    res = dict(ids=mbs.rollout_ids.tolist(), n_mbs=len(mbs),
               grads={n: (tree_grads[n], g) for n, g in oracle["grpo"].items()})
    for name, k in (("logprobs", 1), ("entropy", 2), ("loss", 3)):
        got = out.per_rollout(name)
        res[name] = [(torch.as_tensor(got[i]), oracle["rows"][i][k]) for i in mbs.rollout_ids.tolist()]
    res["long_alone"] = [mb.sample_ids for mb in mbs.microbatches if 5 in mb.sample_ids]
    dist.barrier()
    return res


def _part_cp(oracle):
    from megatron_tree import rl
    from megatron_tree.rl import batch as rl_batch
    from megatron_tree.training.models import wrap_ddp

    toks, masks, adv, old, ref = _rollouts()
    ids, am, lm, o, r, starts = _padded(toks, masks, old, ref)
    tree, cfg = _tree_model(2, oracle["state"])
    padded = rl.RolloutBatch.from_padded(torch.as_tensor(ids), torch.as_tensor(am), loss_mask=torch.as_tensor(lm),
                                         advantages=torch.as_tensor(adv), old_logprobs=torch.as_tensor(o),
                                         ref_logprobs=torch.as_tensor(r))
    listed = rl.RolloutBatch.from_lists(toks, loss_mask=masks, advantages=adv, old_logprobs=old, ref_logprobs=ref)
    same = all(np.array_equal(a.tokens, b.tokens) and np.array_equal(a.target_mask(), b.target_mask())
               and np.allclose(a.old_logprobs[a.target_mask()], b.old_logprobs[b.target_mask()])
               and float(a.advantage) == float(b.advantage) for a, b in zip(padded.samples, listed.samples))
    exp_lp = torch.zeros(ids.shape, dtype=torch.float64)
    exp_ent = torch.zeros(ids.shape, dtype=torch.float64)
    for b, (pos, lp, ent, _) in enumerate(oracle["rows"]):
        exp_lp[b, starts[b] + pos], exp_ent[b, starts[b] + pos] = lp, ent

    mbs = rl.build_microbatches(padded, BUDGET)
    out = rl.forward_backward(tree, mbs, forward_only=True)
    res = dict(same_as_lists=same, lp=(out.to_padded("logprobs", dtype=torch.float64), exp_lp),
               ent=(out.to_padded("entropy", dtype=torch.float64), exp_ent),
               mask=(out.padded_mask(), torch.as_tensor(lm)))
    rl_batch._FAULT = "column_shift"
    try:
        res["fault"] = float((out.to_padded("logprobs", dtype=torch.float64) - exp_lp).abs().max())
    finally:
        rl_batch._FAULT = None

    # a user's loss function (REINFORCE with the per-rollout advantage) trained under CP 2
    ddp = wrap_ddp(tree, cfg)
    ddp.zero_grad_buffer()
    rl.forward_backward(ddp, mbs, loss_fn=lambda lp, ent, loss_map: -loss_map.advantages.to(lp) * lp)
    tree_grads = _grads(ddp)
    res["grads"] = {n: (tree_grads[n], g) for n, g in oracle["reinforce"].items()}
    return res


def _part_pp(oracle):
    """Forward only under PP 2: the outputs reach both stages."""
    from megatron_tree import rl

    toks, masks, adv, old, ref = _rollouts()
    tree, _ = _tree_model(1, oracle["state"], pp=2)
    batch = rl.RolloutBatch.from_lists(toks, loss_mask=masks)
    out = rl.forward_backward(tree, rl.build_microbatches(batch, BUDGET), forward_only=True)
    return {name: [(torch.as_tensor(g), oracle["rows"][i][k]) for i, g in enumerate(out.per_rollout(name))]
            for name, k in (("logprobs", 1), ("entropy", 2))}


def _part_replay():
    """Routing replay through the API (MoE model, random routes that differ between rollouts sharing a
    prompt): tree microbatches equal every rollout alone with its routes (flat), and a batch without
    routes is refused by the replaying model."""
    from megatron_tree import rl
    from megatron_tree.megatron.routing_replay import install_routing_replay
    from megatron_tree.megatron.specs import get_tree_gpt_decoder_block_spec
    from megatron_tree.megatron.model import TreeGPTModel
    from megatron_tree.training.models import ModelArgs, make_config

    cfg = make_config(ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=48, vocab_size=V, num_experts=4, moe_ffn_hidden_size=16,
                                extra=dict(moe_enable_routing_replay=True)), dtype=torch.float64)
    tree = TreeGPTModel(cfg, get_tree_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                                             normalization="RMSNorm"),
                        vocab_size=V, max_sequence_length=64, position_embedding_type="rope").to(torch.float64)
    randomize(tree, seed=9)
    install_routing_replay(tree)
    toks, masks, *_ = _rollouts()
    rng = np.random.default_rng(2)
    routes = [np.stack([np.stack([rng.permutation(4)[:2] for _ in range(2)]) for _ in t]) for t in toks]
    for i in (1, 2, 3):  # the group's prompt routed alike, except rollout 3 at one token
        routes[i][:8] = routes[0][:8]
    routes[3][5, 0] = (routes[3][5, 0] + 1) % 4
    routes[4] = routes[1].copy()  # the duplicate rollout: same tokens, same routes
    batch = rl.RolloutBatch.from_lists(toks, loss_mask=masks, routed_experts=routes)
    res = {}
    for name, share in (("tree", True), ("flat", False)):
        mbs = rl.build_microbatches(batch, BUDGET, share_prefixes=share)
        out = rl.forward_backward(tree, mbs, forward_only=True)
        res[name] = {k: [torch.as_tensor(v) for v in out.per_rollout(k)] for k in ("logprobs", "entropy")}
        res[name + "_rows"] = sum(mb.stats.tree_tokens for mb in mbs.microbatches)
    try:
        rl.forward_backward(tree, rl.build_microbatches(rl.RolloutBatch.from_lists(toks, loss_mask=masks), BUDGET),
                            forward_only=True)
        res["unrouted"] = None
    except ValueError as e:
        res["unrouted"] = str(e)
    return res


def _part_carry(rank, oracle, cut="never"):
    """``build_microbatches(..., carry=True)`` at a budget below the longest rollout and the shared
    trees, DP 2: every row once, chains on one rank (``cut`` "never"; "always": every microbatch loose, the
    carried state and its gradient crossing ranks), outputs and gradients equal unpacked stock."""
    import torch.distributed as dist

    from megatron_tree import rl
    from megatron_tree.training.models import wrap_ddp

    toks, masks, adv, old, ref = _rollouts()
    tree, cfg = _tree_model(1, oracle["state"])
    ddp = wrap_ddp(tree, cfg)
    batch = rl.RolloutBatch.from_lists(toks, loss_mask=masks, advantages=adv, old_logprobs=old, ref_logprobs=ref)
    mbs = rl.build_microbatches(batch, 8, dp_rank=rank, dp_size=2, carry=True, carry_cut=cut)
    ddp.zero_grad_buffer()
    out = rl.forward_backward(ddp, mbs, loss="grpo", clip_eps=CLIP, kl_coef=KL, entropy_coef=ENT)
    tree_grads = _grads(ddp)
    items = sum(1 + (mb.carry is not None and len(mb.carry.exported) > 0) for mb in mbs.microbatches)
    res = dict(ids=mbs.rollout_ids.tolist(), items=items, syncs=len(getattr(mbs.carry_schedule, "syncs", ())),
               owned=[mb.owned_rows for mb in mbs.microbatches],
               carried=sum(len(mb.carry.carried) for mb in mbs.microbatches if mb.carry is not None),
               grads={n: (tree_grads[n], g) for n, g in oracle["grpo"].items()})
    for name, k in (("logprobs", 1), ("entropy", 2), ("loss", 3)):
        got = out.per_rollout(name)
        res[name] = [(torch.as_tensor(got[i]), oracle["rows"][i][k]) for i in mbs.rollout_ids.tolist()]
    dist.barrier()
    return res


def _body():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    init_megatron(tp=1, kernels=True)
    torch.set_default_dtype(torch.float64)
    rank = dist.get_rank()
    oracle = _oracle()
    res = {}
    parts = (("dp", lambda: _part_dp(rank, oracle)), ("cp", lambda: _part_cp(oracle)), ("pp", lambda: _part_pp(oracle)),
             ("replay", _part_replay), ("carry", lambda: _part_carry(rank, oracle)),
             ("carry_cut", lambda: _part_carry(rank, oracle, "always")))
    for name, fn in parts:
        try:
            res[name] = fn()
        except Exception:  # noqa: BLE001 - reported by the tests of that part
            res[name] = {"error": traceback.format_exc()}
        ps.destroy_model_parallel()
        if name != parts[-1][0]:
            ps.initialize_model_parallel(context_parallel_size=2 if name == "dp" else 1,
                                         pipeline_model_parallel_size=2 if name == "cp" else 1)
            model_parallel_cuda_manual_seed(1234)
    return res


@pytest.fixture(scope="module")
def results():
    return run_distributed(_body, 2, timeout=300)


def _part(results, rank, name):
    r = results[rank][name]
    if "error" in r:
        pytest.fail(f"part {name} on rank {rank} raised:\n{r['error']}")
    return r


def test_dp_ranks_split_the_global_batch(results):
    a, b = _part(results, 0, "dp"), _part(results, 1, "dp")
    assert sorted(a["ids"] + b["ids"]) == list(range(7)) and not set(a["ids"]) & set(b["ids"])
    assert a["n_mbs"] == b["n_mbs"]  # the same microbatch count on every DP rank
    assert [ids for r in (a, b) for ids in r["long_alone"]] == [(5,)]  # the long rollout runs alone


@pytest.mark.parametrize("rank", [0, 1])
def test_per_rollout_outputs_equal_unpacked_stock(results, rank):
    r = _part(results, rank, "dp")
    for name in ("logprobs", "entropy", "loss"):
        for got, want in r[name]:
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, **F64)


@pytest.mark.parametrize("rank", [0, 1])
def test_dp_gradients_equal_unpacked_stock(results, rank):
    for n, (g_tree, g_stock) in _part(results, rank, "dp")["grads"].items():
        assert g_stock.abs().max() > 0, n
        torch.testing.assert_close(g_tree, g_stock, **GRAD, msg=lambda m: f"grad of {n}: {m}")


@pytest.mark.parametrize("rank", [0, 1])
def test_cp_padded_outputs_and_user_loss(results, rank):
    r = _part(results, rank, "cp")
    assert r["same_as_lists"]
    assert torch.equal(*r["mask"])  # values exactly at the loss-masked columns
    torch.testing.assert_close(*r["lp"], **F64)
    torch.testing.assert_close(*r["ent"], **F64)
    for n, (g_tree, g_stock) in r["grads"].items():
        torch.testing.assert_close(g_tree, g_stock, **GRAD, msg=lambda m: f"grad of {n}: {m}")


@pytest.mark.parametrize("rank", [0, 1])
def test_pp_outputs_reach_every_stage(results, rank):
    r = _part(results, rank, "pp")
    for name in ("logprobs", "entropy"):
        for got, want in r[name]:
            torch.testing.assert_close(got, want, **F64)


def test_routing_replay_through_the_api(results):
    r = _part(results, 0, "replay")
    for k in ("logprobs", "entropy"):
        for a, b in zip(r["tree"][k], r["flat"][k]):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert torch.equal(r["tree"]["logprobs"][1], r["tree"]["logprobs"][4])
    assert r["tree_rows"] < r["flat_rows"]
    assert r["unrouted"] is not None and "carry no routes" in r["unrouted"]


def test_planted_fault_column_shift_fails(results):
    assert _part(results, 0, "cp")["fault"] > 1e-3


def test_bad_rollouts_are_named():
    from megatron_tree import rl

    with pytest.raises(ValueError, match=r"rollout 1: attention_mask must mark one non-empty contiguous run"):
        rl.RolloutBatch.from_padded(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[1, 1, 1], [1, 0, 1]]))
    with pytest.raises(ValueError, match=r"rollout 0: loss_mask marks a padding column"):
        rl.RolloutBatch.from_padded(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 1]]),
                                    loss_mask=torch.tensor([[1, 0, 1]]))
    with pytest.raises(ValueError, match=r"rollout 1: loss_mask\[0\] is set"):
        rl.RolloutBatch.from_lists([[1, 2], [3, 4]], loss_mask=[[False, True], [True, True]])


@pytest.mark.parametrize("part", ["carry", "carry_cut"])
@pytest.mark.parametrize("rank", [0, 1])
def test_carry_outputs_and_gradients_equal_unpacked_stock(results, rank, part):
    a, b = _part(results, 0, part), _part(results, 1, part)
    assert sorted(a["ids"] + b["ids"]) == list(range(7))
    if part == "carry":
        assert a["items"] == b["items"] and a["syncs"] == b["syncs"] == 0
    else:  # the carried state crossed ranks
        assert a["syncs"] == b["syncs"] > 0
    assert max(a["owned"] + b["owned"]) <= 8 and a["carried"] + b["carried"] > 40  # the 40-token rollout is cut
    r = (a, b)[rank]
    for name in ("logprobs", "entropy", "loss"):
        for got, want in r[name]:
            torch.testing.assert_close(got, want, **F64)
    for n, (g_tree, g_stock) in r["grads"].items():
        torch.testing.assert_close(g_tree, g_stock, **GRAD, msg=lambda m: f"grad of {n}: {m}")
