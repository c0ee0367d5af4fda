"""Tree Multi-Latent Attention (`TreeMLASelfAttention`): stock interop and ``megatron-tree verify --model mla``.

Interop oracle: Megatron-Core 0.16.1's own ``GPTModel`` with its stock MLA layer specs
(``get_gpt_decoder_block_spec`` / ``get_gpt_layer_local_spec(multi_latent_attention=True)``, local
modules) and stock ``MLASelfAttention``, which computes its rotary (plain or YaRN) inside the module
from physical rows ``0..L-1`` of each sample run alone. The stock local ``DotProductAttention``
cannot be built for MLA (it takes no ``k_channels`` / ``v_channels``; Megatron uses TE's attention
there), so the stock side's core attention is `_DenseCausalAttention` below: plain dense causal
softmax attention, shared with no tree code. It has no parameters, so the module tree and the
checkpoint are the stock ones.

Checked in float64: a stock checkpoint written by ``dist_checkpointing`` loads into the tree model
with no missing or unexpected key (and a tree checkpoint into a stock model); on a forest that really
branches, the tree model's per-occurrence log-probs equal log_softmax of the stock model run on each
sample alone, and so do all parameter gradients; the same tree model with its MLA rotary by physical
row does not. Then verify (tree-packed vs per-sample training) under TP2 + SP, PP2, DP2 + EP2 with MoE,
tree CP2, selective (incl. MLA's ``mla_up_proj``) and full recomputation, and the ``mla_rope_physical``
fault (MLA's rotary by physical row), which must fail.
"""
from __future__ import annotations

import os
import tempfile
import traceback

import pytest
import torch

try:
    from dist import init_megatron, run_distributed
except ImportError:  # run from the repository root as tests.*
    from tests.dist import init_megatron, run_distributed

from megatron_tree.training.verify import VerifyConfig, run_verify_many
from per_sample import MOE_GRAD, SAMPLES, coef, randomize, stock_logprobs, tree_logprobs  # tests/per_sample.py
from verify_checks import check_verify  # tests/verify_checks.py

V = 64
F64 = dict(rtol=1e-10, atol=1e-10)

# name -> (spec kind, num_experts, qk_layernorm, MLA config fields over MLA_DEFAULTS)
CASES = {
    # DeepSeek-V3 style: q latent, YaRN with concentration factor != 1, layer 1 dense, layer 2 MoE
    "yarn_qlora_moe": ("block", 4, False, dict()),
    # DeepSeek-V2-Lite style: no q latent, plain RoPE (no q latent, so no q layernorm: megatron-core
    # 0.19 rejects qk_layernorm without a q latent); the README's one-line swap
    # get_gpt_layer_local_spec(..., multi_latent_attention=True) -> get_tree_gpt_layer_spec(...)
    "rope_layer_spec": ("layer", None, False, dict(q_lora_rank=None, rope_type="rope")),
}


def _dense_causal_attention_cls():
    from megatron.core.transformer.module import MegatronModule

    class _DenseCausalAttention(MegatronModule):
        """Core attention for the stock oracle: q, k [s,b,n,D], v [s,b,n,Dv] -> [s,b,n*Dv], causal."""

        def __init__(self, config, layer_number, attn_mask_type=None, attention_type="self",
                     attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                     cp_comm_type=None, pg_collection=None):
            super().__init__(config=config)
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            assert packed_seq_params is None  # the stock side runs every sample alone, unpacked
            s, b = query.shape[:2]
            scores = torch.einsum("sbnd,tbnd->bnst", query, key) * self.softmax_scale
            future = torch.ones(s, s, dtype=torch.bool).triu(1)
            probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
            return torch.einsum("bnst,tbnd->sbnd", probs, value).reshape(s, b, -1)

    return _DenseCausalAttention


def _with_dense_core(spec):
    """The stock spec with `_DenseCausalAttention` as every MLA layer's core attention."""
    import copy

    spec = copy.deepcopy(spec)
    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = _dense_causal_attention_cls()
    return spec


def _save(model, path):
    from megatron.core import dist_checkpointing

    os.makedirs(path)
    dist_checkpointing.save(model.sharded_state_dict(), path)


def _load(model, path):
    """Load a dist checkpoint into ``model``; returns the (missing, unexpected) keys of both steps:
    checkpoint vs the model's sharded state dict, and the loaded state dict vs the module."""
    from megatron.core import dist_checkpointing

    loaded, missing, unexpected = dist_checkpointing.load(model.sharded_state_dict(), path, strict="return_all")
    res = model.load_state_dict(loaded, strict=False)
    return sorted(missing) + sorted(res.missing_keys), sorted(unexpected) + sorted(res.unexpected_keys)


def _case(name, mbs, tmp):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    from megatron_tree.megatron.model import TreeGPTModel
    from megatron_tree.megatron.specs import get_tree_gpt_decoder_block_spec, get_tree_gpt_layer_spec
    from megatron_tree.training.models import ModelArgs, make_config

    kind, num_experts, qk_layernorm, extra = CASES[name]
    cfg = make_config(ModelArgs(kind="mla", num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                                vocab_size=V, num_experts=num_experts, moe_ffn_hidden_size=16, extra=dict(extra)),
                      dtype=torch.float64)
    if kind == "block":
        stock_spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
        tree_spec = get_tree_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    else:
        stock_spec = get_gpt_layer_local_spec(num_experts, False, qk_layernorm, multi_latent_attention=True,
                                              normalization="RMSNorm")
        tree_spec = get_tree_gpt_layer_spec(num_experts, False, qk_layernorm, multi_latent_attention=True,
                                            normalization="RMSNorm", use_transformer_engine=False)
    stock = GPTModel(cfg, _with_dense_core(stock_spec), V, 64, position_embedding_type="rope")
    tree = TreeGPTModel(cfg, tree_spec, V, 64, position_embedding_type="rope")
    randomize(stock, seed=sum(map(ord, name)))
    res = {"attention": [type(layer.self_attention).__name__ for layer in tree.decoder.layers],
           "core_attention": [type(layer.self_attention.core_attention).__name__ for layer in tree.decoder.layers],
           "rotary": [type(layer.self_attention.rotary_pos_emb).__name__ for layer in tree.decoder.layers],
           "mlp": [type(layer.mlp).__name__ for layer in tree.decoder.layers],
           "sharded_keys_equal": sorted(stock.sharded_state_dict()) == sorted(tree.sharded_state_dict())}

    # stock checkpoint -> tree model
    _save(stock, os.path.join(tmp, name, "stock"))
    res["stock_to_tree"] = _load(tree, os.path.join(tmp, name, "stock"))
    sd_s, sd_t = stock.state_dict(), tree.state_dict()
    res["stock_to_tree_equal"] = sorted(sd_s) == sorted(sd_t) and all(
        torch.equal(sd_s[k], sd_t[k]) for k in sd_s if isinstance(sd_s[k], torch.Tensor))

    ref = stock_logprobs(stock, SAMPLES)
    got = tree_logprobs(tree, mbs)
    keys = sorted(ref)
    res["keys_equal"] = keys == sorted(got)
    res["lp_tree"] = torch.stack([got[k] for k in keys]).detach()
    res["lp_stock"] = torch.stack([ref[k] for k in keys]).detach()
    stock.zero_grad()
    tree.zero_grad()
    sum(coef(*k) * ref[k] for k in keys).backward()
    sum(coef(*k) * got[k] for k in keys).backward()
    sg, tg = dict(stock.named_parameters()), dict(tree.named_parameters())
    res["grads"] = {n: (tg[n].grad.clone(), sg[n].grad.clone()) for n in sorted(sg)}

    # power: the same tree model with its MLA rotary by physical row (the stock module's behaviour)
    with torch.no_grad():
        for layer in tree.decoder.layers:
            layer.self_attention.rotary_positions = lambda psp: torch.arange(psp.num_local_rows)
        phys = tree_logprobs(tree, mbs)
        res["physical_row_shift"] = max(float((phys[k] - ref[k]).abs()) for k in keys)
        for layer in tree.decoder.layers:
            del layer.self_attention.rotary_positions

    # tree checkpoint -> a fresh stock model (other weights until loaded)
    with torch.no_grad():
        for p in tree.parameters():
            p.mul_(1.25)
    _save(tree, os.path.join(tmp, name, "tree"))
    torch.manual_seed(7)
    back = GPTModel(cfg, _with_dense_core(stock_spec), V, 64, position_embedding_type="rope")
    res["tree_to_stock"] = _load(back, os.path.join(tmp, name, "tree"))
    sd_b, sd_t = back.state_dict(), tree.state_dict()
    res["tree_to_stock_equal"] = sorted(sd_b) == sorted(sd_t) and all(
        torch.equal(sd_b[k], sd_t[k]) for k in sd_b if isinstance(sd_b[k], torch.Tensor))
    return res


def _rotary_lookups():
    """Depth lookups of `TreeYarnRotaryEmbedding` against the stock table, incl. YaRN's fused-path cache."""
    from megatron.core.models.common.embeddings import YarnRotaryEmbedding

    from megatron_tree.megatron.mla import TreeYarnRotaryEmbedding

    rot = YarnRotaryEmbedding(8, scaling_factor=4.0, original_max_position_embeddings=16, mscale=1.0,
                              mscale_all_dim=0.5, use_cpu_initialization=True)
    rot.__class__ = TreeYarnRotaryEmbedding
    n, depths = 12, torch.tensor([0, 1, 2, 3, 2, 3, 4, 1, 0, 5, 0, 0])
    emb, mscale = rot(n, packed_seq=True)  # outside at_depths: the stock table of rows 0..n-1
    out = {"mscale": mscale}
    with rot.at_depths(depths, n):
        got, got_mscale = rot(1000)  # any requested length: one row per depth
        cos, sin = rot.get_cached_cos_sin(1000, dtype=torch.float64)
        try:
            with rot.at_depths(depths, n):
                pass
            out["nested"] = None
        except RuntimeError as e:
            out["nested"] = str(e)
    out["table"] = torch.equal(got, emb[depths]) and got_mscale == mscale and got.shape == (12, 1, 1, 8)
    ref_cos, ref_sin = ((f(emb) * mscale).to(torch.float64) for f in (torch.cos, torch.sin))  # the stock cache
    out["cos_sin"] = torch.equal(cos, ref_cos[depths]) and torch.equal(sin, ref_sin[depths])
    # afterwards the stock cache is the stock table again (never the depth-gathered one)
    cos_n, _ = rot.get_cached_cos_sin(n, dtype=torch.float64)
    out["cache_clean"] = torch.equal(cos_n, ref_cos)
    out["stock_after"] = torch.equal(rot(n, packed_seq=True)[0], emb)
    return out


def _interop_body():
    init_megatron(tp=1, kernels=True)
    torch.set_default_dtype(torch.float64)  # Megatron's torch norms take the default dtype
    rotary = _rotary_lookups()
    from megatron_tree.tree import pack

    mbs = pack(SAMPLES, 64, pad_to_multiple_of=16)
    lay = mbs[0].layout
    structure = dict(num_mbs=len(mbs), num_padding=lay.num_padding,
                     fork_depths=sorted({int(lay.position_ids[int(lay.segment_offsets[s])])
                                         for s in range(len(lay.segment_parent)) if int(lay.segment_parent[s]) >= 0}))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CASES:  # one broken case must not hide the other
            try:
                results[name] = _case(name, mbs, tmp)
            except Exception:  # noqa: BLE001 - reported by the test of that case
                results[name] = {"error": traceback.format_exc()}
    return dict(structure=structure, cases=results, rotary=rotary)


@pytest.fixture(scope="module")
def interop():
    return run_distributed(_interop_body, 1, timeout=240)[0]


def _result(interop, name):
    r = interop["cases"][name]
    if "error" in r:
        pytest.fail(f"case {name} raised:\n{r['error']}")
    return r


def test_forest_really_branches(interop):
    s = interop["structure"]
    assert s["num_mbs"] == 1 and s["num_padding"] > 0 and s["fork_depths"] == [1, 5, 6, 9]


def test_depth_indexed_rotary_lookups(interop):
    """Inside at_depths: the stock YaRN table (and its fused-path cos/sin with mscale) row by depth;
    outside: the stock module, its cache untouched."""
    r = interop["rotary"]
    assert r["mscale"] != 1.0  # the concentration factor is in play
    assert r["table"] and r["cos_sin"] and r["cache_clean"] and r["stock_after"]
    assert r["nested"] is not None and "does not nest" in r["nested"]


@pytest.mark.parametrize("name", list(CASES))
def test_tree_mla_modules(interop, name):
    r = _result(interop, name)
    rotary = "TreeYarnRotaryEmbedding" if CASES[name][3].get("rope_type", "yarn") == "yarn" else "TreeRotaryEmbedding"
    assert r["attention"] == ["TreeMLASelfAttention"] * 2
    assert r["core_attention"] == ["TreeDotProductAttention"] * 2
    assert r["rotary"] == [rotary] * 2
    assert r["mlp"] == (["MLP", "MoELayer"] if CASES[name][1] else ["MLP", "MLP"])


@pytest.mark.parametrize("name", list(CASES))
def test_checkpoints_interchange_with_stock(interop, name):
    r = _result(interop, name)
    assert r["sharded_keys_equal"]
    assert r["stock_to_tree"] == ([], []), "stock checkpoint -> tree model: (missing, unexpected) keys"
    assert r["tree_to_stock"] == ([], []), "tree checkpoint -> stock model: (missing, unexpected) keys"
    assert r["stock_to_tree_equal"] and r["tree_to_stock_equal"]


@pytest.mark.parametrize("name", list(CASES))
def test_tree_logprobs_and_grads_equal_stock_per_sample(interop, name):
    r = _result(interop, name)
    assert r["keys_equal"]
    torch.testing.assert_close(r["lp_tree"], r["lp_stock"], **F64)
    tol = MOE_GRAD if CASES[name][1] else F64
    for n, (g_tree, g_stock) in r["grads"].items():
        assert g_stock.abs().max() > 0, n  # every parameter takes part
        torch.testing.assert_close(g_tree, g_stock, **tol, msg=lambda m: f"grad of {n}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_physical_row_rotary_is_caught(interop, name):
    """The stock behaviour (rotary by physical row) moves the log-probs on this forest."""
    assert _result(interop, name)["physical_row_shift"] > 1e-3


# ------------------------------------------------------------------------------- megatron-tree verify
# Tree-packed vs per-sample training of a 4-layer MLA model (training.models.MLA_DEFAULTS: YaRN, q and
# kv latents, query/key heads of 12, value heads of 6); with EP the first layer is dense, the others MoE.
WS1 = [
    VerifyConfig(model="mla"),
    # selective: Megatron's core_attn and MLA's own mla_up_proj checkpoints (recompute reuses the table)
    VerifyConfig(model="mla", loss="grpo", recompute="selective"),
    VerifyConfig(model="mla", fault="mla_rope_physical"),
]
WS2 = [
    VerifyConfig(model="mla", tp=2, sp=True, loss="grpo", recompute="selective"),
    VerifyConfig(model="mla", pp=2, recompute="full"),
    VerifyConfig(model="mla", dp=2, ep=2),  # MoE layers (moe_layer_freq [0, 1, 1, 1]), experts over 2 ranks
    VerifyConfig(model="mla", cp=2),  # tree context parallelism: rotary by the depths of each rank's rows
]


@pytest.fixture(scope="module")
def ws1():
    return run_verify_many(WS1)


@pytest.fixture(scope="module")
def ws2():
    return run_verify_many(WS2)


def _check(cfg, out):
    check_verify(cfg, out, fault_seen="grads")  # the rotary by physical row is far off, not a near miss


@pytest.mark.parametrize("i", range(len(WS1)), ids=[f"{c.recompute}-{c.loss}-{c.fault or 'no_fault'}" for c in WS1])
def test_verify_mla_world_size_1(ws1, i):
    _check(WS1[i], ws1[i])


@pytest.mark.parametrize("i", range(len(WS2)), ids=[f"tp{c.tp}-pp{c.pp}-dp{c.dp}-ep{c.ep}-cp{c.cp}" for c in WS2])
def test_verify_mla_world_size_2(ws2, i):
    _check(WS2[i], ws2[i])


def test_mla_fault_needs_an_mla_model():
    with pytest.raises(ValueError, match="needs model='mla'"):
        run_verify_many([VerifyConfig(model="gpt", fault="mla_rope_physical")])
