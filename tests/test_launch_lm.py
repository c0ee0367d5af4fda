"""`megatron-tree launch`: Megatron-LM's real ``pretrain()`` with our hooks, on CPU.

The runs need ``megatron.training``: the megatron-core 0.19.x wheel ships it (``make test-latest``);
with 0.16.1 only a Megatron-LM core_v0.16.1 checkout on PYTHONPATH provides it, so there those tests
skip and say so. The launcher's own logic (flags, pre-flight errors, the pretrain() calling forms)
is tested on every stack with stubs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_tree.compat import lm_api, lm_cpu
from megatron_tree.training import launch_lm

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "pretrain_tree_gpt.py"
HYBRID = ROOT / "examples" / "pretrain_tree_hybrid.py"

needs_megatron_training = pytest.mark.skipif(
    not lm_api.have_megatron_training(),
    reason="megatron.training is not importable: the megatron-core 0.16.1 wheel lacks it (put a Megatron-LM "
           "core_v0.16.1 checkout on PYTHONPATH); `make test-latest` runs these on the 0.19.x wheel")


# ---------------------------------------------------------------------------------------------- launcher logic
def test_cpu_flags_are_added_unless_given():
    argv = ["--num-layers", "2", "--transformer-impl=local", "--rope-fusion", "--distributed-backend", "gloo"]
    out = lm_cpu.add_cpu_flags(argv)
    assert out[:len(argv)] == argv
    added = out[len(argv):]
    assert "--transformer-impl" not in added and "--no-rope-fusion" not in added  # given, or its opposite
    assert "--distributed-backend" not in added
    for flag in ("--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
                 "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--use-cpu-initialization"):
        assert added.count(flag) == 1, flag
    assert lm_cpu.add_cpu_flags(out) == out  # idempotent
    # every flag the issue lists for a CPU run is in the set
    flags = lm_cpu.add_cpu_flags([])
    assert flags[flags.index("--transformer-impl") + 1] == "local"
    assert flags[flags.index("--distributed-backend") + 1] == "gloo"


def test_build_command_plain_torchrun_with_cuda_worker_without():
    gpu = launch_lm.build_command(str(GPT), ["--x", "1"], nproc=4, cuda=True)
    assert gpu[1:3] == ["-m", "torch.distributed.run"] and gpu[-3:] == [str(GPT), "--x", "1"]
    assert "--nproc-per-node" in gpu and gpu[gpu.index("--nproc-per-node") + 1] == "4"
    assert launch_lm.WORKER_MODULE not in gpu and "--use-cpu-initialization" not in gpu
    cpu = launch_lm.build_command(str(GPT), ["--x", "1"], nproc=2, cuda=False)
    i = cpu.index("--module")
    assert cpu[i + 1] == launch_lm.WORKER_MODULE and cpu[i + 2:i + 5] == [str(GPT), "--x", "1"]
    assert "--use-cpu-initialization" in cpu and "--no-rope-fusion" in cpu
    with pytest.raises(ValueError, match="--nproc"):
        launch_lm.build_command(str(GPT), [], nproc=0)


def test_cli_launch_dry_run_and_missing_script(capsys):
    from megatron_tree.cli import main

    assert main(["launch", "--dry-run", "--nproc", "2", str(GPT), "--train-iters", "3"]) == 0
    out = capsys.readouterr().out
    assert "torch.distributed.run" in out and "--train-iters 3" in out
    assert main(["launch", str(ROOT / "examples" / "no_such_entry.py")]) == 2
    assert "no such Megatron-LM entry point" in capsys.readouterr().err


def test_cli_launch_without_megatron_training_says_what_to_install(monkeypatch, capsys):
    """The first thing a 0.16.1 user hits: Megatron-LM's trainer is not in that wheel."""
    from megatron_tree.cli import main

    monkeypatch.setitem(sys.modules, "megatron.training", None)  # import fails as on megatron-core 0.16.1
    assert not lm_api.have_megatron_training()
    assert main(["launch", str(GPT)]) == 2
    err = capsys.readouterr().err
    assert "megatron.training" in err and "core_v0.16.1" in err and "0.19" in err
    for dep in ("six", "pydantic", "pybind11", "triton"):  # Megatron-LM 0.16.1's extra dependencies
        assert dep in err


def test_missing_dependency_of_megatron_training_is_named(monkeypatch):
    """A checkout whose extra dependencies are missing fails inside its import: name the module."""
    import importlib

    real_import = importlib.import_module

    def fake_import(name, package=None):
        if name == "megatron.training":
            raise ModuleNotFoundError("No module named 'six'", name="six")
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    assert not lm_api.have_megatron_training()
    assert "No module named 'six'" in lm_api.megatron_training_import_error()


# ---------------------------------------------------------------------------------------------- pretrain() forms
def _stub_training(monkeypatch, pretrain):
    calls = []
    stub = types.ModuleType("megatron.training")
    stub.pretrain = pretrain(calls)
    monkeypatch.setitem(sys.modules, "megatron.training", stub)
    return calls


def test_pretrain_in_the_core_v0_16_1_form(monkeypatch):
    calls = _stub_training(monkeypatch, lambda calls: lambda *a, **k: calls.append((a, k)))
    lm_api.pretrain("tvt", "model", "type", "fwd", extra_args_provider="extra", args_defaults={"a": 1})
    assert calls == [(("tvt", "model", "type", "fwd"), {"extra_args_provider": "extra", "args_defaults": {"a": 1}})]


def test_pretrain_in_the_0_19_config_container_form(monkeypatch):
    """megatron-core 0.19's pretrain takes a config container first; the command line is parsed before."""

    def make(calls):
        def pretrain(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func,
                     model_provider=None, **kwargs):
            calls.append(("pretrain", cfg_container, train_valid_test_dataset_provider, model_type,
                          forward_step_func, model_provider, kwargs))
        return pretrain

    calls = _stub_training(monkeypatch, make)
    arguments = types.ModuleType("megatron.training.arguments")
    arguments.parse_and_validate_args = lambda extra_args_provider=None, args_defaults=None, **_: (
        calls.append(("parse", extra_args_provider, args_defaults)) or argparse.Namespace(parsed=True))
    utils = types.ModuleType("megatron.training.argument_utils")
    utils.pretrain_cfg_container_from_args = lambda args, model_cfg=None: ("cfg", args.parsed)
    monkeypatch.setitem(sys.modules, "megatron.training.arguments", arguments)
    monkeypatch.setitem(sys.modules, "megatron.training.argument_utils", utils)
    monkeypatch.setattr(lm_api, "use_prebuilt_dataset_helpers", lambda: calls.append(("helpers",)))
    lm_api.pretrain("tvt", "model", "type", "fwd", extra_args_provider="extra", args_defaults={"a": 1})
    assert calls == [("helpers",), ("parse", "extra", {"a": 1}),
                     ("pretrain", ("cfg", True), "tvt", "type", "fwd", "model", {})]


@needs_megatron_training
def test_prebuilt_dataset_helpers_replace_the_make_call():
    """0.19.x wheels ship helpers_cpp compiled but not its Makefile: pretrain() exited in initialize."""
    utils = __import__("megatron.core.datasets.utils", fromlist=["compile_helpers"])
    original = getattr(utils.compile_helpers, "__wrapped__", utils.compile_helpers)
    if lm_api._prebuilt_helpers_available():
        makefile = Path(utils.__file__).with_name("Makefile")
        if not makefile.exists():  # the wheel as shipped: the original cannot build
            with pytest.raises(SystemExit):
                original()
        assert lm_api.use_prebuilt_dataset_helpers() and lm_api.use_prebuilt_dataset_helpers()
        assert utils.compile_helpers() is None and utils.compile_helpers.__wrapped__ is original
        utils.compile_helpers = original  # leave the module as found
    else:  # a source checkout: nothing changes
        assert not lm_api.use_prebuilt_dataset_helpers()


# ---------------------------------------------------------------------------------------------- real pretrain()
COMMON = ["--tree-packing", "--tree-max-tokens-per-mb", "64", "--tree-global-batch-samples", "8",
          "--calculate-per-token-loss", "--micro-batch-size", "1", "--global-batch-size", "4",
          "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64", "--swiglu",
          "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
          "--disable-bias-linear", "--seq-length", "64", "--max-position-embeddings", "64", "--attention-dropout", "0",
          "--hidden-dropout", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
          # 128 rows under TP 1 and 2 alike (Megatron pads the vocabulary to a multiple of this x TP)
          "--make-vocab-size-divisible-by", "64",
          "--train-iters", "4", "--lr", "1e-3", "--lr-decay-style", "constant", "--weight-decay", "0.0",
          "--clip-grad", "1.0", "--seed", "1234", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0"]
MODELS = {
    "gpt": (GPT, ["--num-layers", "2"]),
    "hybrid": (HYBRID, ["--num-layers", "4", "--tree-hybrid-pattern", "MG*-", "--mamba-state-dim", "8",
                        "--mamba-head-dim", "8", "--mamba-num-groups", "2", "--linear-num-key-heads", "2",
                        "--linear-num-value-heads", "4", "--linear-key-head-dim", "8", "--linear-value-head-dim", "8"]),
}
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


def _write_data(path: Path, bad_line: int | None = None) -> Path:
    """12 prompt families x 4 completions (branching trees); optionally one malformed line."""
    rng = np.random.default_rng(0)
    lines = []
    for g in range(12):
        prompt = rng.integers(1, 100, int(rng.integers(4, 9))).tolist()
        for _ in range(4):
            comp = rng.integers(1, 100, int(rng.integers(2, 7))).tolist()
            lines.append(json.dumps({"tokens": prompt + comp, "loss_mask": [0] * len(prompt) + [1] * len(comp),
                                     "group": g}))
    if bad_line is not None:
        lines.insert(bad_line - 1, json.dumps({"tokens": [1, 2, "x"], "loss_mask": [0, 1, 1]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _launch(tmp: Path, name: str, script: Path, args: list, nproc: int = 2):
    """Run ``script`` through `megatron-tree launch`; returns (returncode, output, {iteration: loss})."""
    losses = tmp / f"losses_{name}"
    env = dict(os.environ, MTREE_LM_SCRIPT=str(script), MTREE_LM_LOSSES=str(losses))
    cmd = [sys.executable, "-m", "megatron_tree", "launch", "--nproc", str(nproc), str(ROOT / "tests" / "lm_entry.py"),
           *args]
    r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    sums: dict = {}
    for f in tmp.glob(f"losses_{name}.*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            s, n = sums.get(rec["iteration"], (0.0, 0))
            sums[rec["iteration"]] = (s + rec["loss_sum"], n + rec["num_tokens"])
    return r.returncode, out, {it: s / n for it, (s, n) in sorted(sums.items())}


def _check(rc, out, what):
    assert rc == 0, f"{what} failed:\n{out[-6000:]}"


@needs_megatron_training
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is for CPU-only hosts")
@pytest.mark.parametrize("model", sorted(MODELS))
def test_pretrain_dp2_resume_and_tp2_sp_on_cpu(model, tmp_path):
    """Megatron-LM's pretrain() with our hooks, 2 CPU ranks: an uninterrupted DP2 run (checkpoint at
    iteration 2); resumed as DP2 the next iterations are bit-identical; resumed as TP2 + SP (the
    checkpoint resharded) they agree to float32 rounding; flat packing (no prefix shared) gives the
    tree's losses too."""
    script, model_args = MODELS[model]
    data = _write_data(tmp_path / "train.jsonl")
    args = COMMON + model_args + ["--tree-data-path", str(data)]
    ckpt = ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    rc, out, full = _launch(tmp_path, "full", script, args + ckpt)
    _check(rc, out, "DP2 run")
    assert sorted(full) == [1, 2, 3, 4] and all(np.isfinite(v) for v in full.values())
    assert "iteration        4/       4" in out and "lm loss:" in out  # Megatron-LM's own log
    load = ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "2"]
    rc, out, dp2 = _launch(tmp_path, "resume_dp2", script, args + load)
    _check(rc, out, "DP2 resume")
    assert dp2 == {3: full[3], 4: full[4]}, (dp2, full)  # bit-identical continuation
    rc, out, tp2 = _launch(tmp_path, "resume_tp2", script, args + load + TP2_SP)
    _check(rc, out, "TP2+SP resume")
    assert sorted(tp2) == [3, 4]
    for it in (3, 4):
        assert tp2[it] == pytest.approx(full[it], rel=2e-6), (it, tp2, full)
    rc, out, flat = _launch(tmp_path, "flat", script, args + ["--tree-flat-packing"])
    _check(rc, out, "flat packing run")
    for it in (1, 2, 3, 4):
        assert flat[it] == pytest.approx(full[it], rel=2e-6), (it, flat, full)
    print(f"\n{model}: tree {full}\n{model}: flat {flat}\n{model}: resumed DP2 {dp2}, TP2+SP {tp2}")


@needs_megatron_training
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is for CPU-only hosts")
def test_pretrain_bad_data_line_stops_the_run_naming_file_and_line(tmp_path):
    script, model_args = MODELS["gpt"]
    data = _write_data(tmp_path / "train.jsonl", bad_line=6)
    rc, out, losses = _launch(tmp_path, "bad", script, COMMON + model_args + ["--tree-data-path", str(data)], nproc=1)
    assert rc != 0 and not losses
    assert f"{data}:6: tokens must be integers" in out, out[-4000:]


def test_examples_readme_documents_launch_cpu_recipe_and_dependencies():
    readme = (ROOT / "examples" / "README.md").read_text()
    assert "megatron-tree launch" in readme and "CPU recipe" in readme
    for flag, _, _ in lm_cpu.CPU_FLAGS:  # the flags the launcher adds are the documented ones
        assert flag in readme, flag
    for dep in ("six", "pydantic", "pybind11", "triton", "core_v0.16.1", "0.19"):
        assert dep in readme, dep
    assert "--make-vocab-size-divisible-by" in readme and "grpo" in readme.lower()
