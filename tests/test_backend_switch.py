"""The kernel tier's switch in ops/backend.py: off by default, explicit, and never changes "auto"."""
from __future__ import annotations

import pytest
import torch

from megatron_tree.ops import backend as B


def test_cpu_kernels_switch_is_off_by_default_and_scoped(monkeypatch):
    assert not B.cpu_kernels_allowed()  # nothing in the library turns it on
    monkeypatch.setattr(B, "module_available", lambda name: True)  # as if the GPU package imported
    x = torch.zeros(2)
    with pytest.raises(RuntimeError, match="CUDA tensors only"):
        B.select_backend("op", "fla", x, {"fla": "fla.ops"})
    with B.cpu_kernels():
        assert B.cpu_kernels_allowed()
        assert B.select_backend("op", "fla", x, {"fla": "fla.ops"}) == "fla"
        assert B.select_backend("op", "auto", x, {"fla": "fla.ops"}) == "torch"  # auto: CUDA tensors only
    assert not B.cpu_kernels_allowed()
    assert B.allow_cpu_kernels(True) is False and B.allow_cpu_kernels(False) is True
