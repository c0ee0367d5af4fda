"""Patches that let the GPU backends' real Triton kernels run on CPU tensors (kernel tier).

Applied by ``conftest.py`` in the pytest process and by :func:`apply` in every rank that
``run_distributed`` spawns (a spawned rank is a fresh interpreter: it inherits
``TRITON_INTERPRET=1`` from the environment but none of these patches). What each works around is
in ``conftest.py``'s module docstring. Never imported by the library.
"""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import sys
import types

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("Triton was imported before TRITON_INTERPRET=1 was set; run `make test-kernels`")
os.environ["TRITON_INTERPRET"] = "1"  # read when the @triton.jit decorators run (at package import)

import torch  # noqa: E402

REQUIRED = {"triton": "triton", "fla.ops.gated_delta_rule": "fla-core", "mamba_ssm": "mamba-ssm"}


def missing() -> list[str]:
    return [pkg for mod, pkg in REQUIRED.items() if importlib.util.find_spec(mod.split(".")[0]) is None]


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


_APPLIED = False


def apply() -> None:
    """All patches, once per process, then the library's CPU-kernels switch (named backends only;
    ``"auto"`` stays torch until a test asks for ``cpu_kernels(auto=True)``)."""
    global _APPLIED
    if not _APPLIED:
        _patch_autotuner()
        _patch_loop_variables()
        _patch_cuda_queries()
        _register_mamba_package()
        _APPLIED = True
    from megatron_tree.ops.backend import allow_cpu_kernels

    allow_cpu_kernels(True)
