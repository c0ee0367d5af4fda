"""Hugging Face checkpoints through Megatron-Bridge into tree models (`megatron_tree.bridge`), checked
against `transformers` itself and against stock Megatron-Core run per sample.

For each family (`hf_tiny.FAMILIES`: Qwen3, Qwen3-MoE, Qwen3-Next, Nemotron-H, DeepSeek-V3, GLM-5, gpt-oss,
OLMoE, Gemma 3, Gemma 2, Falcon-H1) a tiny random model is made and saved by `transformers` in the test; ``bridge.hf_provider`` imports it
(float64) as a tree provider, ``load_hf_weights`` loads it (refusing any parameter left unloaded),
and the tree model's per-occurrence log-probs on a packed forest with shared prefixes, forks, a
prefix sample and a duplicate (`per_sample.SAMPLES`) are compared with

* `transformers`' own per-sample log-probs in float64 (<= 1e-5 relative: both sides build their
  rotary tables in float32, and transformers keeps some Mamba / GDN / router quantities in fp32);
* stock Megatron-Core's model from the same Bridge provider (its local spec, not treeified: stock
  ``GPTModel`` / ``HybridModel``) run on each sample alone, to 1e-12 in float64 (`STOCK_TOL`: looser
  only where stock itself rounds to fp32).

GLM-5 (DeepSeek sparse attention) agrees with `transformers` when the indexer's top-k covers every
key (``index_topk`` >= the longest sample); with a sparse top-k only when transformers' ``torch.topk``
breaks ties among equal index scores as ours does (lowest key index): the whole difference found is
that tie rule (docs/architecture.md, section 9). Its stock side is the DSA oracle's business
(tests/test_dsa_megatron.py), not repeated here.

The RL API (`megatron_tree.rl`) runs a Bridge-built model (Nemotron-H) to transformers' log-probs.
Round trip: one optimizer-free gradient step on the tree model (SGD on the forest's summed
log-prob), ``save_hf_pretrained``, reloaded by `transformers`: its per-sample logits equal the updated
tree model's. Refusals: a provider setting that would undo the swap (TE's full-layer spec), a
checkpoint that leaves a parameter unloaded (transformers 5.x's Nemotron-H embedding name).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

try:
    from dist import run_distributed
except ImportError:  # run from the repository root as tests.*
    from tests.dist import run_distributed

import hf_tiny  # tests/hf_tiny.py

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron.bridge") is None or importlib.util.find_spec("transformers") is None,
    reason="megatron-bridge / transformers are not installed: the extra 'megatron-tree[hf]' needs Python 3.12 and "
           "megatron-core >= 0.19; `make test-latest` installs it")

STOCK = ("qwen3", "qwen3_moe", "qwen3_next", "nemotron_h", "deepseek_v3", "gpt_oss", "olmoe", "gemma3", "gemma2",
         "falcon_h1")
# Tree vs stock per sample, float64: 1e-12, except where stock itself rounds to fp32 inside a float64
# model (tests/test_model_families.py measures it): Qwen3-Next's stock GatedDeltaNet keeps its decay and
# output gate in fp32 (measured 8.4e-9 here). Route scores, which stock also keeps in fp32 (DeepSeek-V3's
# sigmoid with expert bias: 3.0e-10), are widened to float64 on both sides (`router_precision`).
# A wrong tree computation moves log-probs by O(0.1).
# Stock's Mamba-2 chunked scan on CPU orders its float64 sums otherwise than the tree's SSD: Nemotron-H measured
# 8.8e-13, Falcon-H1 (two Mamba-2 mixers with 4 heads, every layer) 1.4e-12, with or without its multipliers.
STOCK_TOL = {"qwen3_next": 1e-7, "falcon_h1": 1e-11}


def _cpu_provider(bridge, stock: bool):
    """The Bridge's provider for ``bridge`` in float64: the tree provider, or (``stock``) the Bridge's own
    provider with the same CPU treatment (local specs, fusions off) and its stock model class."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron_tree import bridge as tb
    from megatron_tree.bridge.cpu import cpu_settings, use_local_specs

    provider = bridge.to_megatron_provider(load_weights=False)
    if stock:
        use_local_specs(provider)
        cpu_settings(provider)
        provider.attention_backend = AttnBackend.local
        if getattr(provider, "multi_latent_attention", False):
            # stock's local DotProductAttention cannot be built for MLA (no k_channels; Megatron uses TE's
            # there): tests/test_mla.py's dense causal oracle core, which has no parameters
            from test_mla import _with_dense_core

            local = provider.transformer_layer_spec
            provider.transformer_layer_spec = lambda config, vp_stage=None: _with_dense_core(local(config, vp_stage))
        if type(provider).__name__ in ("Gemma3ModelProvider", "Gemma2ModelProvider"):
            local = provider.transformer_layer_spec
            provider.transformer_layer_spec = lambda config, vp_stage=None: _with_stock_gemma_core(local(config))
    else:
        provider = tb.tree_provider(provider)
        provider.calculate_per_token_loss = True  # rl.forward_backward's per-token loss
    provider.params_dtype = torch.float64
    provider.finalize()
    if stock:
        from megatron.core.process_groups_config import ProcessGroupCollection

        provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return provider


def _with_stock_gemma_core(block):
    """The Gemma 2 / 3 block (the local twin of the Bridge's spec) with a stock core attention. Gemma 3: Megatron's
    local core, each layer given its window as the Bridge's ``Gemma3TEDotProductAttention`` gives it
    (``(window - 1, 0)`` on local layers, none on every sum(interleaved_attn_pattern)-th): stock's own
    sliding-window mask. Gemma 2: the Bridge's own ``Gemma2DotProductAttention`` (unfused, local modules)."""
    import copy

    from megatron.bridge.models.gemma import gemma2_provider
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_tree.cpu.megatron_core import patch_module

    patch_module(gemma2_provider)  # its sliding-window mask is made with device="cuda": the CPU layer's torch view
    Gemma2DotProductAttention = gemma2_provider.Gemma2DotProductAttention

    class StockGemma3Core(DotProductAttention):
        def __init__(self, config, layer_number, *args, **kwargs):
            config = copy.copy(config)
            local = layer_number % sum(config.interleaved_attn_pattern) != 0
            config.window_size = (config.window_size - 1, 0) if local else None
            super().__init__(config, layer_number, *args, **kwargs)

    block = copy.deepcopy(block)
    for layer in {id(layer): layer for layer in block.layer_specs}.values():  # (one spec object for every layer)
        sub = layer.submodules.self_attention.submodules
        stock = {"TreeGemma3DotProductAttention": StockGemma3Core,
                 "TreeGemma2DotProductAttention": Gemma2DotProductAttention}[sub.core_attention.__name__]
        sub.core_attention = stock
    return block


def _build(bridge, stock: bool = False):
    from megatron_tree import bridge as tb

    provider = _cpu_provider(bridge, stock)
    if stock and type(provider).__name__ == "FalconH1ModelProvider":
        model = _stock_falcon_h1(provider)
    else:
        model = provider.provide().to(torch.float64)
    tb.load_hf_weights(bridge, [model])
    return model


def _stock_falcon_h1(provider):
    """The Bridge's own ``FalconH1Model`` on CPU in float64: its stack's final norm (transformer-engine's TENorm,
    named in its module) built as the local twin, and its parallel layers' residual stream kept at float64 (the
    Bridge casts it to fp32, ``residual_in_fp32``, which would narrow a float64 model; the tree keeps fp32 or wider)."""
    from megatron.bridge.models.falcon_h1.modeling_falconh1 import falconh1_block

    from megatron_tree.bridge.local_twins import local_norm

    te_norm, falconh1_block.TENorm = falconh1_block.TENorm, local_norm(False)
    try:
        model = provider.provide().to(torch.float64)
    finally:
        falconh1_block.TENorm = te_norm
    for layer in model.decoder.layers:
        layer.residual_in_fp32 = False
    return model


def _families_body(root: str) -> dict:
    from dist import init_megatron

    init_megatron(kernels=True)
    from megatron_tree import bridge as tb
    from megatron_tree.cpu import dsa as cpu_dsa
    from megatron_tree.tree import Sample, pack
    from per_sample import SAMPLES, stock_logprobs, tree_logprobs

    cpu_dsa.enable()
    from megatron_tree.megatron.router_precision import widen_router_scores

    widen_router_scores(True)  # route scores at float64 on both sides (stock scores them in fp32)
    out = {}
    mbs = pack([Sample(tokens=s) for s in SAMPLES], 256)
    for fam in hf_tiny.FAMILIES + ("glm5_dense",):
        path = f"{root}/{fam}"
        bridge = tb.auto_bridge(path)
        tree = _build(bridge)
        with torch.no_grad():
            lp = {k: float(v) for k, v in tree_logprobs(tree, mbs).items()}
        res = {"tree_class": type(tree).__name__, "hf": hf_tiny.hf_logprobs(path, SAMPLES), "tree": lp,
               "attention": sorted({type(m).__name__ for m in tree.modules() if type(m).__name__.endswith("Attention")})}
        if fam == "glm5":
            res["hf_stable_ties"] = hf_tiny.hf_logprobs(path, SAMPLES, stable_dsa_ties=True)
        if fam == "gpt_oss":  # the same weights with plain RoPE: YaRN must matter on these records
            res["hf_plain_rope"] = hf_tiny.hf_logprobs(f"{root}/gpt_oss_plain_rope", SAMPLES)
        if fam == "gemma2":  # the same weights without the soft-caps: they must matter
            res["hf_no_softcap"] = hf_tiny.hf_logprobs(f"{root}/gemma2_no_softcap", SAMPLES)
            res["layers"] = [(type(layer.self_attention.core_attention).__name__,
                              layer.self_attention.core_attention.window, layer.self_attention.core_attention.softcap)
                             for layer in tree.decoder.layers]
        if fam == "falcon_h1":  # the same weights with every MuP multiplier 1: they must matter
            res["hf_no_multipliers"] = hf_tiny.hf_logprobs(f"{root}/falcon_h1_no_multipliers", SAMPLES)
            res["layers"] = sorted({type(m).__name__ for layer in tree.decoder.layers for m in layer.modules()
                                    if "Falcon" in type(m).__name__ or "Tree" in type(m).__name__})
        if fam == "gemma3":  # the same weights with a window wider than every record: the window must matter
            res["hf_wide_window"] = hf_tiny.hf_logprobs(f"{root}/gemma3_wide_window", SAMPLES)
            res["layers"] = [(type(layer.self_attention.core_attention).__name__,
                              layer.self_attention.core_attention.window) for layer in tree.decoder.layers]
        if fam in STOCK:
            stock = _build(bridge, stock=True)
            with torch.no_grad():
                res["stock"] = {k: float(v) for k, v in stock_logprobs(stock, SAMPLES).items()}
            res["stock_class"] = type(stock).__name__
        out[fam] = res
    # round trip: a gradient step on the tree model, saved to HF, reloaded by transformers
    bridge = tb.auto_bridge(f"{root}/qwen3_next")
    tree = _build(bridge)
    lp = tree_logprobs(tree, mbs)
    torch.stack(list(lp.values())).sum().backward()
    with torch.no_grad():
        for p in tree.parameters():
            p.sub_(0.05 * p.grad)
        trained = {k: float(v) for k, v in tree_logprobs(tree, mbs).items()}
    tb.save_hf_pretrained(bridge, [tree], f"{root}/saved")
    out["round_trip"] = {"before": {k: float(v) for k, v in lp.items()}, "after": trained,
                         "hf": hf_tiny.hf_logprobs(f"{root}/saved", SAMPLES)}
    # the RL API with a Bridge-built model (Nemotron-H: Mamba-2 layers), forward only (old log-probs)
    from megatron_tree import rl

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # Megatron keeps the MoE aux-loss scale in a class attribute, shaped by the first model that set it;
    # this process built other families before (one model per process in real runs)
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    bridge = tb.auto_bridge(f"{root}/nemotron_h")
    tree = _build(bridge)
    mbs_rl = rl.build_microbatches(rl.RolloutBatch.from_lists(SAMPLES), 16, vocab_size=96)  # several microbatches
    outputs = rl.forward_backward(tree, mbs_rl, loss="sft", forward_only=True)
    out["rl"] = {(i, t + 1): float(v) for i, row in enumerate(outputs.per_rollout("logprobs"))
                 for t, v in enumerate(row)}
    # refusals
    errors = {}
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.use_transformer_engine_full_layer_spec = True
    try:
        tb.tree_provider(provider)
    except tb.TreeProviderError as e:
        errors["te_full_layer"] = str(e)
    try:
        _build(tb.auto_bridge(f"{root}/nemotron_h_transformers_names"))
    except tb.HFWeightsError as e:
        errors["unloaded"] = str(e)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for fam in hf_tiny.FAMILIES:
        hf_tiny.make(fam, root / fam)
    hf_tiny.make("glm5", root / "glm5_dense", index_topk=32)  # top-k over every key of every sample
    hf_tiny.make("nemotron_h", root / "nemotron_h_transformers_names", nvidia_names=False)
    hf_tiny.make("gpt_oss", root / "gpt_oss_plain_rope", rope_parameters=dict(rope_type="default", rope_theta=150000.0))
    hf_tiny.make("gemma3", root / "gemma3_wide_window", sliding_window=64)
    hf_tiny.make("gemma2", root / "gemma2_no_softcap", attn_logit_softcapping=None, final_logit_softcapping=None)
    hf_tiny.make("falcon_h1", root / "falcon_h1_no_multipliers", embedding_multiplier=1.0, lm_head_multiplier=1.0,
                 key_multiplier=1.0, attention_in_multiplier=1.0, attention_out_multiplier=1.0, ssm_in_multiplier=1.0,
                 ssm_out_multiplier=1.0, mlp_multipliers=[1.0, 1.0], ssm_multipliers=[1.0] * 5)
    return run_distributed(_families_body, 1, str(root), timeout=1200)[0]


def _max_rel(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b) and len(a) > 0
    return max(abs(a[k] - b[k]) / max(1.0, abs(b[k])) for k in a)


@pytest.mark.parametrize("fam", [f for f in hf_tiny.FAMILIES if f != "glm5"] + ["glm5_dense"])
def test_tree_model_from_hf_equals_transformers_per_sample(families, fam):
    res = families[fam]
    assert res["tree_class"] == {"nemotron_h": "TreeMambaModel", "falcon_h1": "TreeFalconH1Model"}.get(fam, "TreeGPTModel")
    err = _max_rel(res["tree"], res["hf"])
    print(f"\n{fam}: tree vs transformers max rel {err:.1e} over {len(res['hf'])} occurrences")
    assert err <= 1e-5, err


@pytest.mark.parametrize("fam", STOCK)
def test_tree_model_from_hf_equals_stock_megatron_per_sample(families, fam):
    res = families[fam]
    assert res["stock_class"] in ("GPTModel", "HybridModel", "FalconH1Model")
    err = _max_rel(res["tree"], res["stock"])
    print(f"\n{fam}: tree vs stock Megatron-Core per sample max rel {err:.1e}")
    assert err <= STOCK_TOL.get(fam, 1e-12), err


def test_gpt_oss_yarn_is_applied_on_the_tree(families):
    """gpt-oss's YaRN (factor 32 over 4096 positions; the tree indexes stock's YaRN table by depth, stock's
    attention applies its attention factor): transformers with plain RoPE on the same weights is far away."""
    res = families["gpt_oss"]
    plain = _max_rel(res["tree"], res["hf_plain_rope"])
    print(f"\ngpt-oss tree vs transformers with plain RoPE (same weights): max rel {plain:.1e}")
    assert plain > 1e-3, plain


def test_gemma3_keeps_its_local_and_global_layers(families):
    """Gemma 3 (the Bridge's own TE-only layer spec, built from its local twin): layers 1-5 attend within 4
    positions of depth, layer 6 globally, each with its own rotary table; transformers with a window wider
    than every record (same weights) is far away, so the window is what the tree reproduces."""
    res = families["gemma3"]
    assert res["layers"] == [("TreeGemma3DotProductAttention", 4)] * 5 + [("TreeGemma3DotProductAttention", None)]
    wide = _max_rel(res["tree"], res["hf_wide_window"])
    print(f"\nGemma 3 tree vs transformers with a 64-token window (same weights): max rel {wide:.1e}")
    assert wide > 1e-2, wide


def test_gemma2_keeps_its_windows_and_soft_caps(families):
    """Gemma 2 (the Bridge's own spec and core attention, built from local twins and the tree's Gemma 2 core):
    odd layers within 4 positions of depth, even ones global, the attention logit soft-cap on every layer and
    the final one on the output; transformers without the soft-caps (same weights) is far away."""
    res = families["gemma2"]
    assert res["layers"] == [("TreeGemma2DotProductAttention", 4, 0.5), ("TreeGemma2DotProductAttention", None, 0.5)] * 2
    off = _max_rel(res["tree"], res["hf_no_softcap"])
    print(f"\nGemma 2 tree vs transformers without soft-caps (same weights): max rel {off:.1e}")
    assert off > 1e-3, off


def test_falcon_h1_keeps_its_parallel_layers_and_multipliers(families):
    """Falcon-H1 (the Bridge's own FalconH1Model: Mamba-2 and attention side by side in every layer, MuP
    multipliers on the embedding, both mixers' inputs and outputs, the mixer's z / x / B / C / dt parts, the keys,
    the MLP and the logits): built from the tree's Falcon classes, and transformers with every multiplier 1 (same
    weights) is far away, so the multipliers are what the tree reproduces."""
    res = families["falcon_h1"]
    assert res["layers"] == ["FalconH1MLP", "FalconH1SelfAttention", "TreeDotProductAttention", "TreeFalconH1Layer",
                             "TreeFalconH1MambaMixer"], res["layers"]
    off = _max_rel(res["tree"], res["hf_no_multipliers"])
    print(f"\nFalcon-H1 tree vs transformers with every multiplier 1 (same weights): max rel {off:.1e}")
    assert off > 1e-2, off


def test_olmoe_keeps_its_own_attention_on_the_local_path(families):
    """OLMoE's q / k norms span all heads (its own attention class in the Bridge's TE-only spec): the CPU
    path builds the local twin of that spec (the same class on Megatron's local modules), not the generic
    local spec, and its experts load by the sequential names the Bridge maps only grouped-GEMM style."""
    assert "OLMoESelfAttention" in families["olmoe"]["attention"], families["olmoe"]["attention"]


def test_glm5_sparse_topk_differs_from_transformers_only_by_its_tie_rule(families):
    """GLM-5 with a sparse top-k (4 of up to 14 keys): transformers' GLM-5 and the tree model (= stock
    Megatron-Core's DSA as the Bridge configures it, per sample) differ, and the whole difference is how
    ``torch.topk`` orders keys whose index scores tie exactly (ReLU zeroes every head's score; 19 of
    the 102 sparse query rows here tie at the k-th place, all at 0): with transformers' selection
    breaking ties by the lowest key index, our rule, they agree as closely as with a dense top-k."""
    res = families["glm5"]
    err = _max_rel(res["tree"], res["hf"])
    stable = _max_rel(res["tree"], res["hf_stable_ties"])
    dense = _max_rel(families["glm5_dense"]["tree"], families["glm5_dense"]["hf"])
    print(f"\nGLM-5 tree vs transformers, sparse top-k 4: torch.topk ties {err:.2e}, lowest-index ties {stable:.1e}; "
          f"dense top-k {dense:.1e}")
    assert dense <= 1e-5 and stable <= 1e-5 and err > 1e-3, (dense, stable, err)


def test_trained_tree_model_saved_to_hf_reloads_in_transformers(families):
    rt = families["round_trip"]
    moved = max(abs(rt["after"][k] - rt["before"][k]) for k in rt["after"])
    err = _max_rel(rt["hf"], rt["after"])
    print(f"\nround trip (Qwen3-Next): the step moved log-probs by up to {moved:.2e}; transformers' reload vs "
          f"the trained tree model max rel {err:.1e}")
    assert moved > 1e-3 and err <= 1e-5, (moved, err)


def test_rl_api_takes_a_bridge_built_model(families):
    """``megatron_tree.rl`` (RolloutBatch, build_microbatches at a budget of 16 rows, forward_backward
    forward-only, per-rollout outputs) on the Bridge-built Nemotron-H tree model: transformers' log-probs."""
    err = _max_rel(families["rl"], families["nemotron_h"]["hf"])
    print(f"\nrl.forward_backward on the Bridge-built Nemotron-H vs transformers: max rel {err:.1e}")
    assert err <= 1e-5, err


def test_settings_that_undo_the_swap_and_unloaded_weights_are_refused(families):
    errors = families["errors"]
    assert "use_transformer_engine_full_layer_spec=True" in errors["te_full_layer"], errors
    assert "embedding.word_embeddings.weight" in errors["unloaded"], errors


def test_score_hf_model_equals_transformers_per_record(tmp_path):
    """``megatron-tree score --hf-model`` (CLI, one rank, float64) on a Nemotron-H checkpoint (Mamba-2,
    attention, MLP layers): every record's per-target log-probs equal `transformers`' own, record by
    record; a model-size flag beside --hf-model is refused before any rank starts."""
    import json
    import subprocess
    import sys

    import pyarrow.parquet as pq
    from per_sample import SAMPLES

    path = tmp_path / "nemotron_h"
    hf_tiny.make("nemotron_h", path)
    data = tmp_path / "records.jsonl"
    masks = [[0] * min(3, len(s) - 1) + [1] * (len(s) - min(3, len(s) - 1)) for s in SAMPLES]  # prompts masked
    data.write_text("".join(json.dumps({"tokens": s, "loss_mask": m}) + "\n" for s, m in zip(SAMPLES, masks)))
    cmd = [sys.executable, "-m", "megatron_tree", "score", "--hf-model", str(path), "--data", str(data),
           "--out", str(tmp_path / "scores.parquet"), "--dtype", "float64", "--nproc", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rows = pq.read_table(tmp_path / "scores.parquet").to_pylist()
    ref = hf_tiny.hf_logprobs(path, SAMPLES)
    assert [row["record"] for row in rows] == list(range(len(SAMPLES)))
    worst = 0.0
    for i, (row, mask) in enumerate(zip(rows, masks)):
        targets = [t for t in range(1, len(mask)) if mask[t]]
        assert len(row["logprobs"]) == len(targets), (i, row)
        worst = max([worst] + [abs(a - ref[(i, t)]) / max(1.0, abs(ref[(i, t)])) for a, t in zip(row["logprobs"], targets)])
    print(f"\nscore --hf-model (Nemotron-H) vs transformers per record: max rel {worst:.1e}")
    assert worst <= 1e-5, worst
    bad = subprocess.run(cmd + ["--num-layers", "4"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--num-layers: the architecture comes from --hf-model" in bad.stderr, bad.stderr[-2000:]


def _cli(*argv, timeout=600):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "megatron_tree", *argv], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r


def test_train_hf_model_under_tp2_and_ep2_save_hf_reloads_in_transformers(tmp_path):
    """``megatron-tree train --hf-model`` (Qwen3-MoE) for one step under DP2 + EP2 and under TP2 + SP, each
    with ``--save`` and ``--save-hf``: `transformers` reloading EP2's saved HF directory gives, record by
    record, the log-probs ``megatron-tree score --hf-model PATH --load CKPT`` computes with EP2's trained
    Megatron checkpoint (the Bridge gathered the EP experts into the right HF tensors); TP2's saved
    directory (TP shards gathered) gives transformers the same model (float32 rounding: the two layouts
    train the same step); the step moved the model."""
    import json

    import pyarrow.parquet as pq
    from per_sample import SAMPLES

    path = tmp_path / "qwen3_moe"
    hf_tiny.make("qwen3_moe", path)
    data = tmp_path / "records.jsonl"
    data.write_text("".join(json.dumps({"tokens": s}) + "\n" for s in SAMPLES))
    before = hf_tiny.hf_logprobs(path, SAMPLES)
    trained = {}
    for name, layout in (("ep2", ["--expert-model-parallel-size", "2"]),
                         ("tp2", ["--tensor-model-parallel-size", "2", "--sequence-parallel"])):
        run = tmp_path / name
        _cli("train", "--hf-model", str(path), "--tree-data-path", str(data), "--tree-global-batch-samples",
             str(len(SAMPLES)), "--train-iters", "1", "--lr", "0.05", "--nproc", "2", "--save", str(run / "ckpt"),
             "--save-hf", str(run / "hf"), "--quiet", *layout)
        trained[name] = hf_tiny.hf_logprobs(run / "hf", SAMPLES)
    run = tmp_path / "ep2"
    _cli("score", "--hf-model", str(path), "--load", str(run / "ckpt"), "--data", str(data), "--out",
         str(run / "scores.parquet"), "--nproc", "1", "--quiet")
    rows = pq.read_table(run / "scores.parquet").to_pylist()
    ours = {(i, t + 1): v for i, row in enumerate(rows) for t, v in enumerate(row["logprobs"])}
    err, moved = _max_rel(ours, trained["ep2"]), max(abs(trained["ep2"][k] - before[k]) for k in before)
    layouts = _max_rel(trained["tp2"], trained["ep2"])
    print(f"\nEP2: trained tree model (score --load) vs transformers' reload of --save-hf: max rel {err:.1e}; the step "
          f"moved log-probs by up to {moved:.2e}; TP2's saved model vs EP2's in transformers: max rel {layouts:.1e}")
    assert err <= 1e-5 and moved > 1e-3 and layouts <= 1e-5, (err, moved, layouts)


def _safetensors(path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("family,kind", [("qwen3_moe", "aux_loss"), ("qwen3_next", "global_aux_loss")])
def test_train_hf_model_balancing_as_the_bridge_sets_it_equals_flat(tmp_path, family, kind):
    """``megatron-tree train --hf-model`` with the Bridge provider's own balancing (Qwen3-MoE: aux_loss 1e-3,
    Qwen3-Next: global_aux_loss 1e-3, as megatron-bridge 0.6.2 sets them) on prefix trees trains what the
    same step trains on the same samples packed flat (``--packing flat``; one microbatch each, so the aux
    losses see the same microbatch): every tensor's update, read back from ``--save-hf``, agrees to float32
    rounding. SGD, whose update is the gradient (Adam's first step, ``lr * g / (|g| + eps)``, turns float32
    noise on an expert's near-zero gradient elements into a 2e-2 difference of that element's update)."""
    import json

    from per_sample import SAMPLES

    path = tmp_path / family
    hf_tiny.make(family, path)
    data = tmp_path / "records.jsonl"
    data.write_text("".join(json.dumps({"tokens": s}) + "\n" for s in SAMPLES))
    before = _safetensors(path)
    updates = {}
    for packing in ("tree", "flat"):
        out = tmp_path / packing
        _cli("train", "--hf-model", str(path), "--tree-data-path", str(data), "--tree-global-batch-samples",
             str(len(SAMPLES)), "--train-iters", "1", "--lr", "0.05", "--optimizer", "sgd", "--nproc", "1",
             "--packing", packing,
             "--tree-max-tokens-per-mb", "128", "--save-hf", str(out), "--quiet", "--metrics-json",
             str(tmp_path / f"{packing}.json"))
        after = _safetensors(out)
        updates[packing] = {n: after[n].double() - before[n].double() for n in before}
        with open(tmp_path / f"{packing}.json") as f:
            hist = json.load(f)["history"]
        assert len(hist) == 1
    routers = [n for n in before if n.endswith("mlp.gate.weight")]
    assert routers, sorted(before)[:20]
    rel = {n: float((updates["tree"][n] - updates["flat"][n]).abs().max() / updates["flat"][n].abs().max())
           for n in before if updates["flat"][n].abs().max() > 0}
    worst = max(rel.values())
    print(f"\n{family} ({kind} as the Bridge sets it): tree vs flat step, max rel. update difference {worst:.1e}",
          sorted(rel.items(), key=lambda kv: -kv[1])[:6])
    assert worst <= 1e-4, worst
    assert all(updates["flat"][n].abs().max() > 0 for n in routers)
