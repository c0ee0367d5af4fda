"""The three CI tiers are wired as documented (Makefile, .ci/run, requirements, setup.py), and the
kernel tier's switches stay out of the library."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]


def _pins(name: str) -> dict:
    pins = {}
    for line in (ROOT / name).read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def test_requirements_pin_both_stacks_and_setup_declares_the_range():
    cpu, latest, kernels = _pins("requirements-cpu.txt"), _pins("requirements-latest.txt"), _pins("requirements-kernels.txt")
    assert cpu["megatron-core"] == "0.16.1" and latest["megatron-core"] == "0.19.2"
    assert cpu["torch"] == latest["torch"] == "2.13.0"
    assert latest["triton"] == "3.7.1"  # torch 2.13.0's own pin: the kernel tier interprets this one
    assert {"fla-core", "mamba-ssm"} <= set(kernels)
    spec = re.search(r'"megatron-core([^"]+)"', (ROOT / "setup.py").read_text()).group(1)
    assert SpecifierSet(spec).contains(cpu["megatron-core"]) and SpecifierSet(spec).contains(latest["megatron-core"])
    assert not SpecifierSet(spec).contains("0.20.0")  # untested majors are not claimed


def test_makefile_tiers_and_ci_run_all_three():
    mk = (ROOT / "Makefile").read_text()
    for target in ("test:", "test-latest:", "test-kernels:", "venv-latest:", "venv-kernels:"):
        assert f"\n{target}" in mk, target
    # Python 3.12 through pyenv where it is installed (ignored elsewhere), checked before use
    assert "PYENV_VERSION=$(PYENV_LATEST) $(PY_LATEST) -m venv" in mk and "PYENV_LATEST ?= 3.12.1" in mk
    assert "sys.version_info >= (3, 12)" in mk
    # mamba-ssm / causal-conv1d build without CUDA and without trying to download a prebuilt wheel
    for var in ("MAMBA_SKIP_CUDA_BUILD=TRUE", "CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE", "MAMBA_FORCE_BUILD=TRUE"):
        assert var in mk
    assert "--no-deps --no-build-isolation --target $(KERNELS)" in mk
    assert "TRITON_INTERPRET=1" in mk and "-c tests_kernels/pytest.ini" in mk
    # README's; --durations: CI's log names the slowest cases (where its minutes go)
    assert ("\ntest: venv\n\t$(BIN)/python -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder --durations=40 "
            "$(PYTEST_ARGS) tests\n") in mk
    assert "--dist loadscope --no-loadscope-reorder --tier latest --durations=40 $(PYTEST_ARGS) tests" in mk  # the latest tier: conftest.py's selection
    ci = (ROOT / ".ci" / "run").read_text()
    assert "for target in test test-latest test-kernels" in ci and "exit $status" in ci
    assert "make venv-latest venv-kernels" in ci  # built in the background while the main tier runs
    dry = subprocess.run(["make", "-n", "test-kernels"], cwd=ROOT, capture_output=True, text=True)
    assert dry.returncode == 0 and "tests_kernels" in dry.stdout


def test_kernel_tier_is_outside_the_default_collection_and_the_library():
    assert (ROOT / "tests_kernels" / "conftest.py").exists() and (ROOT / "tests_kernels" / "pytest.ini").exists()
    assert not list((ROOT / "tests").rglob("conftest.py"))  # `pytest tests` never reaches tests_kernels/
    for path in (ROOT / "megatron_tree").rglob("*.py"):
        src = path.read_text()
        assert "TRITON_INTERPRET" not in src or path.name == "backend.py", path  # backend.py documents it
        assert "allow_cpu_kernels(True)" not in src or path.name == "backend.py", path  # its own cpu_kernels()
        assert "prune_configs" not in src and "ASTTransformer" not in src, path


def test_latest_tier_selection_names_real_tests_and_leaves_megatron_code_in():
    """conftest.py's --tier latest list: every stack-independent module exists and runs no
    Megatron-Core code of its own; every main-tier-only pattern still names a test function."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_root_conftest", ROOT / "conftest.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    for name in conf.STACK_INDEPENDENT:
        src = (ROOT / "tests" / name).read_text()
        for marker in ("megatron.core", "init_megatron", "run_verify", "TreeGPTModel"):
            assert marker not in src or name in ("test_layers.py", "test_tiers.py"), (name, marker)  # they only name them
    for pattern in conf.MAIN_TIER_ONLY:
        module, _, test = pattern.partition("::")
        prefix = re.split(r"[\[*]", test)[0]
        assert re.search(rf"^def {re.escape(prefix)}", (ROOT / "tests" / module).read_text(), re.M), pattern
    for name in conf.LONGEST_FIRST:
        assert (ROOT / "tests" / name).exists(), name
    assert conf._main_tier_only("tests/test_ops_gdn.py::test_x") and not conf._main_tier_only(
        "tests/test_megatron_verify.py::test_world_size_2[x]")
    assert conf._main_tier_only("tests/test_tree_loss.py::test_grpo") and not conf._main_tier_only(
        "tests/test_tree_loss.py::test_megatron_loss_func")
