"""`TreeGPTModel` on packed trees against **stock** Megatron-Core ``GPTModel`` run per sample.

Oracle: Megatron-Core 0.16.1's own ``GPTModel`` built from its stock local specs
(``get_gpt_decoder_block_spec(config, use_transformer_engine=False)`` or
``get_gpt_layer_local_spec(...)``) with the stock ``DotProductAttention``, run on each sample alone
(a batch of one, ordinary causal attention, positions 0..L-1, no ``packed_seq_params``). Its
log_softmax at every target is compared with the per-occurrence log-prob of the tree model, in
float64, and so are all parameter gradients of one weighted sum of those log-probs. The tree model
gets the stock model's state dict (same parameter names), with O(1) random weights so that every
path of the computation matters.

The stock local attention runs every option tested here on CPU (read in 0.16.1's
``dot_product_attention.py`` / ``fused_softmax.py``): the sliding window is its
``get_sliding_window_causal_mask`` (key k visible from query q iff q - left <= k <= q for
``window_size=(left, 0)``), ``window_attn_skip_freq`` goes through ``is_layer_window_attention``
(1-based layer numbers; an int f makes every f-th layer full attention, a list marks window layers
with 1), and sinks are ``SoftmaxOne`` (one extra logit per head in the softmax denominator: the
learned ``softmax_offset`` for "learnable", 0 for "off-by-one"). So no hand-written oracle is
needed: the mapping of every option is checked against Megatron itself, not against our own
`TreeDotProductAttention` on chains.

The trees really branch: forks at depths 1, 5, 6 and 9, a sample that is a prefix of another, a
duplicate, three trees in one microbatch, padding rows. Every model is checked once in a single
spawned gloo rank (``tests/dist.py``); the parametrised tests read its results.
"""
from __future__ import annotations

import traceback

import pytest
import torch

try:
    from dist import init_megatron, run_distributed
except ImportError:  # run from the repository root as tests.*
    from tests.dist import init_megatron, run_distributed

from per_sample import MOE_GRAD, SAMPLES, coef, randomize, stock_logprobs, tree_logprobs  # tests/per_sample.py

V = 64
F64 = dict(rtol=1e-10, atol=1e-10)

# name -> (spec kind, num_experts, qk_layernorm, extra TransformerConfig fields)
CASES = {
    # layer 1 sliding window (left context 3), layer 2 full attention (2 % 2 == 0)
    "window_skip_freq": ("block", None, False, dict(window_size=(3, 0), window_attn_skip_freq=2)),
    # list form: layer 1 full attention, layer 2 sliding window (left context 2)
    "window_skip_list": ("block", None, False, dict(window_size=(2, 0), window_attn_skip_freq=[0, 1])),
    "window_every_layer": ("block", None, False, dict(window_size=(4, 0))),
    "sinks_learnable": ("block", None, False, dict(softmax_type="learnable")),
    "sinks_off_by_one": ("block", None, False, dict(softmax_type="off-by-one")),
    "window_and_sinks": ("block", None, False, dict(window_size=(3, 0), window_attn_skip_freq=2,
                                                    softmax_type="learnable")),
    "moe": ("block", 4, False, dict()),
    # Megatron divides the scores by the layer number and multiplies them back inside the softmax
    "layer_scaling": ("block", None, False, dict(apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True,
                                                 softmax_type="learnable")),
    # the README's one-line swap: get_gpt_layer_local_spec(...) -> get_tree_gpt_layer_spec(...)
    "layer_spec": ("layer", None, True, dict(window_size=(3, 0), window_attn_skip_freq=2, softmax_type="learnable")),
    "layer_spec_moe": ("layer", 4, False, dict(softmax_type="off-by-one")),
}


def _window_layers(model):
    return [layer.self_attention.core_attention.scale_mask_softmax.window_size for layer in model.decoder.layers]


def _build(name, cfg):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    from megatron_tree.megatron.model import TreeGPTModel
    from megatron_tree.megatron.specs import (get_tree_gpt_decoder_block_spec, get_tree_gpt_layer_spec,
                                              te_available)

    kind, num_experts, qk_layernorm, _ = CASES[name]
    if kind == "block":
        stock_spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
        tree_spec = get_tree_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    else:
        assert not te_available()  # then the README call below builds the local spec, as stock does
        stock_spec = get_gpt_layer_local_spec(num_experts, False, qk_layernorm)
        tree_spec = get_tree_gpt_layer_spec(num_experts, False, qk_layernorm)
    stock = GPTModel(cfg, stock_spec, V, 64, position_embedding_type="rope")
    tree = TreeGPTModel(cfg, tree_spec, V, 64, position_embedding_type="rope")
    return stock, tree


def _case(name, samples, targets, mbs):
    from megatron_tree.training.models import ModelArgs, make_config

    _, num_experts, qk_layernorm, extra = CASES[name]
    # the config says what the spec builds (megatron-core 0.19 refuses a spec with q/k norms otherwise)
    extra = dict(extra, qk_layernorm=True) if qk_layernorm else extra
    cfg = make_config(ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=48, vocab_size=V, num_experts=num_experts, moe_ffn_hidden_size=16,
                                extra=dict(extra)), dtype=torch.float64)
    stock, tree = _build(name, cfg)
    randomize(stock, seed=sum(map(ord, name)))
    tree.load_state_dict(stock.state_dict(), strict=True)
    res = {"core_attention": [type(layer.self_attention.core_attention).__name__ for layer in tree.decoder.layers],
           "stock_core_attention": [type(layer.self_attention.core_attention).__name__
                                    for layer in stock.decoder.layers],
           "stock_windows": _window_layers(stock),
           "stock_softmax_scales": [layer.self_attention.core_attention.scale_mask_softmax.scale
                                    for layer in stock.decoder.layers],
           "tree_windows": [layer.self_attention.core_attention.window for layer in tree.decoder.layers],
           "mlp": [type(layer.mlp).__name__ for layer in tree.decoder.layers]}

    ref = stock_logprobs(stock, samples, targets)
    got = tree_logprobs(tree, mbs)
    res["keys_equal"] = sorted(ref) == sorted(got)
    keys = sorted(ref)
    res["lp_tree"] = torch.stack([got[k] for k in keys]).detach()
    res["lp_stock"] = torch.stack([ref[k] for k in keys]).detach()

    stock.zero_grad()
    tree.zero_grad()
    sum(coef(*k) * ref[k] for k in keys).backward()
    sum(coef(*k) * got[k] for k in keys).backward()
    sg, tg = dict(stock.named_parameters()), dict(tree.named_parameters())
    res["grad_names_equal"] = sorted(sg) == sorted(tg)
    res["grads"] = {n: (tg[n].grad.clone(), sg[n].grad.clone()) for n in sorted(sg)}

    # power of the check: the stock log-probs move when the window is one wider / the sinks removed,
    # so a tree model that is off by one (or ignores the option) cannot pass
    with torch.no_grad():
        moved = []
        for layer in stock.decoder.layers:
            sm = layer.self_attention.core_attention.scale_mask_softmax
            if sm.window_size is not None:
                sm.window_size = (sm.window_size[0] + 1, 0)
                moved.append("window")
        if moved:
            wider = stock_logprobs(stock, samples, targets)
            res["window_plus_one_shift"] = max(float((wider[k] - ref[k]).abs()) for k in keys)
            for layer in stock.decoder.layers:
                sm = layer.self_attention.core_attention.scale_mask_softmax
                if sm.window_size is not None:
                    sm.window_size = (sm.window_size[0] - 1, 0)
        cores = [layer.self_attention.core_attention for layer in stock.decoder.layers]
        if cores[0].softmax_offset is not None:
            saved = [c.softmax_offset for c in cores]
            for c in cores:
                c.softmax_offset = None
            plain = stock_logprobs(stock, samples, targets)
            for c, s in zip(cores, saved):
                c.softmax_offset = s
            res["no_sink_shift"] = max(float((plain[k] - ref[k]).abs()) for k in keys)
    return res


def _unsupported_errors():
    """Messages of TreeDotProductAttention for configurations it cannot honour."""
    from megatron.core.transformer import TransformerConfig

    from megatron_tree.megatron.attention import TreeDotProductAttention

    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                params_dtype=torch.float64, attention_dropout=0.0, hidden_dropout=0.0)
    out = {}
    for key, kw in {"window_left_-1": dict(window_size=(-1, 0)), "window_right_2": dict(window_size=(3, 2))}.items():
        try:
            TreeDotProductAttention(TransformerConfig(**base, **kw), layer_number=1)
            out[key] = None
        except ValueError as e:
            out[key] = str(e)
    return out


def _body():
    init_megatron(tp=1, kernels=True)
    torch.set_default_dtype(torch.float64)  # Megatron's torch norms take the default dtype
    from megatron_tree.tree import pack

    mbs = pack(SAMPLES, 64, pad_to_multiple_of=16)
    lay = mbs[0].layout
    structure = dict(num_mbs=len(mbs), num_trees=int((lay.segment_parent == -1).sum()) - lay.num_padding,
                     num_padding=lay.num_padding, ratio=mbs[0].stats.tree_token_ratio,
                     fork_depths=sorted({int(lay.position_ids[int(lay.segment_offsets[s])])
                                         for s in range(len(lay.segment_parent)) if int(lay.segment_parent[s]) >= 0}))
    targets = [list(range(1, len(s))) for s in SAMPLES]
    results = {}
    for name in CASES:  # one broken case must not hide the others
        try:
            results[name] = _case(name, SAMPLES, targets, mbs)
        except Exception:  # noqa: BLE001 - reported by the test of that case
            results[name] = {"error": traceback.format_exc()}
    return dict(structure=structure, cases=results, errors=_unsupported_errors())


@pytest.fixture(scope="module")
def oracle():
    return run_distributed(_body, 1, timeout=240)[0]


def _result(oracle, name):
    r = oracle["cases"][name]
    if "error" in r:
        pytest.fail(f"case {name} raised:\n{r['error']}")
    return r


def test_trees_really_branch(oracle):
    s = oracle["structure"]
    assert s["num_mbs"] == 1 and s["num_trees"] == 3 and s["num_padding"] > 0
    assert s["fork_depths"] == [1, 5, 6, 9] and s["ratio"] > 1.5


@pytest.mark.parametrize("name", list(CASES))
def test_tree_model_equals_stock_gpt_per_sample(oracle, name):
    r = _result(oracle, name)
    assert r["core_attention"] == ["TreeDotProductAttention"] * 2
    assert r["stock_core_attention"] == ["DotProductAttention"] * 2
    assert r["keys_equal"] and r["grad_names_equal"]
    torch.testing.assert_close(r["lp_tree"], r["lp_stock"], **F64)
    assert r["lp_tree"].dtype == torch.float64 and len(r["lp_tree"]) == sum(len(s) - 1 for s in SAMPLES)
    tol = MOE_GRAD if CASES[name][1] else F64
    for n, (g_tree, g_stock) in r["grads"].items():
        assert g_stock.abs().max() > 0, n  # every parameter takes part
        torch.testing.assert_close(g_tree, g_stock, **tol, msg=lambda m: f"grad of {n}: {m}")


@pytest.mark.parametrize("name, stock_windows", [
    ("window_skip_freq", [(3, 0), None]),
    ("window_skip_list", [None, (2, 0)]),
    ("window_every_layer", [(4, 0), (4, 0)]),
    ("window_and_sinks", [(3, 0), None]),
    ("layer_spec", [(3, 0), None]),
])
def test_window_cases_are_discriminating(oracle, name, stock_windows):
    """Megatron's layer selection is as documented here, the tree model windows the same layers, and
    the data tell a window of left from one of left + 1."""
    r = _result(oracle, name)
    assert r["stock_windows"] == stock_windows
    assert [w is None for w in r["tree_windows"]] == [w is None for w in stock_windows]
    assert r["window_plus_one_shift"] > 1e-3


@pytest.mark.parametrize("name", ["sinks_learnable", "sinks_off_by_one", "window_and_sinks", "layer_scaling",
                                  "layer_spec", "layer_spec_moe"])
def test_sink_cases_are_discriminating(oracle, name):
    assert _result(oracle, name)["no_sink_shift"] > 1e-3


def test_layer_scaling_case_scales_inside_the_stock_softmax(oracle):
    assert _result(oracle, "layer_scaling")["stock_softmax_scales"] == [1, 2]
    assert _result(oracle, "moe")["stock_softmax_scales"] == [None, None]


def test_moe_cases_use_moe_layers(oracle):
    for name in ("moe", "layer_spec_moe"):
        assert _result(oracle, name)["mlp"] == ["MoELayer"] * 2


def test_unsupported_window_errors_clearly(oracle):
    for key, msg in oracle["errors"].items():
        assert msg is not None and "window_size" in msg, key
