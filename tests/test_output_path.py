"""The tree's log-probs go through stock's output path (`megatron_tree.megatron.output_path`), not a bare matmul.

Oracle: stock ``GPTModel`` with the same output path, run on each sample alone, float64: the final logit
soft-cap of Megatron-Bridge's ``Gemma2OutputLayer`` (put on the model with the Bridge's own
``extend_instance``, as its Gemma 2 / 3 providers do), and MuP's output multiplier (megatron-core 0.19's
``_scale_logits``). Each must matter: the same weights without it give other log-probs. An output layer
whose forward the tree cannot know is refused by name.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

try:
    from dist import init_megatron, run_distributed
except ImportError:  # run from the repository root as tests.*
    from tests.dist import init_megatron, run_distributed

V = 64


def _models(extra=None, output_mixin=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_tree.megatron.model import TreeGPTModel
    from megatron_tree.megatron.specs import get_tree_gpt_layer_spec
    from megatron_tree.training.models import ModelArgs, make_config
    from per_sample import randomize  # tests/per_sample.py

    cfg = make_config(ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=48, vocab_size=V, extra=dict(extra or {})), dtype=torch.float64)
    stock = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), V, 64, position_embedding_type="rope")
    tree = TreeGPTModel(cfg, get_tree_gpt_layer_spec(use_transformer_engine=False, normalization="RMSNorm"), V, 64,
                        position_embedding_type="rope")
    randomize(stock, seed=11)
    tree.load_state_dict(stock.state_dict(), strict=True)
    if output_mixin is not None:
        for m in (stock, tree):
            output_mixin(m)
    return cfg, stock, tree


def _compare(stock, tree, plain=None) -> dict:
    from megatron_tree.tree import Sample, pack
    from per_sample import SAMPLES, coef, stock_logprobs, tree_logprobs

    mbs = pack([Sample(tokens=s) for s in SAMPLES], 256)
    ref, got = stock_logprobs(stock, SAMPLES), tree_logprobs(tree, mbs)
    keys = sorted(ref)
    sum(coef(*k) * ref[k] for k in keys).backward()
    sum(coef(*k) * got[k] for k in keys).backward()
    sg, tg = dict(stock.named_parameters()), dict(tree.named_parameters())
    out = {"lp": (torch.stack([got[k] for k in keys]).detach(), torch.stack([ref[k] for k in keys]).detach()),
           "grads": {n: (tg[n].grad.clone(), sg[n].grad.clone()) for n in sorted(sg)}}
    if plain is not None:
        with torch.no_grad():
            p = stock_logprobs(plain, SAMPLES)
        out["plain"] = torch.stack([p[k] for k in keys])
    return out


def _softcap_body():
    from megatron_tree.cpu.bridge import import_bridge

    import_bridge()  # a host without transformer-engine needs its stand-in to import the Bridge
    from megatron.bridge.models.gemma.gemma2_provider import Gemma2OutputLayer
    from megatron.bridge.models.gemma.modules import extend_instance

    init_megatron()
    torch.set_default_dtype(torch.float64)
    softcap = {"final_logit_softcapping": 1.5}  # logits are O(1) here: a small cap really bends them
    mixin = lambda m: extend_instance(m.output_layer, Gemma2OutputLayer)
    cfg, stock, tree = _models(output_mixin=mixin)
    cfg.final_logit_softcapping = softcap["final_logit_softcapping"]  # the provider's field, read by the layer
    _, plain, _ = _models()
    return _compare(stock, tree, plain)


def _mup_body():
    init_megatron()
    torch.set_default_dtype(torch.float64)
    _, stock, tree = _models(extra=dict(use_mup=True, mup_base_hidden_size=16))  # width x2: logits x 1/2
    _, plain, _ = _models()
    return _compare(stock, tree, plain)


def _refusal_body():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_tree.megatron.output_path import TreeOutputError, check_output_layer

    init_megatron()
    torch.set_default_dtype(torch.float64)

    class ScaledOutput(ColumnParallelLinear):
        def forward(self, *args, **kwargs):
            out, bias = super().forward(*args, **kwargs)
            return 2 * out, bias

    _, _, tree = _models()
    tree.output_layer.__class__ = ScaledOutput
    try:
        check_output_layer(tree)
    except TreeOutputError as e:
        return str(e)
    return None


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _check(res):
    lp_tree, lp_stock = res["lp"]
    assert _rel(lp_tree, lp_stock) <= 1e-12
    worst = {n: _rel(t, s) for n, (t, s) in res["grads"].items()}
    assert max(worst.values()) <= 1e-12, worst
    assert _rel(res["plain"], lp_stock) > 1e-3  # the output path's extra step matters on these weights


@pytest.mark.skipif(importlib.util.find_spec("megatron.bridge") is None,
                    reason="Gemma2OutputLayer is Megatron-Bridge's (the hf extra: Python 3.12, megatron-core >= 0.19)")
def test_final_logit_softcap_of_the_bridges_gemma_output_layer_equals_stock():
    _check(run_distributed(_softcap_body, 1, timeout=300)[0])


def test_mup_output_multiplier_equals_stock():
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "use_mup" not in TransformerConfig.__dataclass_fields__:
        pytest.skip("this megatron-core has no MuP (0.16.1): its GPTModel scales no logits")
    _check(run_distributed(_mup_body, 1, timeout=300)[0])


def test_an_output_layer_the_tree_cannot_know_is_refused_by_name():
    msg = run_distributed(_refusal_body, 1, timeout=300)[0]
    assert msg is not None and "ScaledOutput" in msg and "does more than ColumnParallelLinear" in msg, msg
