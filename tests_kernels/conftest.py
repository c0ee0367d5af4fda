"""Harness of the kernel tier: the real Triton kernels of our GPU backends on CPU tensors.

``TRITON_INTERPRET=1`` makes Triton run ``@triton.jit`` kernels in its Python interpreter on CPU
tensors. FLA, mamba-ssm and FlexAttention then run on CPU after a few patches that live here,
in the test harness (``harness.py``, applied here and in every spawned rank), never in the library
(each names what it works around):

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

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py (also for spawned ranks)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/forests.py

import harness  # noqa: E402  (sets TRITON_INTERPRET=1 before anything imports Triton)
import pytest  # noqa: E402


def pytest_configure(config):
    missing = harness.missing()
    if missing:
        raise pytest.UsageError(f"kernel tier: {', '.join(missing)} not importable; run `make test-kernels` "
                                "(it installs them from requirements-kernels.txt)")
    harness.apply()


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
