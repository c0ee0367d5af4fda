"""Megatron-Bridge on a CPU-only host (no transformer-engine): what `megatron_tree.bridge` needs here and
nowhere else. Nothing happens on import; a host with transformer-engine gets none of it.

- `import_bridge`: ``import megatron.bridge`` imports transformer-engine unconditionally (its PEFT
  layers, several model bridges: ``import transformer_engine.pytorch as te`` at module level, 0.6.2).
  Without it the import fails, so while (and only while) ``megatron.bridge`` is imported a stand-in
  ``transformer_engine`` package answers, whose every attribute is an empty class (enough for
  ``isinstance`` checks, annotations and subclassing at import time; none of it runs on our path).
  Megatron-Core decides ``HAVE_TE`` by trying that same import, so every Megatron-Core module the
  Bridge names is imported first, without the stand-in, and the stand-in is removed from
  ``sys.modules`` afterwards; a Megatron-Core module imported during the window that kept a
  reference to it is an error (`BridgeImportError`), not a silent switch to TE code paths.
- (the local specs a Bridge provider gets without transformer-engine are built from our stock-structure
  local builders in ``megatron_tree.megatron``, above this layer: `megatron_tree.bridge.cpu_specs`.)
- `ZeroCenteredRMSNorm` (and `swap_norms`): Megatron-Core's torch norm refuses ``layernorm_zero_centered_gamma``
  (Qwen3-Next's ``(1 + w) * x / rms(x)``), which TE supports; the local specs get this torch module.
"""
from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import types
from pathlib import Path

import torch

from ..ops.backend import module_available

_LOCK = threading.Lock()


def _below_warning(record) -> bool:
    return record.levelno >= logging.WARNING


def _drop_probe_notes(logger) -> None:
    if _below_warning not in logger.filters:
        logger.addFilter(_below_warning)


class BridgeImportError(ImportError):
    """``megatron.bridge`` cannot be imported on this host (named cause)."""


class _StandInClass(type):
    """An empty class whose attributes are further empty classes (``te.ops.Sequential``)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _StandInClass(name, (), {"__module__": cls.__module__})
        setattr(cls, name, sub)
        return sub


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _StandInClass(name, (), {"__module__": self.__name__})
        setattr(self, name, sub)
        return sub


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``transformer_engine`` and its submodules with `_StandInModule` packages."""

    def find_spec(self, name, path, target=None):
        if name == "transformer_engine" or name.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _megatron_core_modules_named_by(package_dir: Path) -> list:
    """The ``megatron.core...`` modules imported at the top level of any file under ``package_dir``."""
    names = set()
    for path in package_dir.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("megatron.core"):
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names if a.name.startswith("megatron.core"))
    return sorted(names)


def import_bridge():
    """``megatron.bridge`` (imported once). On a host without transformer-engine the stand-in above
    answers ``transformer_engine`` during the import only; on a host without CUDA the Bridge's weight
    conversion modules (their ``torch.cuda.current_device()`` placements under TP > 1) get the CPU
    layer's view of torch (`megatron_core.patch_module`). Raises `BridgeImportError` when the Bridge
    is not installed (``pip install megatron-tree[hf]``) or cannot be imported."""
    if "megatron.bridge" in sys.modules:
        return sys.modules["megatron.bridge"]
    bridge = _import_bridge()
    from .megatron_core import is_enabled, patch_module

    if not torch.cuda.is_available() and is_enabled():  # (a CPU run enables the layer before building models)
        for name in [n for n in sys.modules if n.startswith("megatron.bridge.models.conversion.")]:
            patch_module(sys.modules[name])
    return bridge


def _import_bridge():
    spec = importlib.util.find_spec("megatron.bridge")
    if spec is None or not spec.submodule_search_locations:
        raise BridgeImportError("megatron-bridge is not installed: pip install 'megatron-tree[hf]' "
                                "(megatron-bridge, transformers; Python 3.12, megatron-core >= 0.19)")
    if module_available("transformer_engine"):
        return importlib.import_module("megatron.bridge")
    with _LOCK:
        for name in _megatron_core_modules_named_by(Path(spec.submodule_search_locations[0])):
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the Bridge's own import reports what it really needs
                pass
        before = set(sys.modules)
        finder = _StandInFinder()
        sys.meta_path.insert(0, finder)
        # the Bridge logs a traceback for every optional TE symbol it probes (at import and later, when a
        # provider first asks for one); that is expected here, so its probe log shows warnings only (a
        # filter: the module sets its own logger to INFO, with a handler of its own, when it is imported)
        _drop_probe_notes(logging.getLogger("megatron.bridge.utils.import_utils"))
        try:
            bridge = importlib.import_module("megatron.bridge")
        except Exception as e:
            raise BridgeImportError(f"import megatron.bridge failed on this host (no transformer-engine): "
                                    f"{type(e).__name__}: {e}") from e
        finally:
            sys.meta_path.remove(finder)
            for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
                del sys.modules[name]
        held = sorted(f"{n}.{k}" for n in set(sys.modules) - before if n.startswith("megatron.core")
                      for k, v in vars(sys.modules[n]).items()
                      if isinstance(v, (_StandInModule, _StandInClass)))
        if held:
            raise BridgeImportError(f"Megatron-Core modules imported while megatron.bridge was imported hold the "
                                    f"transformer-engine stand-in: {held}")
    return bridge


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm with a zero-centred gain, ``(1 + weight) * x / sqrt(mean(x^2) + eps)`` (TE's
    ``zero_centered_gamma``, Qwen3-Next's norms), with Megatron's norm constructor and the
    ``sequence_parallel`` flag on its weight."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = True, normalization: str = "RMSNorm"):
        super().__init__()
        if normalization != "RMSNorm":
            raise ValueError(f"ZeroCenteredRMSNorm is an RMSNorm, got normalization={normalization!r}")
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype)
                                         if zero_centered_gamma else torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x):
        dtype = x.dtype
        h = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        gain = (1 + self.weight) if self.zero_centered_gamma else self.weight
        return (h * gain.to(h.dtype)).to(dtype)


def swap_norms(spec, norm):
    """Copy of a spec with every Megatron torch norm (``WrappedTorchNorm`` / ``FusedLayerNorm`` used
    by local specs) replaced by ``norm``."""
    import copy
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, type):
        return norm if spec.__name__ in ("WrappedTorchNorm", "FusedLayerNorm", "TENorm") else spec
    if isinstance(spec, ModuleSpec):
        spec = copy.copy(spec)
        if isinstance(spec.module, type) and spec.module.__name__ in ("WrappedTorchNorm", "FusedLayerNorm", "TENorm"):
            spec.module = norm
        if spec.submodules is not None:
            spec.submodules = swap_norms(spec.submodules, norm)
        return spec
    if isinstance(spec, list):
        return [swap_norms(s, norm) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        spec = copy.copy(spec)
        for f in dataclasses.fields(spec):
            setattr(spec, f.name, swap_norms(getattr(spec, f.name), norm))
        return spec
    return spec
