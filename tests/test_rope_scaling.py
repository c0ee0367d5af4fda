"""YaRN rotary embeddings on a tree (gpt-oss's position embedding) against stock ``GPTModel`` per sample.

Oracle: stock ``GPTModel(position_embedding_type="yarn")`` (stock ``YarnRotaryEmbedding``, stock
attention applying YaRN's concentration factor to q and k) run on each sample alone, float64. The tree
model (`TreeGPTModel`, same weights and config) indexes the same YaRN table by each row's depth.
Compared: every per-occurrence log-prob and every parameter gradient of one weighted sum of them, to
float64 rounding. YaRN matters here: the same weights with plain RoPE give log-probs far away (the
scaled frequencies and the concentration factor both move them), so equality is not RoPE's by chance.
"""
from __future__ import annotations

import torch

try:
    from dist import init_megatron, run_distributed
except ImportError:  # run from the repository root as tests.*
    from tests.dist import init_megatron, run_distributed

V = 64
# gpt-oss's YaRN settings with a short original context: its three lowest frequencies are interpolated
YARN = dict(yarn_rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=16, yarn_beta_fast=32.0,
            yarn_beta_slow=1.0, yarn_mscale=None, yarn_mscale_all_dim=None, yarn_correction_range_round_to_int=False)


def _body():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_tree.megatron.model import TreeGPTModel
    from megatron_tree.megatron.specs import get_tree_gpt_layer_spec
    from megatron_tree.training.models import ModelArgs, make_config
    from megatron_tree.tree import Sample, pack
    from per_sample import SAMPLES, coef, randomize, stock_logprobs, tree_logprobs  # tests/per_sample.py

    init_megatron()
    torch.set_default_dtype(torch.float64)
    cfg = make_config(ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=48, vocab_size=V), dtype=torch.float64)
    for k, v in YARN.items():  # Megatron-Bridge's providers carry these as config fields (GPTModel getattr's them)
        setattr(cfg, k, v)
    out = {}
    models = {}
    for pos in ("yarn", "rope"):
        stock = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), V, 64, position_embedding_type=pos)
        tree = TreeGPTModel(cfg, get_tree_gpt_layer_spec(use_transformer_engine=False, normalization="RMSNorm"), V, 64,
                            position_embedding_type=pos)
        randomize(stock, seed=5)
        tree.load_state_dict(stock.state_dict(), strict=True)
        models[pos] = (stock, tree)
    stock, tree = models["yarn"]
    mbs = pack([Sample(tokens=s) for s in SAMPLES], 256)
    ref = stock_logprobs(stock, SAMPLES)
    got = tree_logprobs(tree, mbs)
    keys = sorted(ref)
    assert sorted(got) == keys
    sum(coef(*k) * ref[k] for k in keys).backward()
    sum(coef(*k) * got[k] for k in keys).backward()
    rope = stock_logprobs(models["rope"][0], SAMPLES)
    sg, tg = dict(stock.named_parameters()), dict(tree.named_parameters())
    out["lp"] = (torch.stack([got[k] for k in keys]).detach(), torch.stack([ref[k] for k in keys]).detach())
    out["rope_lp"] = torch.stack([rope[k] for k in keys]).detach()
    out["grads"] = {n: (tg[n].grad.clone(), sg[n].grad.clone()) for n in sorted(sg)}
    out["rows"], out["flat"] = sum(mb.num_rows for mb in mbs), sum(map(len, SAMPLES))
    return out


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def test_yarn_tree_equals_stock_per_sample():
    res = run_distributed(_body, 1, timeout=300)[0]
    lp_tree, lp_stock = res["lp"]
    assert res["rows"] < res["flat"]  # the samples share prefixes
    assert _rel(lp_tree, lp_stock) <= 1e-12
    worst = {n: _rel(t, s) for n, (t, s) in res["grads"].items()}
    assert max(worst.values()) <= 1e-12, worst
    assert all(s.abs().max() > 0 for _, s in res["grads"].values())
    assert _rel(res["rope_lp"], lp_stock) > 1e-3  # YaRN moves the log-probs: it is really applied
