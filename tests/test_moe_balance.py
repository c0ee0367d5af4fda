"""MoE load balancing on a tree against **stock** Megatron-Core ``GPTModel`` trained on the same samples flat.

Oracle: stock ``GPTModel`` (stock local spec, stock ``TopKRouter``, nothing of ours installed) run on
the microbatch's samples as one flat batch ``[B, L]`` (equal lengths: no padding, so stock's own
statistics count exactly the flat tokens; ordinary causal attention), in float64 with the router in
float64 (``moe_router_dtype="fp64"``). The tree model (`TreeGPTModel`, same weights) runs the same
samples as one prefix tree (180 flat tokens on 90 rows), its routers weighing each row by the number of
samples through it (`megatron.moe_balance`). Compared: the per-occurrence log-probs, every parameter
gradient of one weighted sum of them (the attached aux / z-loss gradients included:
``calculate_per_token_loss``, multiplier = the flat token count), the expert-bias counts
(``local_tokens_per_expert``) and global aux loss's running tokens per expert, and the logged
balancing losses. Stock scores routes in float32 whatever the dtype (``topk_routing_with_score_function``:
softmax and sigmoid alike); both models here score them at float64 (`router_precision.widen_router_scores`,
stock's own code with its float32 casts widened), so everything agrees to float64 rounding (<= 1e-12; with
stock's float32 scoring the floor was ~3e-8, float32 rounding of last-bit logit differences), the expert
counts exactly. The planted fault moves the gradients by more than 1e-3.
Planted fault: every row weighs 1 (the deduplicated statistics of before) must fail.
"""
from __future__ import annotations

import pytest
import torch

try:
    from dist import init_megatron, run_distributed
except ImportError:  # run from the repository root as tests.*
    from tests.dist import init_megatron, run_distributed

V = 64
# name -> (TransformerConfig balancing fields, tolerance: float64 rounding, see the docstring)
CASES = {
    "aux_z_softmax": (dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-1,
                           moe_z_loss_coeff=1e-2), 1e-12),
    "aux_z_sigmoid_bias": (dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-1,
                                moe_z_loss_coeff=1e-2, moe_router_score_function="sigmoid",
                                moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3), 1e-12),
    "global_aux_sigmoid": (dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1e-1,
                                moe_router_score_function="sigmoid"), 1e-12),
    "seq_aux_z": (dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-1,
                       moe_z_loss_coeff=1e-2, moe_router_score_function="sigmoid"), None),
    # DeepSeek-V3's per-sample seq aux loss (set_seq_aux_per_sample): stock's on a [B, L] batch is exactly that
    "seq_aux_per_sample": (dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-1,
                                moe_z_loss_coeff=1e-2), 1e-12),
}


def _samples():
    """Two GRPO groups of equal-length samples (18 tokens): a 12-token prompt with 6 completions (two
    pairs share 2 more tokens) and an 8-token prompt with 4 completions. 180 flat tokens."""
    g = torch.Generator().manual_seed(7)
    rnd = lambda n: torch.randint(1, V, (n,), generator=g).tolist()
    out = []
    p1, p2 = rnd(12), rnd(8)
    fork = rnd(2)
    for j in range(6):
        out.append(p1 + (fork + rnd(4) if j < 4 else rnd(6)))
    for _ in range(4):
        out.append(p2 + rnd(10))
    return out


def _stock_batch_logprobs(stock, samples) -> dict:
    x = torch.tensor(samples, dtype=torch.long)
    logits = stock(x, torch.arange(x.shape[1]).expand_as(x), None)  # [B, L, V]
    lp = torch.log_softmax(logits.double(), dim=-1)
    return {(i, t): lp[i, t - 1, samples[i][t]] for i in range(len(samples)) for t in range(1, len(samples[i]))}


def _tracker_values() -> dict:
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "get_moe_layer_wise_logging_tracker"):
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    else:  # 0.19: the metrics tracker
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        tracker = get_moe_metrics_tracker().metrics if hasattr(get_moe_metrics_tracker(), "metrics") else {}
    out = {}
    for name, entry in dict(tracker).items():
        vals = entry["values"] if isinstance(entry, dict) else getattr(entry, "values", None)
        if vals is not None:
            out[name] = vals.detach().clone()
            vals.zero_()
    return out


def _routers(model):
    return [layer.mlp.router for layer in model.decoder.layers]


def _case(name, fault=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_tree.megatron import moe_balance
    from megatron_tree.megatron.model import TreeGPTModel
    from megatron_tree.megatron.specs import get_tree_gpt_decoder_block_spec
    from megatron_tree.training.models import ModelArgs, make_config
    from megatron_tree.tree import Sample, pack
    from per_sample import coef, randomize, tree_logprobs  # tests/per_sample.py

    fields, _ = CASES[name]
    cfg = make_config(ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=48, vocab_size=V, num_experts=4, moe_ffn_hidden_size=16,
                                extra=dict(fields)), dtype=torch.float64)
    stock = GPTModel(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm"),
                     V, 64, position_embedding_type="rope")
    tree = TreeGPTModel(cfg, get_tree_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                                             normalization="RMSNorm"), V, 64,
                        position_embedding_type="rope")
    randomize(stock, seed=sum(map(ord, name)))
    for router in _routers(stock):  # a non-zero expert bias steers the sigmoid routing
        if router.expert_bias is not None:
            router.expert_bias.copy_(torch.linspace(-0.05, 0.05, 4))
    tree.load_state_dict(stock.state_dict(), strict=True)
    if name.endswith("per_sample"):
        moe_balance.set_seq_aux_per_sample(tree)
    samples = _samples()
    mbs = pack([Sample(tokens=s) for s in samples], 256)
    assert len(mbs) == 1
    moe_balance._FAULT = fault
    res = {"installed": len(getattr(tree, "_tree_moe_balancing", [])),
           "stock_installed": getattr(stock, "_tree_moe_balancing", None),
           "rows": mbs[0].num_rows, "flat": sum(len(s) for s in samples)}
    stock.train()
    tree.train()
    _tracker_values()
    try:
        ref = _stock_batch_logprobs(stock, samples)
        stock_logged = _tracker_values()  # recorded as each forward runs
        got = tree_logprobs(tree, mbs)
        tree_logged = _tracker_values()
        keys = sorted(ref)
        assert sorted(got) == keys
        sum(coef(*k) * ref[k] for k in keys).backward()
        sum(coef(*k) * got[k] for k in keys).backward()
    finally:
        moe_balance._FAULT = None
    res["lp"] = (torch.stack([got[k] for k in keys]).detach(), torch.stack([ref[k] for k in keys]).detach())
    sg, tg = dict(stock.named_parameters()), dict(tree.named_parameters())
    res["grads"] = {n: (tg[n].grad.clone(), sg[n].grad.clone()) for n in sorted(sg)}
    res["counts"] = [(t.local_tokens_per_expert.clone(), s.local_tokens_per_expert.clone())
                     for t, s in zip(_routers(tree), _routers(stock)) if s.local_tokens_per_expert is not None]
    res["global_tpe"] = [(t.global_tokens_per_expert.clone(), s.global_tokens_per_expert.clone())
                         for t, s in zip(_routers(tree), _routers(stock)) if s.global_tokens_per_expert is not None]
    res["logged"] = {k: (tree_logged.get(k), v) for k, v in stock_logged.items()}
    return res


def _body():
    import traceback

    from megatron_tree.megatron.router_precision import widen_router_scores

    init_megatron()
    torch.set_default_dtype(torch.float64)
    widen_router_scores(True)
    out = {}
    for name in CASES:
        try:
            out[name] = _case(name)
        except Exception:  # noqa: BLE001 - reported by the test of that case
            out[name] = traceback.format_exc()
    out["fault"] = _case("aux_z_sigmoid_bias", fault="multiplicity_ones")
    return out


@pytest.fixture(scope="module")
def oracle():
    return run_distributed(_body, 1, timeout=600)[0]


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _stock_seq_aux_counts_the_batch() -> bool:
    """megatron-core 0.19 multiplies the per-token seq aux loss by the microbatch's tokens (``local_num_tokens
    * bsz``); 0.16.1 by one sequence's (its gradient is 1/B of the loss it logs: a stock bug 0.19 fixed). The
    tree multiplies by the microbatch's flat tokens on both stacks."""
    import inspect

    from megatron.core.transformer.moe.router import TopKRouter

    return "local_num_tokens * bsz" in inspect.getsource(TopKRouter._apply_seq_aux_loss)


def _worst_grad(res):
    return max(_rel(t, s) for t, s in res["grads"].values() if s.abs().max() > 0)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][1] is not None])
def test_tree_balancing_equals_stock_flat(oracle, name):
    res = oracle[name]
    assert isinstance(res, dict), res
    tol = CASES[name][1]
    if name == "seq_aux_per_sample" and not _stock_seq_aux_counts_the_batch():
        t, s = res["logged"]["seq_load_balancing_loss"]  # the value; its 0.16.1 gradient is stock's bug
        assert _rel(t, s) <= tol and _rel(*res["lp"]) <= tol
        return
    assert res["installed"] == 2 and res["stock_installed"] is None
    assert res["rows"] == 90 and res["flat"] == 180  # the tree really deduplicates
    lp_t, lp_s = res["lp"]
    assert _rel(lp_t, lp_s) <= tol
    assert _worst_grad(res) <= tol, {n: _rel(t, s) for n, (t, s) in res["grads"].items()}
    router_grads = [n for n in res["grads"] if "router" in n]
    assert router_grads and all(res["grads"][n][1].abs().max() > 0 for n in router_grads)
    for t, s in res["counts"] + res["global_tpe"]:
        assert torch.equal(t, s) and s.sum() > 0, (t, s)
    assert res["logged"] and all(t is not None for t, _ in res["logged"].values())
    for k, (t, s) in res["logged"].items():
        assert _rel(t, s) <= tol, (k, t, s)


def test_expert_bias_counts_are_flat_counts(oracle):
    res = oracle["aux_z_sigmoid_bias"]
    assert len(res["counts"]) == 2
    for t, _ in res["counts"]:  # top-2 of every flat token: 2 x 180 per layer
        assert float(t.sum()) == 2 * res["flat"]


def test_global_aux_running_counts_are_flat(oracle):
    res = oracle["global_aux_sigmoid"]
    assert len(res["global_tpe"]) == 2
    for t, _ in res["global_tpe"]:
        assert float(t.sum()) == 2 * res["flat"]


def test_seq_aux_loss_default_is_the_packed_microbatchs_not_per_sample(oracle):
    """By default the tree's seq_aux_loss is stock's on the packed microbatch (one sequence: aux_loss's value;
    `verify` checks it against the flat pack), which differs from stock's on a [B, L] batch (per sample):
    the per-sample case above is the option that equals that."""
    res = oracle["seq_aux_z"]
    assert isinstance(res, dict), res
    assert res["logged"]["seq_load_balancing_loss"][0] is not None
    assert _worst_grad(res) > 1e-3
    if _stock_seq_aux_counts_the_batch():
        assert _worst_grad(oracle["seq_aux_per_sample"]) <= 1e-12


def test_planted_fault_deduplicated_counts_fail(oracle):
    res = oracle["fault"]
    assert _worst_grad(res) > 1e-3
    assert any(not torch.equal(t, s) for t, s in res["counts"])


BALANCING = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-1, moe_z_loss_coeff=1e-2,
                 moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_router_bias_update_rate=1e-3)


def test_verify_balancing_against_the_flat_pack_and_its_planted_fault():
    """``megatron-tree verify`` with aux loss, z-loss and expert bias (every layer MoE, one SGD step with
    finalize_model_grads' expert-bias update) against the flat pack of each tree microbatch, one rank:
    GPT; GPT with 2 MTP depths (their MoE layers weigh the depth's positions, tail rows included); the
    hybrid ``MG*E`` with carry (z-loss and expert bias: sums over rows, exact under carry); 10 Adam steps;
    the per-sample seq aux loss; the planted ``multiplicity_ones`` (every row weighs 1) must fail."""
    from megatron_tree.training.verify import VerifyConfig, run_verify_many

    zb = {k: v for k, v in BALANCING.items() if k != "moe_aux_loss_coeff"}
    exact = dict(tolerance=1e-12)  # float64 rounding: verify scores routes at float64 on both sides
    cfgs = [VerifyConfig(model="gpt", balancing=dict(BALANCING), **exact),
            VerifyConfig(model="gpt", balancing=dict(BALANCING), mtp_num_layers=2, **exact),
            VerifyConfig(model="hybrid", pattern="MG*E", balancing=zb, carry=True, budget=32, **exact),
            VerifyConfig(model="gpt", balancing=dict(BALANCING), steps=10, optimizer="adam", tolerance=1e-10),
            VerifyConfig(model="gpt", balancing=dict(BALANCING, moe_router_load_balancing_type="seq_aux_loss"),
                         seq_aux_per_sample=True, **exact),
            VerifyConfig(model="gpt", balancing=dict(BALANCING), fault="multiplicity_ones")]
    *good, bad = run_verify_many(cfgs)
    for cfg, out in zip(cfgs, good):
        assert out["passed"], (cfg, out)
        assert out["expert_bias"] == 0.0 and out["grads"] <= cfg.tolerance, (cfg, out)
        assert out["tree_rows"] < out["flat_rows"]
    assert good[2]["carry_microbatches"] > 1
    assert not bad["passed"] and bad["grads"] > 1e-2


def test_verify_balancing_under_tp_sp_cp_and_ep():
    """The same against the flat pack on two ranks, exact to float64 rounding: the hybrid ``MG*E`` under
    TP2 + SP (each TP rank's slice of the weights), GPT under tree CP2 with global_aux_loss (its running
    counts over TP x DP x CP), GPT under EP2 x DP2 (padding microbatches weigh nothing: an all-padding
    microbatch's aux loss is 0, not NaN)."""
    from megatron_tree.training.verify import VerifyConfig, run_verify_many

    cfgs = [VerifyConfig(model="hybrid", pattern="MG*E", tp=2, sp=True, balancing=dict(BALANCING), tolerance=1e-12),
            VerifyConfig(model="gpt", cp=2, tolerance=1e-12,
                         balancing=dict(BALANCING, moe_router_load_balancing_type="global_aux_loss")),
            VerifyConfig(model="gpt", ep=2, dp=2, balancing=dict(BALANCING), tolerance=1e-12)]
    for cfg, out in zip(cfgs, run_verify_many(cfgs)):
        assert out["passed"] and out["expert_bias"] == 0.0 and out["grads"] <= 1e-12, (cfg, out)


def test_aux_losses_with_carry_are_refused_before_any_rank_starts():
    from megatron_tree.training.arguments import validate_tree_args
    from megatron_tree.training.trainer import build_train_parser, check_train_args

    args = build_train_parser().parse_args(["--synthetic-preset", "fixed_5k_16x100", "--train-iters", "1",
                                            "--num-experts", "4", "--moe-aux-loss-coeff", "1e-2", "--tree-carry",
                                            "--tree-max-tokens-per-mb", "64"])
    with pytest.raises(ValueError, match="--tree-carry with --moe-router-load-balancing-type aux_loss"):
        check_train_args(args, None)
    args.tree_carry = False  # z-loss and expert bias carry: only the aux loss is refused
    args.moe_aux_loss_coeff, args.moe_z_loss_coeff, args.tree_carry = 0.0, 1e-3, True
    check_train_args(args, None)
    import argparse

    with pytest.raises(ValueError, match="--tree-carry with --moe-router-load-balancing-type aux_loss"):
        validate_tree_args(argparse.Namespace(tree_packing=True, tree_carry=True, num_experts=4,
                                              tree_max_tokens_per_mb=64, moe_aux_loss_coeff=1e-2,
                                              moe_router_load_balancing_type="aux_loss"))


def _train_losses(tmp_path, runs: dict, *extra) -> dict:
    """{run: per-step losses} of ``megatron-tree train`` on one data file (4 GRPO-like groups of 4 samples
    sharing an 8-token prompt), a tiny GPT with every layer MoE and aux loss 0.1, z-loss 0.01 and expert
    bias (sigmoid routing); one microbatch of the step's 8 samples, 4 steps. ``runs``: {name: its flags};
    ``extra``: flags of every run."""
    import json

    import numpy as np

    from megatron_tree import cli

    rng = np.random.default_rng(5)
    data = tmp_path / "records.jsonl"
    with open(data, "w") as f:
        for _ in range(4):
            prompt = rng.integers(1, 64, 8).tolist()
            for _ in range(4):
                f.write(json.dumps({"tokens": prompt + rng.integers(1, 64, 5).tolist()}) + "\n")
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "64",
             "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff", "0.1",
             "--moe-z-loss-coeff", "0.01", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
             "--tree-data-path", str(data), "--tree-global-batch-samples", "8", "--tree-max-tokens-per-mb", "128",
             "--train-iters", "4", "--lr", "0.01", "--quiet", *extra]
    losses = {}
    for name, run_flags in runs.items():
        out = tmp_path / f"{name}.json"
        assert cli.main(["train", *flags, *run_flags, "--metrics-json", str(out)]) == 0
        with open(out) as f:
            losses[name] = [h["loss"] for h in json.load(f)["history"]]
    return losses


def test_train_cli_balancing_on_trees_equals_flat_packing(tmp_path):
    """``megatron-tree train`` with Megatron-LM's balancing flags (aux loss, z-loss, expert bias with sigmoid
    routing), prefix trees against ``--packing flat``: one microbatch per step holding the step's 8 samples
    (the aux loss is a statistic of a microbatch), 4 steps of Adam, every step's loss equal to float32
    rounding."""
    losses = _train_losses(tmp_path, {"tree": ["--packing", "tree"], "flat": ["--packing", "flat"]},
                           "--moe-router-bias-update-rate", "0.01")
    assert len(losses["tree"]) == 4
    assert losses["tree"] == pytest.approx(losses["flat"], rel=1e-6), losses
    assert losses["tree"][3] != losses["tree"][0]


def test_settings_a_tree_cannot_make_exact_are_refused_by_name():
    from types import SimpleNamespace

    from megatron_tree.megatron.moe_balance import check_balancing_config

    base = dict(num_moe_experts=4, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
                moe_z_loss_coeff=None, moe_router_enable_expert_bias=False, moe_expert_capacity_factor=None,
                moe_router_fusion=False)
    check_balancing_config(SimpleNamespace(**base))
    for change, flag in ((dict(moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor"),
                         (dict(moe_router_fusion=True), "--moe-router-fusion"),
                         (dict(moe_router_load_balancing_type="sinkhorn", moe_z_loss_coeff=1e-3), "sinkhorn")):
        with pytest.raises(ValueError, match=flag):
            check_balancing_config(SimpleNamespace(**dict(base, **change)))
    # nothing to weigh: no refusal (capacity factors train as stock without balancing)
    check_balancing_config(SimpleNamespace(**dict(base, moe_aux_loss_coeff=0.0, moe_expert_capacity_factor=1.0)))


def test_train_cli_balancing_is_the_same_on_every_layout(tmp_path):
    """Aux loss, z-loss and expert bias through ``megatron-tree train``: one rank, TP2 + SP and tree CP2 train
    the same 4 steps (float32 rounding). Verify compares tree and flat on one layout; this compares layouts:
    each rank's attached loss is multiplied by the microbatch's flat tokens summed from the row weights
    (stock's ``valid_token_count`` under a mask is already the TP x CP group's, which doubled the aux
    gradient at TP2: 1.1e-5 here)."""
    losses = _train_losses(tmp_path, {"one": ["--nproc", "1"],
                                      "tp2sp": ["--nproc", "2", "--tensor-model-parallel-size", "2",
                                                "--sequence-parallel"],
                                      "cp2": ["--nproc", "2", "--context-parallel-size", "2"]},
                           "--optimizer", "sgd")
    assert len(losses["one"]) == 4 and losses["one"][3] != losses["one"][0]
    for name in ("tp2sp", "cp2"):
        assert losses[name] == pytest.approx(losses["one"], rel=1e-6), losses


@pytest.mark.parametrize("score_function,use_pre_softmax,bias", [("softmax", False, False), ("softmax", True, False),
                                                                 ("sigmoid", False, True)])
def test_widened_router_scores_are_stock_at_float64(score_function, use_pre_softmax, bias):
    """`widen_router_scores` runs stock's scoring at float64: its probabilities equal the score function
    computed here in float64 (an independent formula) to float64 rounding, where stock's own float32 scoring
    is ~1e-8 away; float32 logits and a switched-off widening run stock bitwise; the patches are undone."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe import router as router_module

    from megatron_tree.megatron.router_precision import widen_router_scores

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 8, generator=g, dtype=torch.float64)
    expert_bias = torch.linspace(-0.1, 0.1, 8, dtype=torch.float32) if bias else None
    kw = dict(use_pre_softmax=use_pre_softmax, score_function=score_function, expert_bias=expert_bias)
    stock = moe_utils.topk_routing_with_score_function
    try:
        widen_router_scores(True)
        widened = router_module.topk_routing_with_score_function
        probs, rmap = widened(logits, 2, **kw)
        probs32, rmap32 = widened(logits.float(), 2, **kw)
        _, aux_scores = router_module.compute_routing_scores_for_aux_loss(logits, 2, score_function)
    finally:
        widen_router_scores(False)
    assert moe_utils.torch is torch and "float" not in torch.Tensor.__dict__
    if score_function == "softmax":
        full = torch.softmax(logits, dim=-1)
        top = torch.topk(full, 2, dim=1).indices
        sel = full.gather(1, top)
        want_p = sel if use_pre_softmax else sel / sel.sum(-1, keepdim=True)
        want_aux = full
    else:
        full = torch.sigmoid(logits)
        top = torch.topk(full + expert_bias.double(), 2, dim=1).indices
        sel = full.gather(1, top)
        want_p = sel / sel.sum(-1, keepdim=True)
        want_aux = full / full.sum(-1, keepdim=True)
    want = torch.zeros_like(logits).scatter(1, top, want_p)
    assert torch.equal(rmap, want != 0)
    assert _rel(probs, want) < 1e-15 and _rel(aux_scores, want_aux) < 1e-15
    narrow, _ = stock(logits, 2, **kw)  # stock's float32 scoring of the same float64 logits
    assert _rel(narrow, want) > 1e-10
    p32, m32 = stock(logits.float(), 2, **kw)
    assert torch.equal(probs32, p32) and torch.equal(rmap32, m32)
    off, _ = router_module.topk_routing_with_score_function(logits, 2, **kw)  # installed, switched off
    assert torch.equal(off, narrow)


def test_widened_router_gating_keeps_float64_logits():
    """``moe_router_dtype="fp32"`` (Bridge's DeepSeek-V3 provider) gates float64 input in float32; widened,
    the logits are float64 (``x @ W^T`` to float64 rounding); switched off, stock's float32 again."""
    from megatron.core.transformer.moe import router as router_module

    from megatron_tree.cpu import megatron_core as cpu_layer
    from megatron_tree.megatron.router_precision import widen_router_scores

    cpu_layer.enable()  # megatron-core 0.16.1 names te_general_gemm only when TE imports
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(16, 8, generator=g, dtype=torch.float64), torch.randn(4, 8, generator=g, dtype=torch.float64)
    want = x @ w.T
    try:
        widen_router_scores(True)
        wide = router_module.router_gating_linear(x, w, None, torch.float32)
    finally:
        widen_router_scores(False)
    assert wide.dtype == torch.float64 and _rel(wide, want) < 1e-15
    narrow = router_module.router_gating_linear(x, w, None, torch.float32)  # installed, switched off
    assert narrow.dtype == torch.float32 and _rel(narrow.double(), want) > 1e-10


def _rl_body():
    """`megatron_tree.rl` with balancing on (aux loss, z-loss, sigmoid expert bias): the same rollouts as
    one prefix-tree microbatch and as one flat microbatch (``share_prefixes=False``), each through
    ``rl.forward_backward`` (GRPO) on a DDP-wrapped TreeGPTModel from the same weights, then
    ``finalize_model_grads`` (the expert-bias update counts). Float64, route scores widened."""
    from megatron_tree import rl
    from megatron_tree.megatron import moe_balance
    from megatron_tree.megatron.model import TreeGPTModel
    from megatron_tree.megatron.router_precision import widen_router_scores
    from megatron_tree.megatron.specs import get_tree_gpt_decoder_block_spec
    from megatron_tree.training.models import ModelArgs, make_config, wrap_ddp
    from per_sample import SAMPLES, randomize

    init_megatron()
    torch.set_default_dtype(torch.float64)
    widen_router_scores(True)
    margs = ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                      vocab_size=V, num_experts=4, moe_ffn_hidden_size=16, extra=dict(BALANCING))
    state = None
    out = {}
    g = torch.Generator().manual_seed(9)
    adv = [float(a) for a in torch.randn(len(SAMPLES), generator=g)]
    for name, share, fault in (("tree", True, None), ("flat", False, None), ("fault", True, "multiplicity_ones")):
        cfg = make_config(margs, dtype=torch.float64)  # one per model: DDP hangs hooks on it, experts copy it
        tree = TreeGPTModel(cfg, get_tree_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                                                 normalization="RMSNorm"),
                            vocab_size=V, max_sequence_length=64, position_embedding_type="rope")
        if state is None:
            randomize(tree, seed=21)
            state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in tree.state_dict().items()}
        tree.load_state_dict(state, strict=True)
        ddp = wrap_ddp(tree, tree.config)
        batch = rl.RolloutBatch.from_lists(SAMPLES, advantages=adv)
        mbs = rl.build_microbatches(batch, 256, share_prefixes=share, vocab_size=V)
        moe_balance._FAULT = fault
        try:
            ddp.zero_grad_buffer()
            rl.forward_backward(ddp, mbs, loss="grpo")
            tree.config.finalize_model_grads_func([ddp])
        finally:
            moe_balance._FAULT = None
        out[name] = {"rows": sum(mb.num_rows for mb in mbs.microbatches), "n": len(mbs.microbatches),
                     "grads": {n: p.main_grad.detach().clone() for n, p in tree.named_parameters()},
                     "bias": [layer.mlp.router.expert_bias.detach().clone() for layer in tree.decoder.layers]}
    return out


def test_rl_api_balancing_on_trees_equals_flat_packing():
    """The `rl` API path (build_microbatches + forward_backward, the loop RL frameworks call): GRPO with aux
    loss, z-loss and expert bias on one tree microbatch equals the same rollouts packed flat, every
    gradient (the attached balancing gradients included) and the expert-bias counts the update is made
    from, to float64 rounding; the planted multiplicity fault moves the router gradients."""
    res = run_distributed(_rl_body, 1, timeout=600)[0]
    tree, flat, fault = res["tree"], res["flat"], res["fault"]
    assert tree["n"] == flat["n"] == 1 and tree["rows"] < flat["rows"], (tree["rows"], flat["rows"])
    worst = {n: _rel(tree["grads"][n], g) for n, g in flat["grads"].items() if g.abs().max() > 0}
    assert max(worst.values()) <= 1e-12, worst
    routers = [n for n in flat["grads"] if "router" in n]
    assert routers and max(_rel(fault["grads"][n], flat["grads"][n]) for n in routers) > 1e-3
    for t, f in zip(tree["bias"], flat["bias"]):
        assert torch.equal(t, f)
