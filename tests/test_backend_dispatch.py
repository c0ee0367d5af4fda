"""ops/backend.py's "auto as on a GPU" mode of the kernel tier's switch and its dispatch log."""
from __future__ import annotations

import pytest
import torch

from megatron_tree.ops import backend as B
from megatron_tree.ops import tree_attention
from megatron_tree.tree import Sample, pack


def test_auto_mode_resolves_cpu_tensors_as_cuda_ones_only_inside_its_block(monkeypatch):
    monkeypatch.setattr(B, "module_available", lambda name: name != "missing.pkg")
    x, gpu = torch.zeros(2), {"fla": "fla.ops"}
    assert not B.cpu_kernels_auto()
    with B.cpu_kernels():  # the plain switch: named backends only, "auto" stays torch
        assert B.select_backend("op", "auto", x, gpu) == "torch" and not B.cpu_kernels_auto()
    with B.cpu_kernels(auto=True):
        assert B.cpu_kernels_allowed() and B.cpu_kernels_auto()
        assert B.select_backend("op", "auto", x, gpu) == "fla"
        assert B.select_backend("op", "auto", x, {"x": "missing.pkg", "fla": "fla.ops"}) == "fla"  # preference order
        assert B.select_backend("op", "auto", x, {"x": "missing.pkg"}) == "torch"  # no importable package
        assert B.select_backend("op", "torch", x, gpu) == "torch"
        with B.cpu_kernels():  # a nested plain block turns auto off, and restores it after
            assert not B.cpu_kernels_auto()
        assert B.cpu_kernels_auto()
    assert not B.cpu_kernels_allowed() and not B.cpu_kernels_auto()
    B.allow_cpu_kernels(False, auto=True)  # auto needs the switch
    assert not B.cpu_kernels_auto()
    with pytest.raises(RuntimeError, match="CUDA tensors only"):
        B.select_backend("op", "fla", x, gpu)


def test_dispatch_log_records_each_resolution_in_order():
    layout = pack([Sample(tokens=[1, 2, 3, 4, 5])], 8)[0].layout
    q = torch.randn(layout.num_rows, 2, 4)
    with B.record_dispatch() as outer:
        B.select_backend("a", "torch", q, {})
        with B.record_dispatch() as inner:
            tree_attention(q, q, q, layout)  # "auto" on CPU: torch
        B.select_backend("b", "auto", q, {"fla": "fla.ops"})
    B.select_backend("c", "torch", q, {})  # no log open: nothing recorded
    assert inner == [("tree_attention", "torch")]
    assert outer == [("a", "torch"), ("tree_attention", "torch"), ("b", "torch")]
