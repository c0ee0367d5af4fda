"""The stock model families as tree models: MambaModel (Nemotron-H) and GPT with Gated DeltaNet
(Qwen3-Next).

Interop (one gloo rank, float64): Megatron-Core 0.16.1's own ``MambaModel`` / ``GPTModel`` built from
the stock structure with Megatron's local modules (`get_local_mamba_stack_spec`,
`get_local_transformer_block_with_experimental_attention_variant_spec`: Megatron builds these
families only with transformer-engine) is saved with ``dist_checkpointing`` and loaded into the tree
model (`TreeMambaModel` / `TreeGPTModel` with the tree specs) with no missing or unexpected key; on
an unbranched sample and on a forest that really branches, the tree model's per-occurrence log-probs
equal the stock model's logits-derived log-probs run on each sample alone (stock ``MambaMixer`` and
``GatedDeltaNet`` run through the CPU kernel stand-ins), and so do the gradients of a weighted sum of
them; a checkpoint saved by the tree model loads back into the stock model. The Qwen3-Next model has
Megatron's gated attention (``attention_output_gate``) and qk-norm and a MoE layer with a gated
shared expert.

Tree vs per-sample training (``megatron-tree verify --model mamba|qwen3next``) under TP2+SP, PP2,
EP2 and recomputation; the CLI's ``train --model-family mamba`` and ``--experimental-attention-variant``
paths; the Megatron-LM entry point.
"""
from __future__ import annotations

import argparse
import ast
import os
import runpy
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_tree.training.verify import run_verify_many
from verify_checks import verify_config as VerifyConfig  # tests/verify_checks.py: 4 families
from selection import run_selected  # tests/selection.py
from per_sample import coef, randomize, stock_logprobs, tree_logprobs  # tests/per_sample.py
from verify_checks import check_verify  # tests/verify_checks.py

try:
    from dist import init_megatron, run_distributed
except ImportError:  # run from the repository root as tests.*
    from tests.dist import init_megatron, run_distributed

ROOT = Path(__file__).resolve().parents[1]
V = 64
MAMBA_PATTERN = "M*-EM"
SAMPLES = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    [1, 2, 3, 4, 5, 9, 9, 9, 8, 7],  # fork at depth 5
    [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22],  # fork at depth 8
    [1, 2, 3, 4, 5, 6],  # prefix of sample 0
    [1, 30, 31],  # fork at depth 1
    [3, 3, 3, 1, 2, 5, 6, 7],  # second tree
    [1, 2, 3, 4, 5, 9, 9, 9, 8, 7],  # duplicate of sample 1
]
# Inside a float64 model the stock layers still round some quantities to fp32 where ours stay float64
# (MambaMixer: ``A_log.float()``, ``dt_bias.float()``; GatedDeltaNet: the decay from ``alpha.float()``,
# its output gate ``gate.float()``), and both sides keep the MoE router softmax and the
# attention output gate's sigmoid in fp32, whose backward rounds a shared tree row's summed gradient
# once where the per-sample runs round each part. Measured with O(1) weights (max abs): Mamba
# log-probs 6e-8, grads 2e-6 (router); Qwen3-Next log-probs 2e-6, grads 2e-5 (through four layers
# of fp32-rounded GDN and gates). A wrong tree computation moves both by O(0.1).
TOL = {"mamba": (dict(rtol=1e-6, atol=1e-6), dict(rtol=1e-5, atol=2e-5)),
       "qwen3next": (dict(rtol=1e-5, atol=1e-5), dict(rtol=1e-4, atol=1e-4))}


def _tree_logprobs(tree, samples):
    from megatron_tree.tree import Sample, pack


    mbs = pack([Sample(tokens=s) for s in samples], 256, pad_to_multiple_of=8)
    return tree_logprobs(tree, mbs), any(bool((mb.layout.segment_parent >= 0).any()) for mb in mbs)


def _build(family: str):
    """(stock, tree) of one family, float64, tree specs vs the stock structure (local modules)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.mamba import MambaModel

    from megatron_tree.megatron.family_specs import (
        get_local_mamba_stack_spec,
        get_local_transformer_block_with_experimental_attention_variant_spec,
        get_tree_mamba_stack_spec,
        get_tree_transformer_block_with_experimental_attention_variant_spec,
    )
    from megatron_tree.megatron.model import TreeGPTModel, TreeMambaModel
    from megatron_tree.training.models import ModelArgs, make_config

    if family == "mamba":
        cfg = make_config(ModelArgs(kind="mamba", pattern=MAMBA_PATTERN, vocab_size=V, num_experts=4,
                                    moe_ffn_hidden_size=16), dtype=torch.float64)
        kw = dict(vocab_size=V, max_sequence_length=64, hybrid_override_pattern=MAMBA_PATTERN,
                  position_embedding_type="rope")
        stock = MambaModel(cfg, get_local_mamba_stack_spec(), **kw)
        tree = TreeMambaModel(cfg, get_tree_mamba_stack_spec(use_transformer_engine=False), **kw)
    else:
        # 4 layers: GDN, gated attention, GDN, gated attention; MoE (gated shared expert) in layers 1 and 3
        cfg = make_config(ModelArgs(kind="qwen3next", num_layers=4, vocab_size=V, num_experts=4,
                                    moe_ffn_hidden_size=16, extra=dict(moe_layer_freq=2)), dtype=torch.float64)
        kw = dict(vocab_size=V, max_sequence_length=64, position_embedding_type="rope")
        stock = GPTModel(cfg, get_local_transformer_block_with_experimental_attention_variant_spec(cfg), **kw)
        tree = TreeGPTModel(cfg, get_tree_transformer_block_with_experimental_attention_variant_spec(
            cfg, use_transformer_engine=False), **kw)
    return stock.to(torch.float64), tree.to(torch.float64)


def _sharded_keys(model) -> list:
    return sorted(getattr(v, "key", k) for k, v in model.sharded_state_dict().items())


def _interop_body(ckpt_root: str) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    init_megatron(kernels=True)
    torch.set_default_dtype(torch.float64)  # Megatron's torch norms take the default dtype
    res = {}
    for family in ("mamba", "qwen3next"):
        r = res[family] = {}
        stock, tree = _build(family)
        randomize(stock, seed=len(family))
        r["layers"] = [(type(layer).__name__, type(getattr(layer, "mixer", getattr(layer, "self_attention", None))).__name__,
                        type(layer.mlp).__name__ if hasattr(layer, "mlp") else None) for layer in tree.decoder.layers]
        r["stock_keys"], r["tree_keys"] = _sharded_keys(stock), _sharded_keys(tree)

        # stock -> tree through a distributed checkpoint
        d = os.path.join(ckpt_root, family, "stock")
        os.makedirs(d)
        dist_checkpointing.save(stock.sharded_state_dict(), d)
        loaded, missing, unexpected = dist_checkpointing.load(tree.sharded_state_dict(), d,
                                                              strict=StrictHandling.RETURN_ALL)
        r["stock_to_tree"] = (sorted(missing), sorted(unexpected), tree.load_state_dict(loaded, strict=False))
        sp, tp_ = dict(stock.named_parameters()), dict(tree.named_parameters())
        r["params_equal"] = sorted(sp) == sorted(tp_) and all(torch.equal(sp[n], tp_[n]) for n in sp)

        # one unbranched sample, then a forest that branches: tree log-probs vs stock per sample
        ref1 = stock_logprobs(stock, SAMPLES[:1])
        got1, branched1 = _tree_logprobs(tree, SAMPLES[:1])
        r["chain"] = (branched1, torch.stack([got1[k] for k in sorted(ref1)]).detach(),
                      torch.stack([ref1[k] for k in sorted(ref1)]).detach())
        ref = stock_logprobs(stock, SAMPLES)
        got, branched = _tree_logprobs(tree, SAMPLES)
        keys = sorted(ref)
        r["forest"] = (branched, sorted(got) == keys, torch.stack([got[k] for k in keys]).detach(),
                       torch.stack([ref[k] for k in keys]).detach())
        stock.zero_grad()
        tree.zero_grad()
        sum(coef(*k) * ref[k] for k in keys).backward()
        sum(coef(*k) * got[k] for k in keys).backward()
        r["grads"] = {n: (tp_[n].grad.clone(), sp[n].grad.clone()) for n in sorted(sp) if sp[n].grad is not None}
        r["params_without_grad"] = sorted(n for n in sp if sp[n].grad is None)

        # tree -> stock: new weights on the tree side, saved by the tree model, loaded by a fresh stock one
        randomize(tree, seed=len(family) + 100)
        d = os.path.join(ckpt_root, family, "tree")
        os.makedirs(d)
        dist_checkpointing.save(tree.sharded_state_dict(), d)
        stock2, _ = _build(family)
        loaded, missing, unexpected = dist_checkpointing.load(stock2.sharded_state_dict(), d,
                                                              strict=StrictHandling.RETURN_ALL)
        r["tree_to_stock"] = (sorted(missing), sorted(unexpected), stock2.load_state_dict(loaded, strict=False))
        with torch.no_grad():
            ref2 = stock_logprobs(stock2, SAMPLES[:2])
            got2, _ = _tree_logprobs(tree, SAMPLES[:2])
        r["back"] = (torch.stack([got2[k] for k in sorted(ref2)]), torch.stack([ref2[k] for k in sorted(ref2)]))
    res["providers"] = _providers()
    res["te_mamba_spec"] = _te_mamba_spec()
    return res


def _te_mamba_spec() -> dict:
    """The TE path of `get_tree_mamba_stack_spec` as a spec (TE modules cannot be built on CPU; the
    spec imports, with TE's names as placeholders): our modules in the mixer / core-attention slots,
    every other submodule the stock one, and the stock ``mamba_stack_spec`` left untouched."""
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec as stock

    from megatron_tree.megatron.family_specs import get_tree_mamba_stack_spec

    tree = get_tree_mamba_stack_spec(use_transformer_engine=True)
    t, s = tree.submodules, stock.submodules
    tm, sm = t.mamba_layer.submodules.mixer, s.mamba_layer.submodules.mixer
    ta, sa = (x.attention_layer.submodules.self_attention.submodules for x in (t, s))
    return {"mixer": (tm.module.__name__, sm.module.__name__),
            "core": (ta.core_attention.__name__, sa.core_attention is not ta.core_attention),
            "same_linears": tm.submodules.in_proj is sm.submodules.in_proj and ta.linear_qkv is sa.linear_qkv,
            "same_other_layers": t.mlp_layer == s.mlp_layer and t.moe_layer == s.moe_layer}


@pytest.fixture(scope="module")
def interop(tmp_path_factory):
    return run_distributed(_interop_body, 1, str(tmp_path_factory.mktemp("ckpt")), timeout=300)[0]


@pytest.mark.parametrize("family", ["mamba", "qwen3next"])
def test_stock_structure_and_checkpoint_keys(interop, family):
    r = interop[family]
    assert r["stock_keys"] == r["tree_keys"]
    if family == "mamba":
        # MambaModel's layer kinds follow the pattern; our mixers and core attention are in the stock slots
        assert [k for k, _, _ in r["layers"]] == ["MambaLayer", "TransformerLayer", "MLPLayer", "MoETransformerLayer",
                                                  "MambaLayer"]
        assert r["layers"][0][1] == "TreeMambaMixer"
        # norms that TE fuses into the next linear are keyed as TE's (a TE checkpoint loads too)
        assert "decoder.layers.0.mixer.in_proj.layer_norm_weight" in r["tree_keys"]
        assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in r["tree_keys"]
        assert "decoder.layers.2.mlp.linear_fc1.layer_norm_weight" in r["tree_keys"]
        assert "decoder.final_norm.weight" in r["tree_keys"]
    else:
        assert [m for _, m, _ in r["layers"]] == ["TreeGatedDeltaNet", "SelfAttention"] * 2
        assert [m for _, _, m in r["layers"]] == ["MoELayer", "MLP"] * 2
        assert "decoder.layers.0.self_attention.in_proj.layer_norm_weight" in r["tree_keys"]
        assert "decoder.layers.0.mlp.shared_experts.gate_weight" in r["tree_keys"]
        assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in r["tree_keys"]


@pytest.mark.parametrize("family", ["mamba", "qwen3next"])
def test_stock_checkpoint_loads_into_the_tree_model_and_back(interop, family):
    r = interop[family]
    for direction in ("stock_to_tree", "tree_to_stock"):
        missing, unexpected, incompatible = r[direction]
        assert missing == [] and unexpected == [], direction
        assert list(incompatible.missing_keys) == [] and list(incompatible.unexpected_keys) == [], direction
    assert r["params_equal"]
    got, ref = r["back"]  # the stock model on the tree model's weights computes what the tree model did
    torch.testing.assert_close(got, ref, **TOL[family][0])


@pytest.mark.parametrize("family", ["mamba", "qwen3next"])
def test_tree_logprobs_equal_stock_logits(interop, family):
    r = interop[family]
    lp_tol, grad_tol = TOL[family]
    branched, got, ref = r["chain"]
    assert not branched
    torch.testing.assert_close(got, ref, **lp_tol)
    branched, same_keys, got, ref = r["forest"]
    assert branched and same_keys
    torch.testing.assert_close(got, ref, **lp_tol)
    assert not r["params_without_grad"]
    for name, (g_tree, g_stock) in r["grads"].items():
        torch.testing.assert_close(g_tree, g_stock, **grad_tol, msg=name)


# ---------------------------------------------------------------------------------------------- verify
# Every case runs in the main tier; the latest tier (conftest.py) runs the cases wrapped in both(): each family
# once per parallel flavour (one rank, TP2 + SP, PP2, DP2 x EP2) plus a planted fault each. The others repeat
# those paths with another loss, pattern, recomputation or fault.
LATEST: set = set()


def both(cfg: VerifyConfig) -> VerifyConfig:
    LATEST.add(id(cfg))
    return cfg


WS1 = [
    both(VerifyConfig(model="mamba", dtype="float64")),  # M * - E (MoE: router softmax in fp32)
    VerifyConfig(model="mamba", pattern="M*M-", dtype="float64", loss="grpo", recompute="selective"),
    both(VerifyConfig(model="qwen3next", dtype="float64")),
    VerifyConfig(model="qwen3next", dtype="float64", loss="grpo", recompute="full"),
    both(VerifyConfig(model="mamba", pattern="M*M-", fault="zero_state")),
    VerifyConfig(model="mamba", pattern="M*M-", fault="rope_physical"),
    both(VerifyConfig(model="qwen3next", fault="zero_state")),
    VerifyConfig(model="qwen3next", fault="sibling_mask"),
]
WS2 = [
    both(VerifyConfig(model="mamba", tp=2, sp=True, dtype="float64", loss="grpo")),
    both(VerifyConfig(model="mamba", pattern="M*M-", pp=2, dtype="float64", recompute="selective")),
    both(VerifyConfig(model="mamba", pattern="ME*E", dp=2, ep=2, dtype="float64")),
    both(VerifyConfig(model="qwen3next", tp=2, sp=True, dtype="float64")),
    both(VerifyConfig(model="qwen3next", pp=2, dtype="float64", loss="grpo", recompute="full")),
    VerifyConfig(model="qwen3next", dp=2, ep=2, dtype="float64", recompute="selective"),
    # `megatron-tree verify --model qwen3next --tp 2 --sp` as typed (float32): its tiny GDN decay gradients
    # once read 3.2e-2 against their own scale and failed (`verify.GRAD_SCALE_FLOOR`)
    VerifyConfig(model="qwen3next", tp=2, sp=True),
]


def _cases(configs: list) -> list:
    return [pytest.param(i, marks=[] if id(cfg) in LATEST else [pytest.mark.main_tier_only])
            for i, cfg in enumerate(configs)]


@pytest.fixture(scope="module")
def ws1(request):
    return run_selected(request, "test_verify_world_size_1", WS1, run_verify_many)


@pytest.fixture(scope="module")
def ws2(request):
    return run_selected(request, "test_verify_world_size_2", WS2, run_verify_many)


@pytest.mark.parametrize("i", _cases(WS1))
def test_verify_world_size_1(ws1, i):
    check_verify(WS1[i], ws1[i])


@pytest.mark.parametrize("i", _cases(WS2))
def test_verify_world_size_2(ws2, i):
    check_verify(WS2[i], ws2[i])


def test_family_configs_are_refused_with_reasons():
    from megatron_tree.training.models import ModelArgs, make_config

    with pytest.raises(ValueError, match="letters must be from"):
        make_config(ModelArgs(kind="mamba", pattern="MG*-"))
    with pytest.raises(ValueError, match="full-layer recomputation"):
        make_config(ModelArgs(kind="mamba"), recompute="full")


# ---------------------------------------------------------------------------------------------- entry points
def test_train_cli_family_flags_are_checked():
    from megatron_tree.training.trainer import build_train_parser, check_train_args

    base = ["--synthetic-preset", "fixed_5k_16x100", "--train-iters", "1", "--tree-max-tokens-per-mb", "64"]

    def errors(*extra):
        with pytest.raises(ValueError) as e:
            check_train_args(build_train_parser().parse_args(base + list(extra)))
        return str(e.value)

    assert "letters M*-E" in errors("--model-family", "mamba")
    assert "letters M*-E" in errors("--model-family", "mamba", "--hybrid-override-pattern", "MG*")
    assert "must equal" in errors("--model-family", "mamba", "--hybrid-override-pattern", "M*", "--num-layers", "3")
    assert "--linear-attention-freq N" in errors("--experimental-attention-variant", "gated_delta_net")
    assert "needs --experimental-attention-variant" in errors("--linear-attention-freq", "2")
    assert "selective" in errors("--model-family", "mamba", "--hybrid-override-pattern", "M*",
                                 "--recompute-granularity", "full")
    ok = check_train_args(build_train_parser().parse_args(
        base + ["--model-family", "mamba", "--hybrid-override-pattern", "M*-E"]))
    assert ok.num_layers == 4 and ok.tree_hybrid_pattern is None


def _train_body(ckpt: str) -> dict:
    """``megatron-tree train`` on both families; MambaModel also saves and resumes (its checkpoint and
    optimizer state go through the trainer's dist_checkpointing path; TreeGPTModel's is tested elsewhere)."""
    from megatron_tree.training.trainer import build_train_parser, train

    common = ["--synthetic-preset", "fixed_5k_16x100", "--synthetic-scale", "0.02", "--vocab-size", "128",
              "--hidden-size", "32", "--num-attention-heads", "4", "--lr", "1e-2", "--lr-decay-style", "constant",
              "--tree-global-batch-samples", "16", "--tree-max-tokens-per-mb", "256", "--quiet", "--num-experts", "2",
              "--train-iters", "3"]
    mamba = common + ["--model-family", "mamba", "--hybrid-override-pattern", "M*-E"]
    qwen3next = common + ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2",
                          "--num-layers", "2"]
    full = train(build_train_parser().parse_args(mamba))
    train(build_train_parser().parse_args(mamba + ["--exit-interval", "2", "--save", ckpt]))
    rest = train(build_train_parser().parse_args(mamba + ["--load", ckpt]))
    q3n = train(build_train_parser().parse_args(qwen3next))
    losses = lambda run: [m["loss"] for m in run["history"]]  # noqa: E731
    return {"mamba": (losses(full), losses(rest), rest["resumed_from"]), "qwen3next": losses(q3n)}


def test_train_families_learn_and_resume(tmp_path):
    (r,) = run_distributed(_train_body, 1, str(tmp_path), timeout=300)
    full, rest, resumed = r["mamba"]
    assert full[-1] < full[0]
    assert resumed == 2 and rest == full[2:]  # the resumed step equals the uninterrupted one
    assert r["qwen3next"][-1] < r["qwen3next"][0]


def test_pretrain_tree_mamba_calls_pretrain_with_the_mamba_provider(monkeypatch):
    from megatron.core.enums import ModelType

    from megatron_tree.training import megatron_lm as H
    from megatron_tree.training.arguments import add_tree_args

    calls = []
    stub = types.ModuleType("megatron.training")
    stub.pretrain = lambda *a, **k: calls.append((a, k))
    monkeypatch.setitem(sys.modules, "megatron.training", stub)
    script = ROOT / "examples" / "pretrain_tree_mamba.py"
    runpy.run_path(str(script), run_name="__main__")
    (a, k), = calls
    assert a[1] is H.mamba_model_provider and a[2] == ModelType.encoder_or_decoder and a[3] is H.forward_step
    assert k["extra_args_provider"] is add_tree_args and k["args_defaults"]["dataloader_type"] == "external"
    doc = ast.get_docstring(ast.parse(script.read_text()))
    known = {o for act in add_tree_args(argparse.ArgumentParser())._actions for o in act.option_strings}
    assert "torchrun" in doc and "--hybrid-override-pattern" in doc
    assert {f for f in doc.split() if f.startswith("--tree-")} <= known


def _providers() -> dict:
    """Inside a rank (run by `_interop_body`): the Megatron-LM model providers for both families."""
    from megatron_tree.training import megatron_lm as H
    from megatron_tree.training.arguments import add_tree_args
    from megatron_tree.training.models import ModelArgs, make_config

    def lm_args(**over):
        """Megatron-LM-like arguments (what its parser would give) plus the --tree-* group."""
        a = add_tree_args(argparse.ArgumentParser()).parse_args(["--tree-packing", "--tree-max-tokens-per-mb", "48"])
        for k, v in dict(vocab_size=100, padded_vocab_size=100, transformer_impl="local", normalization="RMSNorm",
                         untie_embeddings_and_output_weights=True, position_embedding_type="rope",
                         max_position_embeddings=48, micro_batch_size=1, attention_dropout=0.0, **over).items():
            setattr(a, k, v)
        return a

    mamba = H.mamba_model_provider(config=make_config(ModelArgs(kind="mamba", pattern="M*-")),
                                   args=lm_args(hybrid_override_pattern="M*-", num_layers=3))
    q3n = H.model_provider(config=make_config(ModelArgs(kind="qwen3next", num_layers=2)), args=lm_args(num_layers=2))
    # --spec MODULE NAME (pretrain_mamba.py's way to name the stack spec): the named spec is treeified
    from megatron_tree.megatron.family_specs import get_local_mamba_stack_spec

    sys.modules[__name__].USER_MAMBA_SPEC = get_local_mamba_stack_spec()
    user = H.mamba_model_provider(config=make_config(ModelArgs(kind="mamba", pattern="M*")),
                                  args=lm_args(hybrid_override_pattern="M*", num_layers=2,
                                               spec=[__name__, "USER_MAMBA_SPEC"]))
    return {"mamba": (type(mamba).__name__, [type(m).__name__ for m in mamba.decoder.layers],
                      type(mamba.decoder.layers[0].mixer).__name__),
            "user_spec": (type(user.decoder.layers[0].mixer).__name__,
                          type(user.decoder.layers[1].self_attention.core_attention).__name__),
            "qwen3next": (type(q3n).__name__, [type(m.self_attention).__name__ for m in q3n.decoder.layers])}


def test_te_mamba_spec_is_the_stock_one_with_our_mixer_and_attention(interop):
    r = interop["te_mamba_spec"]
    assert r["mixer"] == ("TreeMambaMixer", "MambaMixer") and r["core"] == ("TreeDotProductAttention", True)
    assert r["same_linears"] and r["same_other_layers"]


def test_megatron_lm_providers_build_the_tree_families(interop):
    r = interop["providers"]
    assert r["mamba"] == ("TreeMambaModel", ["MambaLayer", "TransformerLayer", "MLPLayer"], "TreeMambaMixer")
    assert r["qwen3next"] == ("TreeGPTModel", ["TreeGatedDeltaNet", "SelfAttention"])
    assert r["user_spec"] == ("TreeMambaMixer", "TreeDotProductAttention")
