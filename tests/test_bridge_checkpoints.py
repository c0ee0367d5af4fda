"""Checkpoints users bring, through the CLI as they run it (``megatron-tree score / train --hf-model``):
a checkpoint whose model code ships with it (``--trust-remote-code``), and ``--save-hf`` that cannot lose
a run (weights first, the source's tokenizer files copied as they are, an unwritable target refused
before the first step, a quiet run quiet).

Oracles: `transformers` itself, per record (float64); byte equality of the copied files.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

import hf_tiny  # tests/hf_tiny.py
from per_sample import SAMPLES  # tests/per_sample.py

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron.bridge") is None or importlib.util.find_spec("transformers") is None,
    reason="megatron-bridge / transformers are not installed: the extra 'megatron-tree[hf]' needs Python 3.12 and "
           "megatron-core >= 0.19; `make test-latest` installs it")


def _run(*argv, timeout=600):
    return subprocess.run([sys.executable, "-m", "megatron_tree", *argv], capture_output=True, text=True,
                          timeout=timeout)


def _ok(*argv, timeout=600):
    r = _run(*argv, timeout=timeout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r


def _records(tmp_path):
    data = tmp_path / "records.jsonl"
    data.write_text("".join(json.dumps({"tokens": s}) + "\n" for s in SAMPLES))
    return data


def _score(path, data, out, *extra) -> dict:
    import pyarrow.parquet as pq

    _ok("score", "--hf-model", str(path), "--data", str(data), "--out", str(out), "--dtype", "float64",
        "--nproc", "1", "--quiet", *extra)
    rows = pq.read_table(out).to_pylist()
    return {(i, t + 1): v for i, row in enumerate(rows) for t, v in enumerate(row["logprobs"])}


def _max_rel(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b) and len(a) > 0
    return max(abs(a[k] - b[k]) / max(1.0, abs(b[k])) for k in a)


def test_remote_code_checkpoint_scores_with_trust_remote_code_and_is_refused_without(tmp_path):
    """A MiMo-style checkpoint (model type unknown to transformers, its classes in the checkpoint's own
    files) with its MTP layer (whose norms megatron-bridge maps by transformer-engine names only: the
    local modules' names are taught on a host without it): without ``--trust-remote-code`` refused before
    any rank starts, in transformers' words; with it, ``score --hf-model`` equals transformers (run with
    ``trust_remote_code=True``; it ignores the MTP layer) record by record."""
    path = hf_tiny.remote_code_mimo(tmp_path / "mimo", mtp=True)
    data = _records(tmp_path)
    bad = _run("score", "--hf-model", str(path), "--data", str(data), "--out", str(tmp_path / "bad.parquet"),
               "--nproc", "1", "--quiet", timeout=300)
    assert bad.returncode != 0
    assert "--trust-remote-code" in bad.stderr and "auto_map" in bad.stderr and "trust_remote_code" in bad.stderr, \
        bad.stderr[-3000:]
    assert "rank 0" not in bad.stderr and "Traceback" not in bad.stderr, bad.stderr[-3000:]  # refused up front
    ours = _score(path, data, tmp_path / "scores.parquet", "--trust-remote-code")
    ref = hf_tiny.hf_logprobs(path, SAMPLES, trust_remote_code=True)
    err = _max_rel(ours, ref)
    print(f"\nMiMo-style remote-code checkpoint: score --hf-model --trust-remote-code vs transformers max rel {err:.1e}")
    assert err <= 1e-5, err


def _slow_tokenizer_files(path) -> dict:
    """What a checkpoint with a slow sentencepiece tokenizer holds beside its weights (the bytes of
    ``tokenizer.model`` are opaque here: nothing may parse them on the save path)."""
    files = {"tokenizer.model": bytes(range(256)) * 4,
             "tokenizer_config.json": json.dumps({"tokenizer_class": "LlamaTokenizer", "add_bos_token": True,
                                                  "model_max_length": 128}).encode(),
             "special_tokens_map.json": json.dumps({"bos_token": "<s>", "eos_token": "</s>"}).encode()}
    for name, blob in files.items():
        (path / name).write_bytes(blob)
    return files


def test_save_hf_saves_weights_then_copies_the_sources_files(tmp_path):
    """``train --hf-model --save-hf`` on a Llama 3 checkpoint with no tokenizer files, on one with a slow
    sentencepiece tokenizer (which the Bridge's own save re-instantiates, and where sentencepiece is not
    installed lost the trained weights), on gpt-oss (YaRN, sinks, windows, biased MoE) and Gemma 3 (local /
    global layers, post-norms, tied embeddings): each saves; the tokenizer files are the source's bytes; the saved
    directory is a model transformers loads, equal to the tree model scoring it (the sentencepiece source, the same
    Llama weights' path as the plain one, is not scored again); the step moved it; the quiet run prints no library
    tracebacks."""
    data = _records(tmp_path)
    for name in ("plain", "sentencepiece", "gpt_oss", "gemma3"):
        src = tmp_path / f"src_{name}"
        hf_tiny.make(name if name in ("gpt_oss", "gemma3") else "llama", src)
        files = _slow_tokenizer_files(src) if name == "sentencepiece" else {}
        out = tmp_path / f"saved_{name}"
        r = _ok("train", "--hf-model", str(src), "--tree-data-path", str(data), "--tree-global-batch-samples",
                str(len(SAMPLES)), "--train-iters", "1", "--lr", "0.05", "--optimizer", "sgd", "--nproc", "1",
                "--save-hf", str(out), "--quiet")
        assert "Traceback" not in r.stderr and "FP8GlobalStateManager" not in r.stderr, r.stderr[-3000:]
        assert (out / "config.json").is_file() and list(out.glob("*.safetensors")), sorted(p.name for p in out.iterdir())
        for fname, blob in files.items():
            assert (out / fname).read_bytes() == blob, fname
        hf_saved = hf_tiny.hf_logprobs(out, SAMPLES)
        before = hf_tiny.hf_logprobs(src, SAMPLES)
        moved = max(abs(hf_saved[k] - before[k]) for k in before)
        if name == "sentencepiece":  # the same Llama weights' path as "plain": its point is the tokenizer files
            print(f"\n--save-hf (sentencepiece source): saved and reloaded; the step moved log-probs by up to {moved:.2e}")
            assert moved > 1e-3, moved
            continue
        ours = _score(out, data, tmp_path / f"scores_{name}.parquet")
        err = _max_rel(ours, hf_saved)
        print(f"\n--save-hf ({name} source): the step moved log-probs by up to {moved:.2e}; score --hf-model of the "
              f"saved directory vs transformers' reload max rel {err:.1e}")
        assert moved > 1e-3 and err <= 1e-5, (moved, err)


def test_save_hf_that_cannot_be_written_is_refused_before_the_first_step(tmp_path):
    src = tmp_path / "src"
    hf_tiny.make("llama", src)
    data = _records(tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    common = ["train", "--hf-model", str(src), "--tree-data-path", str(data), "--tree-global-batch-samples",
              str(len(SAMPLES)), "--train-iters", "1", "--nproc", "1", "--quiet"]
    for target, why in ((blocker, "is a file, not a directory"), (blocker / "sub", "cannot be written"),
                        (src, "is the --hf-model checkpoint directory itself")):
        r = _run(*common, "--save-hf", str(target), timeout=300)
        assert r.returncode != 0 and why in r.stderr, (target, r.stderr[-3000:])
        assert "rank 0" not in r.stderr, r.stderr[-3000:]


def _config_only(path, config: dict):
    """A checkpoint directory holding only its config.json: all the refusals below read (no rank starts)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


_TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, num_hidden_layers=2, max_position_embeddings=128)


@pytest.mark.parametrize("name,config,named", [
    ("gemma3_layer_types", dict(_TINY, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                                sliding_window=4, layer_types=["full_attention", "sliding_attention"]),
     "layer_types=['full_attention', 'sliding_attention'] (megatron-bridge builds ['sliding_attention', "
     "'sliding_attention']"),
    ("gemma3_softcap", dict(_TINY, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], sliding_window=4,
                            final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
    ("gemma3_vision", dict(_TINY, model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]),
     "Gemma 3's vision-language model"),
    ("gemma2_layer_types", dict(_TINY, model_type="gemma2", architectures=["Gemma2ForCausalLM"],
                                layer_types=["full_attention", "sliding_attention"]),
     "odd layers local"),
    ("falcon_h1_bias", dict(_TINY, model_type="falcon_h1", architectures=["FalconH1ForCausalLM"],
                            mamba_proj_bias=True), "mamba_proj_bias=True (megatron-bridge's Falcon-H1 maps no such bias)"),
    ("falcon_h1_dt_limit", dict(_TINY, model_type="falcon_h1", architectures=["FalconH1ForCausalLM"],
                                time_step_limit=[0.0, 0.5]), "time_step_limit=[0.0, 0.5]"),
    ("llama3_rope", dict(_TINY, model_type="llama", architectures=["LlamaForCausalLM"],
                         rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=16, rope_theta=500000.0)),
     "original_max_position_embeddings=16 (built as 8192)"),
    ("gpt_oss_yarn", dict(_TINY, model_type="gpt_oss", architectures=["GptOssForCausalLM"],
                          rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                               original_max_position_embeddings=16, rope_theta=150000.0)),
     "factor=4.0 (built as 32.0)"),
])
def test_checkpoints_the_tree_cannot_build_are_refused_before_any_rank_starts(tmp_path, name, config, named):
    path = _config_only(tmp_path / name, config)
    data = _records(tmp_path)
    r = _run("score", "--hf-model", str(path), "--data", str(data), "--out", str(tmp_path / "x.parquet"),
             "--nproc", "1", "--quiet", timeout=300)
    assert r.returncode != 0 and named in r.stderr and f"model_type {config['model_type']!r}" in r.stderr, \
        r.stderr[-3000:]
    assert "rank 0" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]


def test_deepseek_v3_with_its_mtp_layer_scores_and_trains(tmp_path):
    """DeepSeek-V3 as published, with its MTP layer (``num_nextn_predict_layers`` 1, the layer's tensors under
    ``model.layers.2.*``), on a host without transformer-engine too (the Bridge's MTP block spec is TE
    only; the tree builds its own for the host): ``score --hf-model`` equals transformers (which ignores
    the MTP layer) record by record; one ``train --hf-model --save-hf`` step trains the MTP layer (its
    tensors move: the MTP loss reaches them) and saves every tensor of the checkpoint."""
    from safetensors.torch import load_file

    src = hf_tiny.deepseek_v3_with_mtp(tmp_path / "src")
    data = _records(tmp_path)
    ours = _score(src, data, tmp_path / "scores.parquet")
    err = _max_rel(ours, hf_tiny.hf_logprobs(src, SAMPLES))
    print(f"\nDeepSeek-V3 with its MTP layer: score --hf-model vs transformers max rel {err:.1e}")
    assert err <= 1e-5, err
    out = tmp_path / "saved"
    _ok("train", "--hf-model", str(src), "--tree-data-path", str(data), "--tree-global-batch-samples",
        str(len(SAMPLES)), "--train-iters", "1", "--lr", "0.05", "--optimizer", "sgd", "--nproc", "1",
        "--save-hf", str(out), "--quiet")
    before, after = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(before) == sorted(after)
    mtp = [k for k in before if k.startswith("model.layers.2.")]
    moved = {k: float((after[k] - before[k]).abs().max()) for k in mtp}
    assert mtp and all(v > 0 for k, v in moved.items() if k.endswith(("eh_proj.weight", "enorm.weight",
                                                                          "hnorm.weight"))), moved


class _FamilyProvider:
    """Stands for a family provider (Gemma's) whose ``provide()`` calls its parent's, in another module."""

    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        return super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


def _hierarchy_body(path: str) -> dict:
    from dist import init_megatron

    init_megatron()
    from megatron_tree import bridge as tb
    from megatron_tree.bridge.cpu import use_local_specs

    provider = tb.auto_bridge(path).to_megatron_provider(load_weights=False)
    family = type("Qwen3FamilyProvider", (_FamilyProvider, type(provider)), {})
    provider.__class__ = family
    tree = tb.tree_provider(provider)
    tree.finalize()
    out = {"class": type(tree.provide()).__name__}
    custom = tb.auto_bridge(path).to_megatron_provider(load_weights=False)
    from megatron.core.extensions.transformer_engine import TELinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    # a family's own spec naming a transformer-engine module that has no local twin
    custom.transformer_layer_spec = lambda config, vp_stage=None: ModuleSpec(
        module=TransformerLayer, submodules=TransformerLayerSubmodules(self_attention=TELinear))
    try:
        use_local_specs(custom)
    except ValueError as e:
        out["custom_spec"] = str(e)
    return out


def test_a_provider_whose_provide_calls_its_parents_builds_the_tree_model_and_custom_specs_are_refused(tmp_path):
    """The tree swap reaches every module whose ``provide()`` runs: a family provider calling
    ``super().provide()`` (Gemma's way) builds `TreeGPTModel`. On a host without transformer-engine, a
    family's own layer spec is refused by name rather than replaced by the generic local spec."""
    from dist import run_distributed
    from megatron_tree.ops.backend import module_available

    path = tmp_path / "qwen3"
    hf_tiny.make("qwen3", path)
    out = run_distributed(_hierarchy_body, 1, str(path), timeout=300)[0]
    assert out["class"] == "TreeGPTModel", out
    if not module_available("transformer_engine"):
        assert "a family's own spec" in out.get("custom_spec", "") and "has no local twin" in out["custom_spec"], out
        assert "test_bridge_checkpoints" in out["custom_spec"], out


@pytest.mark.parametrize("family,layout", [("gemma3", ("--tensor-model-parallel-size", "2", "--sequence-parallel"))])
def test_gemma_scores_equal_transformers_under_tp_sp_and_cp(tmp_path, family, layout):
    """Gemma 3 under TP2 + SP (the local twins' column / row linears and post-norms split over TP ranks):
    ``score --hf-model`` equals transformers record by record. (Gemma 2 under tree CP 2 measured 2.0e-8 the same
    way; the soft-cap on every CP stage is checked against the whole layout in tests/test_cp_attention.py.)"""
    src = tmp_path / family
    hf_tiny.make(family, src)
    data = _records(tmp_path)
    ours = _score(src, data, tmp_path / "scores.parquet", "--nproc", "2", *layout)  # (the later --nproc counts)
    err = _max_rel(ours, hf_tiny.hf_logprobs(src, SAMPLES))
    print(f"\n{family} {' '.join(layout)}: score --hf-model vs transformers max rel {err:.1e}")
    assert err <= 1e-5, err


def test_falcon_h1_trains_under_tp_sp_saves_and_scores_under_cp(tmp_path):
    """Falcon-H1 (the Bridge's own FalconH1Model, built from the tree's Falcon classes): one ``train --hf-model``
    step under TP2 + SP with ``--save`` (a distributed checkpoint: the Bridge's Falcon layers leave replicated
    norms without their TP group, which the tree classes mend) and ``--save-hf``; ``score --load`` of that
    checkpoint under tree CP 2 (Mamba-2 heads and attention over the CP ranks) equals, record by record,
    transformers reloading the saved HF directory; the step moved the model."""
    import pyarrow.parquet as pq

    src = tmp_path / "falcon_h1"
    hf_tiny.make("falcon_h1", src)
    data = _records(tmp_path)
    before = hf_tiny.hf_logprobs(src, SAMPLES)
    _ok("train", "--hf-model", str(src), "--tree-data-path", str(data), "--tree-global-batch-samples",
        str(len(SAMPLES)), "--train-iters", "1", "--lr", "0.05", "--nproc", "2", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--save", str(tmp_path / "ckpt"), "--save-hf", str(tmp_path / "hf"), "--quiet")
    trained = hf_tiny.hf_logprobs(tmp_path / "hf", SAMPLES)
    _ok("score", "--hf-model", str(src), "--load", str(tmp_path / "ckpt"), "--data", str(data), "--out",
        str(tmp_path / "scores.parquet"), "--nproc", "2", "--context-parallel-size", "2", "--quiet")
    rows = pq.read_table(tmp_path / "scores.parquet").to_pylist()
    ours = {(i, t + 1): v for i, row in enumerate(rows) for t, v in enumerate(row["logprobs"])}
    err, moved = _max_rel(ours, trained), max(abs(trained[k] - before[k]) for k in before)
    print(f"\nFalcon-H1: TP2 + SP step, score --load under CP 2 vs transformers' reload of --save-hf: max rel {err:.1e}; "
          f"the step moved log-probs by up to {moved:.2e}")
    assert err <= 1e-5 and moved > 1e-2, (err, moved)
