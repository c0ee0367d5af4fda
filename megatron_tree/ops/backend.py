"""Backend selection shared by every tree op.

``backend="torch"`` is the reference that runs everywhere (and the oracle in tests); named GPU
backends are optional extras. ``"auto"`` picks the op's GPU backend only for CUDA tensors whose
package imports, and the torch backend otherwise. A named backend that cannot run is an error,
never a silent fallback.

**CPU kernels switch** (off by default): :func:`allow_cpu_kernels` lets a *named* GPU backend
accept CPU tensors. Its only use is the kernel test tier (``make test-kernels``), which runs the
real Triton kernels of FLA / mamba-ssm / FlexAttention on CPU tensors through Triton's
interpreter (``TRITON_INTERPRET=1``, with harness-side patches in ``tests_kernels/conftest.py``)
to test the exact calls the GPU backends make. ``"auto"`` never picks a GPU backend for CPU
tensors, switch or not. Nothing in the library turns it on.
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


def allow_cpu_kernels(enabled: bool = True) -> bool:
    """Let named GPU backends take CPU tensors (kernel tier only; see the module doc). Returns the
    previous setting."""
    global _CPU_KERNELS
    previous, _CPU_KERNELS = _CPU_KERNELS, bool(enabled)
    return previous


def cpu_kernels_allowed() -> bool:
    return _CPU_KERNELS


@contextlib.contextmanager
def cpu_kernels() -> Iterator[None]:
    """``with cpu_kernels():`` the switch is on inside the block, restored after."""
    previous = allow_cpu_kernels(True)
    try:
        yield
    finally:
        allow_cpu_kernels(previous)


def select_backend(op: str, backend: str, tensor: torch.Tensor, gpu_backends: dict[str, str]) -> str:
    """Resolve ``backend`` for ``op``.

    ``gpu_backends`` maps backend name -> module it needs, in order of preference. Returns
    ``"torch"`` or one of its keys; raises ValueError/RuntimeError with the reason otherwise.
    """
    if backend == TORCH:
        return TORCH
    if backend == "auto":
        if tensor.is_cuda:
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
