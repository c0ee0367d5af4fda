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
import re
import signal
import subprocess
import sys
import types
from collections import Counter
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

from megatron_tree.compat import lm_api
from megatron_tree.cpu import megatron_training as lm_cpu
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


def test_build_command_multi_node_flags_are_torchruns():
    one = launch_lm.build_command(str(GPT), [], nproc=2, cuda=True)
    assert "--standalone" in one and "--nnodes" not in one and "--rdzv-endpoint" not in one
    cmd = launch_lm.build_command(str(GPT), ["--x"], nproc=4, nnodes="2", node_rank=1, rdzv_endpoint="node0:29500",
                                  rdzv_id="77", cuda=True)
    run = cmd[:cmd.index(str(GPT))]
    assert "--standalone" not in run
    for flag, value in (("--nnodes", "2"), ("--node-rank", "1"), ("--rdzv-backend", "c10d"),
                        ("--rdzv-endpoint", "node0:29500"), ("--rdzv-id", "77"), ("--nproc-per-node", "4")):
        assert run[run.index(flag) + 1] == value, flag
    static = launch_lm.build_command(str(GPT), [], nnodes="1:4", rdzv_backend="static", rdzv_endpoint="h:1", cuda=False)
    assert static[static.index("--rdzv-backend") + 1] == "static" and static[static.index("--nnodes") + 1] == "1:4"
    assert launch_lm.WORKER_MODULE in static  # the CPU layer on every node alike
    for kwargs, message in ((dict(nnodes="2"), "--rdzv-endpoint"), (dict(nnodes="two"), "--nnodes"),
                            (dict(node_rank=1), "--rdzv-endpoint"), (dict(nnodes="2", rdzv_endpoint="h:1", node_rank=-1),
                                                                     "--node-rank")):
        with pytest.raises(ValueError, match=message):
            launch_lm.build_command(str(GPT), [], cuda=True, **kwargs)


def test_cli_launch_takes_torchruns_flags(capsys):
    from megatron_tree.cli import main

    assert main(["launch", "--dry-run", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--rdzv-backend",
                 "c10d", "--rdzv-endpoint", "127.0.0.1:29511", "--rdzv-id", "9", str(GPT), "--nnodes", "x"]) == 0
    out = capsys.readouterr().out
    assert ("--nnodes 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29511 --rdzv-id 9 --node-rank 1 "
            "--nproc-per-node 2") in out
    assert f"{GPT} --nnodes x" in out  # the script's own arguments pass through
    assert main(["launch", "--dry-run", "--nnodes", "2", str(GPT)]) == 2
    assert "--rdzv-endpoint" in capsys.readouterr().err


def test_launch_becomes_torchrun(monkeypatch, capsys):
    """No launcher process stays between the scheduler and torchrun: `launch` runs torchrun's own
    entry point in its process, so a SIGTERM to the launcher's pid is a SIGTERM to torchrun's agent,
    which forwards it to every rank; its exit status is torchrun's."""
    import torch.distributed.run as torchrun

    seen = []
    imported = []
    monkeypatch.setattr(lm_api, "megatron_training_import_error", lambda: imported.append(1))  # None: importable
    monkeypatch.setattr(lm_api, "megatron_training_location_error", lambda: None)
    monkeypatch.setattr(torchrun, "main", lambda args: seen.append((args, dict(os.environ))))
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setattr(os, "environ", dict(os.environ, MTREE_CALLER_VARIABLE="kept"))  # launch replaces it
    assert launch_lm.launch(str(GPT), ["--train-iters", "1"], nproc=2) == 0
    cmd = launch_lm.build_command(str(GPT), ["--train-iters", "1"], nproc=2)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    (args, env), = seen
    assert args == cmd[3:]
    assert env["MTREE_CALLER_VARIABLE"] == "kept" and env["OMP_NUM_THREADS"]
    if not torch.cuda.is_available():
        assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
        assert not imported  # a CPU launcher only locates megatron.training: each rank's worker imports it
    assert "megatron-tree launch: " in capsys.readouterr().out

    def failed(args):
        from torch.distributed.elastic.multiprocessing.api import SignalException

        raise SignalException("Process 7 got signal: 15", sigval=signal.SIGTERM)

    monkeypatch.setattr(torchrun, "main", failed)
    assert launch_lm.launch(str(GPT), [], nproc=2) == 1  # as plain torchrun exits after a signal or a failed rank
    assert "SignalException: Process 7 got signal: 15" in capsys.readouterr().err


def test_worker_stops_with_what_to_install_when_megatron_training_fails_to_import(monkeypatch):
    """The CPU launcher only locates megatron.training; a rank whose import of it fails (a checkout
    missing an extra dependency) stops with the launcher's message, naming the cause."""
    if torch.cuda.is_available():
        pytest.skip("with CUDA the ranks run the script directly and the launcher imports megatron.training")
    monkeypatch.setattr(lm_api, "megatron_training_import_error", lambda: "ModuleNotFoundError: No module named 'six'")
    with pytest.raises(SystemExit) as stop:
        launch_lm.worker_main([str(GPT), "--train-iters", "1"])
    assert "megatron.training" in str(stop.value) and "No module named 'six'" in str(stop.value)
    assert "core_v0.16.1" in str(stop.value)


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


@needs_megatron_training
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is for CPU-only hosts")
def test_cuda_draws_of_megatron_training_leave_the_weights_generator_alone():
    """On a GPU, megatron.training's ``device="cuda"`` draws and the JIT warm-up's dropout use the CUDA
    generator; the CPU generator --use-cpu-initialization draws the weights from must not move."""
    from types import SimpleNamespace

    from megatron_tree.cpu import megatron_core as cpu

    was_enabled = cpu.is_enabled()
    try:
        assert lm_cpu.enable()
        init = __import__("megatron.training.initialize", fromlist=["_warmup_jit_function"])
        view = init.torch
        assert view is not torch
        state = torch.get_rng_state()
        on_cuda = [view.rand(4, device="cuda"), view.randn(2, 3, device=torch.device("cuda")),
                   view.randint(0, 9, (3,), device="cuda"), view.randperm(5, device="cuda"),
                   view.normal(0.0, 1.0, (2,), device="cuda")]
        assert torch.equal(torch.get_rng_state(), state) and all(t.device.type == "cpu" for t in on_cuda)
        view.rand(2)  # a CPU draw still draws from the CPU generator
        assert not torch.equal(torch.get_rng_state(), state)
        view.manual_seed(5)  # seeds the CUDA stand-in too, as torch.manual_seed seeds the CUDA generators
        first = view.rand(3, device="cuda")
        view.manual_seed(5)
        assert torch.equal(view.rand(3, device="cuda"), first)

        gv = __import__("megatron.training.global_vars", fromlist=["_GLOBAL_ARGS"])
        saved_args = gv._GLOBAL_ARGS
        gv._GLOBAL_ARGS = SimpleNamespace(bf16=False, fp16=False, ffn_hidden_size=16, tensor_model_parallel_size=1,
                                          seq_length=8, context_parallel_size=2, micro_batch_size=1, swiglu=True,
                                          sequence_parallel=False, hidden_size=8)
        try:
            state = torch.get_rng_state()
            init._warmup_jit_function()
            assert torch.equal(torch.get_rng_state(), state)
            init._warmup_jit_function.__wrapped__()  # Megatron-LM's own: its dropout moves the CPU generator
            assert not torch.equal(torch.get_rng_state(), state)
        finally:
            gv._GLOBAL_ARGS = saved_args
    finally:
        if not was_enabled:
            cpu.disable()


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


def _launch(tmp: Path, name: str, script: Path, args: list, nproc: int = 2, samples: Optional[dict] = None):
    """Run ``script`` through `megatron-tree launch` (tests/lm_entry.py records every microbatch);
    returns (returncode, output, {iteration: loss}). ``samples``, when given, is filled with
    {iteration: Counter of the sample ids read, over all ranks}."""
    record = tmp / f"record_{name}"
    env = dict(os.environ, MTREE_LM_SCRIPT=str(script), MTREE_LM_RECORD=str(record))
    cmd = [sys.executable, "-m", "megatron_tree", "launch", "--nproc", str(nproc), str(ROOT / "tests" / "lm_entry.py"),
           *args]
    r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    sums: dict = {}
    for f in tmp.glob(f"record_{name}.*.jsonl"):
        for rec in map(json.loads, f.read_text().splitlines()):
            it = rec["iteration"]
            if rec["kind"] == "loss":
                s, n = sums.get(it, (0.0, 0))
                sums[it] = (s + rec["loss_sum"], n + rec["num_tokens"])
            elif samples is not None:
                samples.setdefault(it, Counter()).update(rec["sample_ids"])
    return r.returncode, out, {it: s / n for it, (s, n) in sorted(sums.items())}


def _check(rc, out, what):
    assert rc == 0, f"{what} failed:\n{out[-6000:]}"


def _microbatches(tmp: Path, name: str, iteration: int) -> list:
    """``[(sample ids, loss sum, num tokens)]``: every microbatch of ``iteration`` of run ``name`` as
    tests/lm_entry.py recorded it (CP 1, PP 1: each rank reads a microbatch, then computes its loss)."""
    out = []
    for f in sorted(tmp.glob(f"record_{name}.*.jsonl")):
        recs = [r for r in map(json.loads, f.read_text().splitlines()) if r["iteration"] == iteration]
        assert [r["kind"] for r in recs] == ["data", "loss"] * (len(recs) // 2), recs
        out += [(d["sample_ids"], lo["loss_sum"], lo["num_tokens"]) for d, lo in zip(recs[::2], recs[1::2])]
    return out


#: `megatron-tree score`'s model flags for COMMON + MODELS["gpt"] (Megatron-LM pads the vocabulary
#: to 128 rows there; its RMSNorm, rope with base 10000, untied embeddings and no biases are ours too)
SCORE_GPT = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
             "--swiglu", "--normalization", "RMSNorm", "--rotary-base", "10000", "--vocab-size", "128"]
#: score's flags for each Megatron-LM checkpoint this module saves (COMMON + MODELS / MTP_MODELS flags)
SCORE_FLAGS = {
    "gpt": SCORE_GPT,
    "hybrid": SCORE_GPT[2:] + ["--hybrid-override-pattern", "MG*-"],
    "mamba_mtp": SCORE_GPT[2:] + ["--model-family", "mamba", "--hybrid-override-pattern", "M*-M", "--mtp-num-layers",
                                  "2", "--mtp-pattern", "M*"],
}
_SCORE_SCRIPT = """
import json, sys
from megatron_tree.cli import main
print("MTREE_RC " + json.dumps([main(argv) for argv in json.loads(sys.argv[1])]), flush=True)
"""


def _check_score_of_megatron_lm_checkpoint(tmp: Path, data: Path, lm_loss: float, model: str = "gpt",
                                           run: str = "full") -> None:
    """``megatron-tree score`` on the torch_dist checkpoint Megatron-LM's pretrain() saved at iteration 2
    (the weights iteration 3 ran with, before its update) of launch ``run``, over the samples iteration 3
    read: each microbatch's summed -log-prob equals the loss sum Megatron-LM's loop computed for it
    (recorded by tests/lm_entry.py), and their mean over the step's targets is iteration 3's "lm loss"
    (--calculate-per-token-loss, SFT), to float32 rounding. Planted fault: the iteration-4 checkpoint
    (two updates later) misses it. For GPT also score's own checks, which no family changes (CI minutes): in
    float64, the training records of at least 9 tokens scored together
    (tree packing, prompts shared) equal each scored alone (flat packing under a budget of 16 rows, which
    no two of them fit in: one record per microbatch, the summary line says so) to 1e-10. Refused before
    any rank computes, naming what differs: flags whose numerics differ from the checkpoint's args in two
    arguments (--norm-epsilon, --rotary-percent), a model built without --swiglu (named by
    the args check) and the same layers as our hybrid stack (args agree; the tensor check names the
    per-layer tensors the checkpoint lacks and its stacked ones the model lacks). One process scores them
    all (a single rank in the subprocess, no spawn)."""
    import pyarrow.parquet as pq

    mbs = _microbatches(tmp, run, 3)
    ids = sorted(i for m in mbs for i in m[0])
    assert len(ids) == 8 and len(set(ids)) == 8
    lines = data.read_text().splitlines()
    (tmp / "iter3.jsonl").write_text("".join(lines[i] + "\n" for i in ids))
    long = [line for line in lines if len(json.loads(line)["tokens"]) >= 9][:12]
    (tmp / "long.jsonl").write_text("".join(line + "\n" for line in long))
    ckpt = tmp / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    flags = SCORE_FLAGS[model]

    def argv(load, out, flags=flags, records="iter3.jsonl", extra=("--max-tokens-per-mb", "128", "--quiet")):
        return ["score", *flags, "--load", str(load), "--data", str(tmp / records), "--out", str(tmp / out), *extra]

    it2 = ckpt / "iter_0000002"
    runs = [argv(it2, "it2.parquet"), argv(ckpt / "iter_0000004", "it4.parquet")]
    expected = [0, 0]
    gpt = model == "gpt"  # score's own checks (together vs alone, refusals) once; each family loads and reproduces
    if gpt:
        runs += [argv(it2, "tree64.parquet", records="long.jsonl", extra=("--dtype", "float64")),
                 argv(it2, "alone64.parquet", records="long.jsonl",
                      extra=("--dtype", "float64", "--packing", "flat", "--max-tokens-per-mb", "16")),
                 argv(it2, "numerics.parquet", flags + ["--norm-epsilon", "1e-6", "--rotary-percent", "0.5"]),
                 # GeLU MLPs (the args name it); the same layers as a hybrid stack (keyed per layer)
                 argv(it2, "bad.parquet", [f for f in flags if f != "--swiglu"]),
                 argv(it2, "bad_keys.parquet", flags[2:] + ["--hybrid-override-pattern", "*-*-"])]
        expected += [0, 0, 2, 2, 2]
    # a world of one without MASTER_PORT: score forms its group on an in-process store, no port at all
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    r = subprocess.run([sys.executable, "-c", _SCORE_SCRIPT, json.dumps(runs)], cwd=tmp, env=env, capture_output=True,
                       text=True, timeout=600)
    out = r.stdout + r.stderr
    rcs = [json.loads(line.split(" ", 1)[1]) for line in r.stdout.splitlines() if line.startswith("MTREE_RC ")]
    assert r.returncode == 0 and rcs == [expected], out[-6000:]
    if gpt:
        # numerics arguments that differ from the checkpoint's: both named, with the flag, nothing scored
        assert "norm_epsilon: checkpoint 1e-05, flags 1e-06 (--norm-epsilon)" in out, out[-3000:]
        assert "rotary_percent: checkpoint 1.0, flags 0.5 (--rotary-percent)" in out, out[-3000:]
        assert not (tmp / "numerics.parquet").exists()
        assert "swiglu: checkpoint True, flags False (--swiglu)" in out, out[-3000:]
        # args that agree, tensors that do not (stacked vs per-layer keys): the tensor check names them
        assert "the checkpoint's parameters do not match" in out, out[-3000:]
        lacks = next(line for line in out.splitlines() if line.startswith("  - not in the checkpoint: "))
        holds = next(line for line in out.splitlines() if line.startswith("  - in the checkpoint, not in the model: "))
        assert "decoder.layers.0.self_attention.linear_proj.weight" in lacks, lacks
        assert "decoder.layers.mlp.linear_fc1.weight" in holds, holds
        assert not (tmp / "bad.parquet").exists() and not (tmp / "bad_keys.parquet").exists()

    def rows(name):
        return pq.read_table(tmp / name).to_pylist()

    def nll(name):
        got = rows(name)
        assert [row["record"] for row in got] == list(range(len(ids)))
        return ({i: -float(np.sum(row["logprobs"], dtype=np.float64)) for i, row in zip(ids, got)},
                {i: len(row["logprobs"]) for i, row in zip(ids, got)})

    s2, n2 = nll("it2.parquet")
    for sample_ids, loss_sum, num_tokens in mbs:  # each microbatch of Megatron-LM's step
        assert sum(n2[i] for i in sample_ids) == num_tokens, (sample_ids, n2)
        assert sum(s2[i] for i in sample_ids) == pytest.approx(loss_sum, rel=1e-6, abs=1e-6), (sample_ids, loss_sum)
    scored = sum(s2.values()) / sum(n2.values())
    assert sum(n2.values()) == sum(m[2] for m in mbs)
    assert scored == pytest.approx(lm_loss, rel=1e-6), (scored, lm_loss)
    s4, n4 = nll("it4.parquet")  # planted fault: weights two updates later
    assert n4 == n2 and abs(sum(s4.values()) / sum(n4.values()) - lm_loss) > 1e-4 * lm_loss
    if not gpt:
        print(f"\n{model}: iteration-3 lm loss {lm_loss!r}, score of iter_0000002 {scored!r} "
              f"(iter_0000004: {sum(s4.values()) / sum(n4.values())!r})")
        return
    # together vs alone, float64
    summaries = [line for line in out.splitlines() if line.startswith("megatron-tree score: ")]
    assert len(summaries) == 2, summaries
    assert f"{len(long)} microbatches (flat: " in summaries[1], summaries  # one record per microbatch
    tree_rows, flat_tokens = map(int, re.search(r"\(tree: ([\d,]+) rows for ([\d,]+) tokens\)",
                                                summaries[0]).group(1, 2))
    assert tree_rows < flat_tokens, summaries  # prompts were shared
    tree, alone = rows("tree64.parquet"), rows("alone64.parquet")
    assert [row["record"] for row in tree] == [row["record"] for row in alone] == list(range(len(long)))
    diff = max(float(np.abs(np.asarray(a[k]) - np.asarray(b[k])).max(initial=0.0))
               for a, b in zip(tree, alone) for k in ("logprobs", "entropy"))
    assert diff <= 1e-10 and sum(len(row["logprobs"]) for row in tree) > 0, diff
    print(f"\n{model}: iteration-3 lm loss {lm_loss!r}, score of iter_0000002 {scored!r} "
          f"(iter_0000004: {sum(s4.values()) / sum(n4.values())!r}); float64 together vs alone max |diff| {diff:.2e}")


#: The fresh tree-CP run (extra flags, ranks), of the hybrid only (CI minutes: a pretrain() launch costs ~40 s
#: on 2 cores; its MG*- stack holds attention, so the hooks' CP path for attention runs here; GPT's tree CP
#: through pretrain() also runs in tests/test_slurm_job.py, and against CP1 in tests/test_megatron_verify.py /
#: tests/test_cp_megatron.py): CP2 on 2 ranks (a 4-rank CP2 + TP2 + SP launch cost CI ~3 minutes; CP x TP2 +
#: SP is verify's, tests/test_megatron_verify.py ws4, and the CPU layer's weights generator under TP is this
#: module's CUDA-draws case). Across TP the models are compared from one checkpoint (the resumed TP2 + SP runs
#: below): Megatron-Core draws the TP shards of the Mamba-2 / GDN layers' conv1d, dt_bias and A_log from each
#: TP rank's own RNG stream (on GPUs too), so a hybrid's initial model depends on TP by design.
FRESH_CP = {"hybrid": (["--context-parallel-size", "2"], 2)}


@needs_megatron_training
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is for CPU-only hosts")
@pytest.mark.parametrize("model", sorted(MODELS))
def test_pretrain_tree_cp_resume_and_flat_on_cpu(model, tmp_path):
    """Megatron-LM's pretrain() with our hooks on CPU ranks, three runs of one job:

    * DP2, CP1: the reference (4 iterations, checkpoint at iteration 2); ``megatron-tree score`` of that
      checkpoint reproduces iteration 3's loss, and scores records together as each alone
      (`_check_score_of_megatron_lm_checkpoint`);
    * hybrid: started afresh under tree CP2: the same model from the same seed, so the
      iteration-1 loss (before any update) equals CP1's to float32 rounding, and so do the next
      three steps, each reading the same samples as CP1 (each sample once per step and CP rank);
      before the CPU layer kept Megatron-LM's JIT warm-up off the weights' generator, the model
      depended on CP and TP (GPT iteration 1: 4.8522 CP1, 4.8658 CP2, 4.8755 CP2 + TP2 + SP);
      then resumed at iteration 2 under tree CP2 with --tree-carry at an 8-row budget: the DP2 run's
      samples and losses (the same-layout resume is bit for bit in tests/test_preemption.py);
    * GPT: resumed on two 1F1B pipeline stages with --tree-carry at an 8-row budget (the DP2 run's
      samples and losses), and as TP2 + SP with flat packing (no prefix shared; the checkpoint
      resharded): the tree's losses to float32 rounding."""
    script, model_args = MODELS[model]
    data = _write_data(tmp_path / "train.jsonl")
    args = COMMON + model_args + ["--tree-data-path", str(data)]
    ckpt = ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    full_samples: dict = {}
    rc, out, full = _launch(tmp_path, "full", script, args + ckpt, samples=full_samples)
    _check(rc, out, "DP2 run")
    assert sorted(full) == [1, 2, 3, 4] and all(np.isfinite(v) for v in full.values())
    assert "iteration        4/       4" in out and "lm loss:" in out  # Megatron-LM's own log
    assert sorted(full_samples) == [1, 2, 3, 4] and all(set(c.values()) == {1} for c in full_samples.values())
    assert sum(len(c) for c in full_samples.values()) == 4 * 8  # --tree-global-batch-samples 8 per step
    _check_score_of_megatron_lm_checkpoint(tmp_path, data, full[3], model)

    cp = {}
    if model in FRESH_CP:
        cp_flags, cp_ranks = FRESH_CP[model]
        cp_samples: dict = {}
        rc, out, cp = _launch(tmp_path, "cp", script, args + cp_flags, nproc=cp_ranks, samples=cp_samples)
        _check(rc, out, f"fresh {' '.join(cp_flags)} run")
        assert sorted(cp) == [1, 2, 3, 4]
        for it in (1, 2, 3, 4):
            assert cp[it] == pytest.approx(full[it], rel=2e-5), (it, cp, full)
            # each CP rank of the one DP group reads every sample of the step once (TP rank 0 reads, the
            # other TP ranks get it broadcast)
            assert cp_samples[it] == Counter({i: 2 for i in full_samples[it]}), (it, cp_samples, full_samples)

    load = ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "2"]
    # --tree-carry at an 8-row budget (below every tree and most samples: paths are cut into chains that read
    # carried state; more schedule items: fill + restore, so a larger --global-batch-size, which changes no number
    # under the per-token loss), resumed from the DP2 run's iteration-2 checkpoint: iterations 3 and 4 read the DP2
    # run's samples (each on both ranks of the one DP group) and give its losses (float32 rounding). The hybrid
    # under tree CP2 (zigzag: its Mamba-2 / GDN head shards continue carried state over every own row, attention
    # reads carried K / V on the rank the plan gives it); GPT on two 1F1B pipeline stages (each stage its own
    # store, the fills' hidden states sent on). (--override-opt_param-scheduler: the larger --global-batch-size
    # changes the scheduler's sample count, which a resume otherwise refuses; the learning rate is constant.)
    # Carry under TP2 + SP through the hooks: tests/test_routing_replay.py (in-process, TP rank 1 fed by rank 0).
    carry_args = list(args)
    carry_args[carry_args.index("--global-batch-size") + 1] = "16"
    carry_args[carry_args.index("--tree-max-tokens-per-mb") + 1] = "8"
    layout = {"hybrid": ["--context-parallel-size", "2", "--tree-cp-planner", "zigzag"],
              "gpt": ["--pipeline-model-parallel-size", "2"]}[model]
    carry_samples: dict = {}
    rc, out, carry = _launch(tmp_path, "carry", script, carry_args + load + layout +
                             ["--tree-carry", "--override-opt_param-scheduler"], samples=carry_samples)
    _check(rc, out, f"{' '.join(layout)} --tree-carry run resumed at iteration 2")
    assert sorted(carry) == [3, 4] and carry_samples == {it: Counter({i: 2 for i in full_samples[it]})
                                                         for it in (3, 4)}, (carry_samples, full_samples)
    for it in (3, 4):
        assert carry[it] == pytest.approx(full[it], rel=2e-5), (it, carry, full)
    tp2 = {}
    if model == "gpt":  # the resharded flat-packing resume
        rc, out, tp2 = _launch(tmp_path, "resume_tp2_flat", script, args + load + TP2_SP + ["--tree-flat-packing"])
        _check(rc, out, "TP2+SP flat-packing resume")
        assert sorted(tp2) == [3, 4]
        for it in (3, 4):
            assert tp2[it] == pytest.approx(full[it], rel=2e-6), (it, tp2, full)
    print(f"\n{model}: DP2 {full}\n{model}: fresh CP2 {cp}\n{model}: resumed with carry {carry}, TP2+SP flat {tp2}")


def _logged(out: str, key: str) -> dict:
    """{iteration: value} of ``key`` (e.g. "mtp_1 loss") in Megatron-LM's iteration log lines."""
    found = {}
    for line in out.splitlines():
        if " iteration " in line and f"| {key}:" in line:
            it = int(line.split(" iteration ")[1].split("/")[0])
            found[it] = float(line.split(f"| {key}:")[1].split("|")[0])
    return found


#: MTP through pretrain(): (script, model flags, MTP depths, the layout compared with one rank, its ranks)
MTP_MODELS = {
    # One family (CI minutes: each case is two pretrain() launches and a score run). MambaModel with megatron-core
    # 0.19's unified hybrid pattern: main stack "M*-M", two MTP depths of a Mamba and an attention layer each (the
    # second depth's input crosses CP ranks too). GPT's MTP: the hooks in-process (tests/test_mtp.py
    # test_megatron_lm_hooks_train_mtp_on_the_tree) and verify under CP2, CP4 and TP2 + SP (tests/test_mtp.py).
    "mamba": (ROOT / "examples" / "pretrain_tree_mamba.py",
              ["--hybrid-layer-pattern", "M*-M/M*/M*", "--mamba-state-dim", "8", "--mamba-head-dim", "8",
               "--mamba-num-groups", "2"], 2, ["--context-parallel-size", "2"], 2),
}


@needs_megatron_training
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is for CPU-only hosts")
@pytest.mark.parametrize("model", sorted(MTP_MODELS))
def test_pretrain_tree_mtp_under_cp_equals_one_rank(model, tmp_path):
    """Multi-token prediction through Megatron-LM's pretrain() with our hooks: one rank vs tree CP2 (MambaModel:
    two MTP depths from the "main/mtp/mtp" pattern), same seed; each depth's input crosses CP ranks. Every
    iteration's loss agrees to float32 rounding (iterations 2-4 after updates that carry the MTP gradients),
    and so does each depth's loss Megatron-LM logs; that logged value is the step's per-token mean, about
    ln(128) for this fresh model at iteration 1 (stock's mean of per-microbatch means read 1.2 for GPT here:
    the tree step's 8 samples fill one of the 4 microbatches, the 3 padding ones add 0). The one-rank run's iteration-2 checkpoint, MTP layers and
    all, loads in ``megatron-tree score`` (`_check_score_of_megatron_lm_checkpoint`)."""
    script, model_args, depths, layout, ranks = MTP_MODELS[model]
    data = _write_data(tmp_path / "train.jsonl")
    args = COMMON + model_args + ["--tree-data-path", str(data), "--mtp-loss-scaling-factor", "0.3"]
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    rc, out1, one = _launch(tmp_path, "one", script, args + save, nproc=1)
    _check(rc, out1, "MTP run on one rank")
    rc, out4, cp = _launch(tmp_path, "cp", script, args + layout, nproc=ranks)
    _check(rc, out4, f"MTP run under {' '.join(layout)}")
    assert sorted(one) == sorted(cp) == [1, 2, 3, 4]
    for it in one:
        assert cp[it] == pytest.approx(one[it], rel=2e-5), (it, cp, one)
    for k in range(1, depths + 1):
        a, b = _logged(out1, f"mtp_{k} loss"), _logged(out4, f"mtp_{k} loss")
        assert sorted(a) == sorted(b) == [1, 2, 3, 4], (k, a, b)
        for it in a:
            assert b[it] == pytest.approx(a[it], rel=2e-5), (k, it, a, b)
        assert abs(a[1] - np.log(128)) < 0.1, (k, a)
    # the one-rank run's checkpoint (MTP layers included) in megatron-tree score
    _check_score_of_megatron_lm_checkpoint(tmp_path, data, one[3], f"{model}_mtp", run="one")
    print(f"\n{model} MTP: one rank {one}, {' '.join(layout)} {cp}; mtp_1 {_logged(out1, 'mtp_1 loss')}")


#: DeepSeek-V3 attention at toy size (q / kv latents) with DSA's indexer picking 3 keys per query
DSA = ["--num-layers", "2", "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim",
       "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "8", "--experimental-attention-variant", "dsa",
       "--dsa-indexer-topk", "3", "--dsa-indexer-n-heads", "2", "--dsa-indexer-head-dim", "8",
       "--dsa-indexer-loss-coeff", "0.5"]


@needs_megatron_training
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is for CPU-only hosts")
def test_pretrain_tree_dsa_with_carry_equals_whole_trees(tmp_path):
    """DSA through Megatron-LM's pretrain() (the GPT example): the hooks' model provider prepares stock
    DSA's indexer for the host as `megatron-tree train` does (`megatron.dsa.prepare_stock_dsa`; on a CPU
    host stock's rotation asserted bfloat16 and the job failed at its first forward). DP2, 4 iterations:
    --tree-carry at an 8-row budget (every tree cut, its K / V and index keys carried; --tree-carry-cut always: every
    microbatch loose over the two DP ranks, the carried state and its gradient crossing them at the hooks' syncs)
    reads the same samples and gives the losses of whole trees at 64 rows (float32 rounding)."""
    data = _write_data(tmp_path / "train.jsonl")
    args = COMMON + DSA + ["--tree-data-path", str(data)]
    whole_samples: dict = {}
    rc, out, whole = _launch(tmp_path, "whole", GPT, args, samples=whole_samples)
    _check(rc, out, "DSA DP2 run")
    carry_args = list(args)
    carry_args[carry_args.index("--global-batch-size") + 1] = "16"  # more schedule items: fill + restore
    carry_args[carry_args.index("--tree-max-tokens-per-mb") + 1] = "8"
    carry_samples: dict = {}
    rc, out, carry = _launch(tmp_path, "carry", GPT, carry_args + ["--tree-carry", "--tree-carry-cut", "always"],
                             samples=carry_samples)
    _check(rc, out, "DSA DP2 --tree-carry run")
    assert sorted(whole) == sorted(carry) == [1, 2, 3, 4] and carry_samples == whole_samples
    for it in whole:
        assert carry[it] == pytest.approx(whole[it], rel=2e-5), (it, carry, whole)
    assert whole[4] != whole[1]  # it trained


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
    # tree CP runs through the hooks: no stale "CP 1 only" advice, the way to pick CP, multi-node and signals
    assert "not wired" not in readme and "for now" not in readme and "do not run yet" not in readme
    assert "megatron-tree plan --data" in readme and "--context-parallel-size" in readme
    # scoring a Megatron-LM checkpoint: the flags it takes (the test's own) and the padded vocabulary
    assert "megatron-tree score --load ckpt/iter_0000002" in readme and "padded" in readme
    for flag in (f for f in SCORE_GPT if f.startswith("--")):
        assert flag in readme, flag
    for word in ("--nnodes", "--rdzv-endpoint", "--node-rank", "--exit-signal-handler", "#SBATCH --signal=TERM@",
                 "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "consumed"):
        assert word in readme, word


#: MoE balancing as Megatron-LM users pass it: aux loss, z-loss, expert bias with sigmoid routing
BALANCED_MOE = ["--num-layers", "2", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
                "--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff", "0.01", "--moe-router-score-function", "sigmoid",
                "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01"]


@needs_megatron_training
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is for CPU-only hosts")
def test_pretrain_moe_balancing_on_trees_equals_flat_packing(tmp_path):
    """MoE load balancing through Megatron-LM's pretrain() with the flags as users pass them: aux loss 0.1,
    z-loss 0.01 and expert bias (sigmoid routing, update rate 0.01), one microbatch of the step's 8 samples
    (so the aux loss, a statistic of a microbatch, sees the same samples either way). Prefix trees against
    --tree-flat-packing (every sample its own chain, nothing shared): every iteration's loss, and the
    load-balancing and z-losses Megatron-LM logs, agree to float32 rounding over 4 iterations (each step
    updates the expert biases from the counts the next routing uses); the tree really shares rows."""
    data = _write_data(tmp_path / "train.jsonl")
    args = list(COMMON)
    for flag, value in (("--tree-max-tokens-per-mb", "128"), ("--seq-length", "128"),
                        ("--max-position-embeddings", "128"), ("--global-batch-size", "1")):
        args[args.index(flag) + 1] = value
    args += BALANCED_MOE + ["--tree-data-path", str(data)]
    rc, out_tree, tree = _launch(tmp_path, "tree", GPT, args, nproc=1)
    _check(rc, out_tree, "balanced MoE on trees")
    rc, out_flat, flat = _launch(tmp_path, "flat", GPT, args + ["--tree-flat-packing"], nproc=1)
    _check(rc, out_flat, "balanced MoE flat-packed")
    assert sorted(tree) == sorted(flat) == [1, 2, 3, 4]
    # float32 rounding (measured 8.5e-8); the deduplicated statistics of before (planted by hand: every row
    # weighing 1) moved iteration 2's loss by 6.7e-5
    for it in tree:
        assert tree[it] == pytest.approx(flat[it], rel=1e-6), (it, tree, flat)
    for key in ("load_balancing_loss", "z_loss"):
        a, b = _logged(out_tree, key), _logged(out_flat, key)
        assert sorted(a) == sorted(b) == [1, 2, 3, 4], (key, a, b, out_tree[-3000:])
        for it in a:
            assert a[it] == pytest.approx(b[it], rel=1e-5), (key, it, a, b)
    rows = {name: sum(len(m[0]) for m in _microbatches(tmp_path, name, 1)) for name in ("tree", "flat")}
    assert rows["tree"] == rows["flat"] == 8  # the same 8 samples in one microbatch
    print(f"\nbalanced MoE pretrain(): tree {tree}, flat {flat}; load_balancing_loss tree "
          f"{_logged(out_tree, 'load_balancing_loss')} flat {_logged(out_flat, 'load_balancing_loss')}; z_loss tree "
          f"{_logged(out_tree, 'z_loss')} flat {_logged(out_flat, 'z_loss')}")
