"""Tree causal conv1d against a per-sample direct convolution."""
import pytest
import torch
import torch.nn.functional as F

from megatron_tree.ops.causal_conv1d import tree_causal_conv1d
from megatron_tree.tree.layout import TreeLayout
from tests.forests import random_forest

F64 = torch.float64


def _sample_conv(x, weight, bias, activation):
    """One sample x [L,C] in path order: y[t] = sum_j weight[:, j] * x[t - (W-1-j)] (zero before t=0)."""
    L, _ = x.shape
    W = weight.shape[1]
    y = torch.zeros_like(x)
    for j in range(W):
        back = W - 1 - j
        if back < L:
            y = y + weight[:, j] * torch.cat([x.new_zeros(back, x.shape[1]), x[: L - back]])
    if bias is not None:
        y = y + bias
    return F.silu(y) if activation == "silu" else y


def _leaves(N, Cn, W, *, seed, dtype=F64, with_bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, Cn, generator=g, dtype=F64).to(dtype).requires_grad_()
    w = torch.randn(Cn, W, generator=g, dtype=F64).to(dtype).requires_grad_()
    b = torch.randn(Cn, generator=g, dtype=F64).to(dtype).requires_grad_() if with_bias else None
    return x, w, b


@pytest.mark.parametrize("seed,W,activation,with_bias", [
    (0, 2, None, True), (1, 3, "silu", True), (2, 4, "silu", False), (3, 4, None, True), (4, 1, "silu", True),
    (5, 6, None, False),  # window longer than many short segments: halos cross several segments
])
def test_tree_conv_matches_per_sample(seed, W, activation, with_bias):
    layout, samples = random_forest(seed)
    Cn = 5
    x, w, b = _leaves(layout.num_rows, Cn, W, seed=seed, with_bias=with_bias)
    y = tree_causal_conv1d(x, w, b, layout, activation=activation)
    assert y.shape == x.shape and torch.isfinite(y).all()
    oracle = [_sample_conv(x[r], w, b, activation) for r in samples]
    for r, o in zip(samples, oracle):
        torch.testing.assert_close(y[r], o, atol=1e-12, rtol=1e-12)
    g = torch.Generator().manual_seed(seed + 100)
    cots = [torch.randn(len(r), Cn, generator=g, dtype=F64) for r in samples]
    leaves = [t for t in (x, w, b) if t is not None]
    grads = torch.autograd.grad(sum((y[r] * c).sum() for r, c in zip(samples, cots)), leaves)
    grads_ref = torch.autograd.grad(sum((o * c).sum() for o, c in zip(oracle, cots)), leaves)
    for name, a, e in zip(["x", "weight", "bias"], grads, grads_ref):
        torch.testing.assert_close(a, e, atol=1e-11, rtol=1e-11, msg=name)


def test_tree_conv_halo_follows_parent_not_sibling():
    # root rows 0-2, children [3,4] and [5,6]: row 5's halo is rows 2, 1 (parent tail), not 4, 3
    layout = TreeLayout.from_segments([3, 2, 2], [-1, 0, 0])
    x = torch.arange(1.0, 8.0, dtype=F64).unsqueeze(1) ** 2      # distinct values per row
    w = torch.tensor([[100.0, 10.0, 1.0]], dtype=F64)             # taps: 2 back, 1 back, self
    y = tree_causal_conv1d(x, w, None, layout)
    xs = x[:, 0]
    assert y[5, 0] == xs[5] + 10 * xs[2] + 100 * xs[1]
    assert y[3, 0] == xs[3] + 10 * xs[2] + 100 * xs[1]
    assert y[0, 0] == xs[0] and y[1, 0] == xs[1] + 10 * xs[0]


def test_tree_conv_padding_rows_see_only_themselves():
    layout = TreeLayout.from_segments([4], [-1], num_padding=3)
    x, w, b = _leaves(layout.num_rows, 3, 4, seed=1)
    y = tree_causal_conv1d(x, w, b, layout)
    torch.testing.assert_close(y[4:], x[4:] * w[:, 3] + b, atol=0, rtol=0)


def test_tree_conv_float32_sanity():
    layout, samples = random_forest(7, max_len=30)
    x, w, b = _leaves(layout.num_rows, 16, 4, seed=7, dtype=torch.float32)
    y = tree_causal_conv1d(x, w, b, layout, activation="silu")
    assert y.dtype == torch.float32
    for r in samples:
        ref = _sample_conv(x[r].double(), w.double(), b.double(), "silu")
        torch.testing.assert_close(y[r].double(), ref, atol=1e-5, rtol=1e-5)


def test_tree_conv_errors():
    layout, _ = random_forest(0)
    x, w, b = [t.detach() for t in _leaves(layout.num_rows, 4, 3, seed=0)]
    with pytest.raises(ValueError, match="activation"):
        tree_causal_conv1d(x, w, b, layout, activation="relu")
    with pytest.raises(ValueError, match="weight"):
        tree_causal_conv1d(x, w[:2], b, layout)
    with pytest.raises(ValueError, match="bias"):
        tree_causal_conv1d(x, w, b[:2], layout)
    with pytest.raises(ValueError, match="rows"):
        tree_causal_conv1d(x[:-1], w, b, layout)
    with pytest.raises(ValueError, match="backend"):
        tree_causal_conv1d(x, w, b, layout, backend="cuda_kernel")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tree_conv_cuda_matches_cpu():
    layout, _ = random_forest(3)
    x, w, b = [t.detach() for t in _leaves(layout.num_rows, 8, 4, seed=3)]
    y = tree_causal_conv1d(x, w, b, layout, activation="silu")
    y_gpu = tree_causal_conv1d(x.cuda(), w.cuda(), b.cuda(), layout.to("cuda"), activation="silu")
    torch.testing.assert_close(y_gpu.cpu(), y, atol=1e-12, rtol=1e-12)
