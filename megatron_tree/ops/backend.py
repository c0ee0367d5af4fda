"""Backend selection shared by every tree op.

``backend="torch"`` is the reference that runs everywhere (and the oracle in tests); named GPU
backends are optional extras. ``"auto"`` picks the op's GPU backend only for CUDA tensors whose
package imports, and the torch backend otherwise. A named backend that cannot run is an error,
never a silent fallback.

**CPU kernels switch** (off by default): :func:`allow_cpu_kernels` lets a *named* GPU backend
accept CPU tensors. Its only use is the kernel test tier (``make test-kernels``), which runs the
real Triton kernels of FLA / mamba-ssm / FlexAttention on CPU tensors through Triton's
interpreter (``TRITON_INTERPRET=1``, with harness-side patches in ``tests_kernels/harness.py``)
to test the exact calls the GPU backends make. By default ``"auto"`` never picks a GPU backend for
CPU tensors, switch or not. Nothing in the library turns it on.

**auto as on a GPU** (``allow_cpu_kernels(True, auto=True)`` / ``with cpu_kernels(auto=True):``,
off by default, needs the switch): ``"auto"`` then resolves for CPU tensors exactly as it does for
CUDA tensors, so a whole model built with the default ``backend="auto"`` takes the GPU code path
(FLA, mamba-ssm, FlexAttention where their packages import, and the same dtype rules) on CPU. The
kernel tier uses it to run whole models on the GPU path (``tests_kernels/test_model_gpu_path.py``).

**Dispatch log** (:func:`record_dispatch`): every `select_backend` call inside the block appends
``(op, backend)`` (the resolved name) to a list, so a test can assert which implementation each op
of a model really took. Costs nothing when no log is open.
"""
from __future__ import annotations

import contextlib
import importlib
from functools import lru_cache
from typing import Iterator

import torch

TORCH = "torch"


@lru_cache(maxsize=None)
def module_available(name: str) -> bool:
    """True when ``name`` imports (cached). GPU packages may fail at import on CPU-only hosts."""
    try:
        importlib.import_module(name)
        return True
    except Exception:  # ImportError, or CUDA/driver errors raised by GPU packages at import time
        return False


_CPU_KERNELS = False
_CPU_AUTO = False  # "auto" resolves CPU tensors as CUDA ones (only while _CPU_KERNELS is on)
_DISPATCH_LOGS: list[list] = []  # open record_dispatch() lists, innermost last


def allow_cpu_kernels(enabled: bool = True, *, auto: bool = False) -> bool:
    """Let named GPU backends take CPU tensors (kernel tier only; see the module doc); with ``auto``
    also let ``"auto"`` pick them for CPU tensors, as on a GPU. Returns the previous ``enabled``
    setting (``auto`` is reset to the given value on every call)."""
    global _CPU_KERNELS, _CPU_AUTO
    previous, _CPU_KERNELS = _CPU_KERNELS, bool(enabled)
    _CPU_AUTO = bool(enabled) and bool(auto)
    return previous


def cpu_kernels_allowed() -> bool:
    return _CPU_KERNELS


def cpu_kernels_auto() -> bool:
    """True while ``"auto"`` resolves CPU tensors as CUDA tensors (``allow_cpu_kernels(True, auto=True)``)."""
    return _CPU_KERNELS and _CPU_AUTO


@contextlib.contextmanager
def cpu_kernels(*, auto: bool = False) -> Iterator[None]:
    """``with cpu_kernels():`` the switch is on inside the block (with ``auto=True`` for ``"auto"``
    too), both settings restored after."""
    global _CPU_AUTO
    previous_auto = _CPU_AUTO
    previous = allow_cpu_kernels(True, auto=auto)
    try:
        yield
    finally:
        allow_cpu_kernels(previous)
        _CPU_AUTO = previous and previous_auto


@contextlib.contextmanager
def record_dispatch() -> Iterator[list]:
    """``with record_dispatch() as log:`` every `select_backend` call in the block appends
    ``(op, resolved backend)`` to ``log`` (nested logs each get every entry). Ops that resolve a
    backend once per stage or level (CP waves, recurrent levels) log once per call."""
    log: list = []
    _DISPATCH_LOGS.append(log)
    try:
        yield log
    finally:
        _DISPATCH_LOGS.remove(log)


def _logged(op: str, name: str) -> str:
    for log in _DISPATCH_LOGS:
        log.append((op, name))
    return name


def select_backend(op: str, backend: str, tensor: torch.Tensor, gpu_backends: dict[str, str]) -> str:
    """Resolve ``backend`` for ``op``.

    ``gpu_backends`` maps backend name -> module it needs, in order of preference. Returns
    ``"torch"`` or one of its keys; raises ValueError/RuntimeError with the reason otherwise.
    """
    return _logged(op, _select(op, backend, tensor, gpu_backends))


def _select(op: str, backend: str, tensor: torch.Tensor, gpu_backends: dict[str, str]) -> str:
    if backend == TORCH:
        return TORCH
    if backend == "auto":
        if tensor.is_cuda or cpu_kernels_auto():
            for name, module in gpu_backends.items():
                if module_available(module):
                    return name
        return TORCH
    if backend not in gpu_backends:
        raise ValueError(f"{op}: unknown backend {backend!r}; choose 'auto', 'torch' or one of {sorted(gpu_backends)}")
    module = gpu_backends[backend]
    if not module_available(module):
        raise RuntimeError(f"{op}: backend {backend!r} needs the package {module!r}, which does not import here "
                           f"(install the [gpu] extra on a CUDA machine)")
    if not tensor.is_cuda and not _CPU_KERNELS:
        raise RuntimeError(f"{op}: backend {backend!r} runs on CUDA tensors only; got {tensor.device}")
    return backend
