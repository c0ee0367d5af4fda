"""Harness of the kernel tier: the real Triton kernels of our GPU backends on CPU tensors.

``TRITON_INTERPRET=1`` makes Triton run ``@triton.jit`` kernels in its Python interpreter on CPU
tensors. FLA, mamba-ssm and FlexAttention then run on CPU after a few patches that live here,
in the test harness, and never in the library (each names what it works around):

* Triton's autotuner benchmarks every config on a GPU ("0 active drivers" on CPU): it keeps the
  first config and does not time it.
* FLA's kernels call ``i_t.to(tl.int64)`` on a ``for i_t in range(...)`` variable, which the
  interpreter hands over as a Python int: the interpreter's source rewriter (which already turns
  every assignment into a Triton tensor) also converts loop variables.
* mamba-ssm's kernels enter ``torch.cuda.device(x.device)`` and read
  ``torch.cuda.get_device_properties(...).multi_processor_count``: a null context and a fake
  property while the kernel tier runs. Its package ``__init__`` imports the CUDA extension and the
  models (huggingface_hub); the kernels need neither, so ``mamba_ssm`` is registered as a bare
  package (its modules import from their files as usual).
* FlexAttention refuses a backward on CPU (``_validate_device``); the eager path computes it
  correctly. Bypassed by the ``flex_cpu_backward`` fixture only.
* ``megatron_tree.ops.backend.allow_cpu_kernels()``: the library's explicit, off-by-default switch
  that lets a named GPU backend take CPU tensors.

Only float32 is meaningful in the interpreter (it computes bfloat16 on raw bits). A missing
package is an error here, not a skip: this tier exists to run them.
"""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("Triton was imported before TRITON_INTERPRET=1 was set; run `make test-kernels`")
os.environ["TRITON_INTERPRET"] = "1"  # read when the @triton.jit decorators run (at package import)

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/forests.py

REQUIRED = {"triton": "triton", "fla.ops.gated_delta_rule": "fla-core", "mamba_ssm": "mamba-ssm"}


def _missing() -> list[str]:
    return [pkg for mod, pkg in REQUIRED.items() if importlib.util.find_spec(mod.split(".")[0]) is None]


# --------------------------------------------------------------------------------------------- patches
def _patch_autotuner() -> None:
    from triton.runtime import autotuner

    def prune_configs(self, kwargs):
        return self.configs[:1]  # no GPU to benchmark on: the first config

    def _bench(self, *args, config, **kwargs):
        return [0.0, 0.0, 0.0]  # triton 3.7 times even a single config (on a GPU benchmarker)

    autotuner.Autotuner.prune_configs = prune_configs
    autotuner.Autotuner._bench = _bench


def _patch_loop_variables() -> None:
    from triton.runtime import interpreter

    base = interpreter.FunctionRewriter.ast_transformer.__class__

    class LoopVariablesAsTensors(base):
        """Also make ``for NAME in ...`` loop variables Triton tensors, as assignments already are."""

        def visit_For(self, node):
            self.generic_visit(node)
            if isinstance(node.target, ast.Name):
                convert = ast.Assign(
                    targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                    value=ast.Call(func=ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()),
                                                      attr="to_tensor", ctx=ast.Load()),
                                   args=[ast.Name(id=node.target.id, ctx=ast.Load()), ast.Constant(value=False)],
                                   keywords=[]))
                node.body.insert(0, convert)
            return node

    interpreter.FunctionRewriter.ast_transformer = LoopVariablesAsTensors()


class _Properties:
    multi_processor_count = 1
    major, minor, name = 0, 0, "cpu (Triton interpreter)"


def _patch_cuda_queries() -> None:
    torch.cuda.device = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.get_device_properties = lambda *args, **kwargs: _Properties()


def _register_mamba_package() -> None:
    spec = importlib.util.find_spec("mamba_ssm")
    package = types.ModuleType("mamba_ssm", "mamba-ssm's package without its __init__ (kernel tier harness)")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules["mamba_ssm"] = package


def pytest_configure(config):
    missing = _missing()
    if missing:
        raise pytest.UsageError(f"kernel tier: {', '.join(missing)} not importable; run `make test-kernels` "
                                "(it installs them from requirements-kernels.txt)")
    _patch_autotuner()
    _patch_loop_variables()
    _patch_cuda_queries()
    _register_mamba_package()
    from megatron_tree.ops.backend import allow_cpu_kernels

    allow_cpu_kernels(True)


@pytest.fixture
def flex_cpu_backward(monkeypatch):
    """Let FlexAttention's eager backward run on CPU tensors (its device check refuses them)."""
    from torch.nn.attention import flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *args, **kwargs: None)


# --------------------------------------------------------------------------------------------- error table
REPORT_DIR = Path(os.environ.get("KERNEL_TIER_REPORT", Path(__file__).resolve().parents[1] / "runs" / "kernel_tier"))


@pytest.fixture
def kernel_report(request):
    """``record(backend, case, quantity, err_kernel, err_torch_fp32)``: one row of the closing table
    (a file per xdist worker; the controller prints them all)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    REPORT_DIR.mkdir(parents=True, exist_ok=True)

    def record(backend, case, quantity, err_kernel, err_torch):
        with open(REPORT_DIR / f"results-{worker}.jsonl", "a") as f:
            f.write(json.dumps([backend, case, quantity, err_kernel, err_torch]) + "\n")

    return record


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        for f in REPORT_DIR.glob("results-*.jsonl"):
            f.unlink()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):
        return
    rows = [json.loads(line) for f in sorted(REPORT_DIR.glob("results-*.jsonl")) for line in f.read_text().splitlines()]
    if not rows:
        return
    tr = terminalreporter
    tr.section("kernel tier: max |kernel - float64 reference| / max|reference| (float32 inputs)")
    tr.write_line(f"{'backend':14s} {'case':40s} {'quantity':8s} {'kernel':>10s} {'torch fp32':>10s}")
    for backend, case, quantity, ek, et in sorted(rows, key=lambda r: (r[0], r[1])):
        tr.write_line(f"{backend:14s} {case:40s} {quantity:8s} {ek:10.2e} {et:10.2e}")
    for backend in sorted({r[0] for r in rows}):
        worst = max(r[3] for r in rows if r[0] == backend)
        tr.write_line(f"worst {backend}: {worst:.2e}")
