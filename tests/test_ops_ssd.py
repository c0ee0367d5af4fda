"""Tree SSD (Mamba-2) and its batch-first chunked kernel against token-by-token oracles."""
import pytest
import torch
import torch.nn.functional as F

from megatron_tree.ops.backend import module_available
from megatron_tree.ops.ssd import ssd_chunked_torch, ssd_recurrent_ref, tree_ssd
from megatron_tree.tree.layout import TreeLayout
from tests.forests import random_forest

F64 = torch.float64


def _batch_inputs(b, T, H, P, G, S, *, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)
    x, B, C, D, h0 = r(b, T, H, P), r(b, T, G, S), r(b, T, G, S), r(H), r(b, H, P, S)
    dt = F.softplus(r(b, T, H))
    A = -(0.3 + torch.rand(H, generator=g, dtype=F64))
    return [t.to(dtype) for t in (x, dt, A, B, C, D, h0)]


def _tree_inputs(N, H, P, G, S, *, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)
    x, B, C, D = r(N, H, P), r(N, G, S), r(N, G, S), r(H)
    dt = F.softplus(r(N, H) - 0.5)
    A = -(0.2 + torch.rand(H, generator=g, dtype=F64))
    return [t.to(dtype).requires_grad_() for t in (x, dt, A, B, C, D)]


def _sample_oracle(x, dt, A, B, C, D):
    """One sample, token by token: x [L,H,P], dt [L,H], B/C [L,G,S] -> y [L,H,P] from a zero state."""
    L, H, P = x.shape
    G, S = B.shape[1:]
    grp = torch.arange(H) // (H // G)
    h = x.new_zeros(H, P, S)
    ys = []
    for t in range(L):
        h = torch.exp(dt[t] * A)[:, None, None] * h + (dt[t][:, None] * x[t])[:, :, None] * B[t][grp][:, None, :]
        ys.append((h * C[t][grp][:, None, :]).sum(-1) + D[:, None] * x[t])
    return torch.stack(ys)


# ------------------------------------------------------------------ batch-first chunked kernel
@pytest.mark.parametrize("T,chunk,H,G,with_init", [
    (100, 64, 4, 2, True),    # tail chunk shorter than the chunk size
    (37, 16, 4, 1, False),
    (5, 64, 2, 2, True),      # a single short chunk
    (300, 4, 2, 1, True),     # 75 chunks: blocked chunk-to-chunk scan
    (1500, 1, 2, 2, False),   # 1500 chunks: the blocked scan recurses twice
])
def test_chunked_matches_recurrent(T, chunk, H, G, with_init):
    x, dt, A, B, C, D, h0 = _batch_inputs(2, T, H, 3, G, 5, seed=T)
    leaves = [t.requires_grad_() for t in (x, dt, A, B, C, D, h0)]
    init = h0 if with_init else None
    y, fin = ssd_chunked_torch(x, dt, A, B, C, D=D, initial_state=init, chunk_size=chunk, return_final_state=True)
    y_ref, fin_ref = ssd_recurrent_ref(x, dt, A, B, C, D=D, initial_state=init, return_final_state=True)
    torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(fin, fin_ref, atol=1e-10, rtol=1e-10)
    gy, gf = torch.randn_like(y), torch.randn_like(fin)
    wrt = leaves if with_init else leaves[:-1]
    grads = torch.autograd.grad((y * gy).sum() + (fin * gf).sum(), wrt)
    grads_ref = torch.autograd.grad((y_ref * gy).sum() + (fin_ref * gf).sum(), wrt)
    for name, a, b in zip("x dt A B C D h0".split(), grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=name)


def test_chunked_no_D_and_no_final_state():
    x, dt, A, B, C, _, _ = _batch_inputs(1, 70, 2, 2, 1, 3, seed=3)
    y = ssd_chunked_torch(x, dt, A, B, C, chunk_size=32)
    torch.testing.assert_close(y, ssd_recurrent_ref(x, dt, A, B, C), atol=1e-10, rtol=1e-10)


def test_D_per_head_and_channel():
    # Megatron's D_has_hdim: D [H,P] scales each channel of the skip connection
    x, dt, A, B, C, _, _ = _batch_inputs(1, 20, 2, 3, 1, 3, seed=4)
    D = torch.randn(2, 3, dtype=F64)
    y = ssd_chunked_torch(x, dt, A, B, C, D=D, chunk_size=8)
    torch.testing.assert_close(y, ssd_recurrent_ref(x, dt, A, B, C) + x * D, atol=1e-10, rtol=1e-10)
    layout = TreeLayout.from_segments([20], [-1])
    y_tree = tree_ssd(x[0], dt[0], A, B[0], C[0], layout, D=D, backend="torch")
    torch.testing.assert_close(y_tree, y[0], atol=1e-10, rtol=1e-10)


def test_chunked_stable_under_extreme_decay_float32():
    # Half a chunk of very strong decay followed by mild decay. Running sums inside the chunk reach
    # ~-32000, where float32 spacing is ~0.004: any decay built as a difference of running sums is
    # off by ~0.4%, while sums taken over the steps between s and t stay exact.
    T, H = 64, 2
    x, dt, A, B, C, D, h0 = _batch_inputs(1, T, H, 4, 1, 4, seed=11)
    A = torch.full((H,), -20.0, dtype=F64)
    dt = 0.04 + 0.02 * torch.rand(1, T, H, generator=torch.Generator().manual_seed(0), dtype=F64)
    dt[:, :32] *= 1000.0
    y_ref, f_ref = ssd_recurrent_ref(x, dt, A, B, C, D=D, initial_state=h0, return_final_state=True)
    to32 = lambda *ts: [t.float() for t in ts]
    y, f = ssd_chunked_torch(*to32(x, dt, A, B, C), D=D.float(), initial_state=h0.float(), chunk_size=64,
                             return_final_state=True)
    assert torch.isfinite(y).all() and torch.isfinite(f).all()
    torch.testing.assert_close(y.double(), y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(f.double(), f_ref, atol=1e-4, rtol=1e-4)
    # float64 exact even when every state is crushed to zero (exp underflow, no NaN from 0 * inf)
    y64 = ssd_chunked_torch(x, dt * 100, A, B, C, D=D, initial_state=h0, chunk_size=16)
    torch.testing.assert_close(y64, ssd_recurrent_ref(x, dt * 100, A, B, C, D=D, initial_state=h0),
                               atol=1e-10, rtol=1e-10)


def test_chunked_float32_sanity():
    x, dt, A, B, C, D, h0 = _batch_inputs(2, 150, 4, 8, 2, 8, seed=5)
    y_ref = ssd_recurrent_ref(x, dt, A, B, C, D=D, initial_state=h0)
    y = ssd_chunked_torch(*[t.float() for t in (x, dt, A, B, C)], D=D.float(), initial_state=h0.float())
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), y_ref, atol=2e-4, rtol=2e-4)


def test_chunked_bfloat16_returns_input_dtype():
    x, dt, A, B, C, D, _ = _batch_inputs(1, 40, 2, 4, 1, 4, seed=9)
    y, fin = ssd_chunked_torch(x.bfloat16(), dt.bfloat16(), A.float(), B.bfloat16(), C.bfloat16(), D=D.float(),
                               return_final_state=True)
    assert y.dtype == torch.bfloat16 and fin.dtype == torch.float32
    y_ref = ssd_recurrent_ref(*[t.bfloat16().double() for t in (x, dt)], A, *[t.bfloat16().double() for t in (B, C)],
                              D=D)
    torch.testing.assert_close(y.double(), y_ref, atol=5e-2, rtol=2e-2)


def test_chunked_shape_errors():
    x, dt, A, B, C, D, h0 = _batch_inputs(1, 8, 4, 2, 2, 3, seed=0)
    with pytest.raises(ValueError, match="multiple"):
        ssd_chunked_torch(x, dt, A, B[:, :, :1].expand(1, 8, 3, 3), C[:, :, :1].expand(1, 8, 3, 3))
    with pytest.raises(ValueError, match="dt"):
        ssd_chunked_torch(x, dt[:, :, :2], A, B, C)
    with pytest.raises(ValueError, match="initial_state"):
        ssd_chunked_torch(x, dt, A, B, C, initial_state=h0[:, :2])
    with pytest.raises(ValueError, match="D"):
        ssd_chunked_torch(x, dt, A, B, C, D=D[:2])


# ------------------------------------------------------------------ tree SSD
def _check_tree_vs_oracle(layout, samples, *, H, P, G, S, seed, dtype=F64, tol=1e-10, chunk_size=64):
    x, dt, A, B, C, D = _tree_inputs(layout.num_rows, H, P, G, S, seed=seed, dtype=dtype)
    y = tree_ssd(x, dt, A, B, C, layout, D=D, backend="torch", chunk_size=chunk_size)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.isfinite(y).all()  # padding rows included
    g = torch.Generator().manual_seed(seed + 1)
    cots = [torch.randn(len(r), H, P, generator=g, dtype=F64).to(dtype) for r in samples]
    oracle = [_sample_oracle(x[r], dt[r], A, B[r], C[r], D) for r in samples]
    for r, o in zip(samples, oracle):
        torch.testing.assert_close(y[r], o, atol=tol, rtol=tol)
    leaves = (x, dt, A, B, C, D)
    grads = torch.autograd.grad(sum((y[r] * c).sum() for r, c in zip(samples, cots)), leaves)
    grads_ref = torch.autograd.grad(sum((o * c).sum() for o, c in zip(oracle, cots)), leaves)
    for name, a, b in zip("x dt A B C D".split(), grads, grads_ref):
        torch.testing.assert_close(a, b, atol=10 * tol, rtol=10 * tol, msg=name)


@pytest.mark.parametrize("seed,H,G", [(0, 4, 2), (1, 2, 1), (2, 3, 3), (3, 4, 1)])
def test_tree_ssd_random_forests(seed, H, G):
    layout, samples = random_forest(seed)
    assert layout.num_levels >= 3
    _check_tree_vs_oracle(layout, samples, H=H, P=3, G=G, S=4, seed=seed)


def test_tree_ssd_long_segments():
    layout, samples = random_forest(21, max_len=150, max_depth=2, num_trees=1, num_padding=1)
    assert int(layout.segment_lengths.max()) > 64  # several chunks inside one segment
    _check_tree_vs_oracle(layout, samples, H=2, P=2, G=1, S=3, seed=21)


def test_tree_ssd_small_chunks_deep_forest():
    # chunk 2 puts many chunks (and the blocked chunk scan) inside segments of a deep forest
    layout, samples = random_forest(5, max_len=40, max_depth=4, num_trees=1, num_padding=0)
    _check_tree_vs_oracle(layout, samples, H=2, P=2, G=2, S=2, seed=5, chunk_size=2)


def test_tree_ssd_float32_sanity():
    layout, samples = random_forest(4, max_len=80)
    _check_tree_vs_oracle(layout, samples, H=4, P=4, G=2, S=4, seed=4, dtype=torch.float32, tol=2e-4)


def test_tree_ssd_without_D_and_siblings_isolated():
    # root [0,1,2] with children [3,4] and [5,6]: row 5 continues row 2, never row 4
    layout = TreeLayout.from_segments([3, 2, 2], [-1, 0, 0])
    x, dt, A, B, C, _ = _tree_inputs(7, 2, 2, 1, 2, seed=8)
    y = tree_ssd(x, dt, A, B, C, layout)  # backend "auto" is torch on CPU
    for rows in ([0, 1, 2, 3, 4], [0, 1, 2, 5, 6]):
        r = torch.tensor(rows)
        torch.testing.assert_close(y[r], _sample_oracle(x[r], dt[r], A, B[r], C[r], torch.zeros(2, dtype=F64)),
                                   atol=1e-12, rtol=1e-12)
    (gx,) = torch.autograd.grad(y[5].sum(), x)
    assert gx[[3, 4]].abs().max() == 0 and gx[[0, 1, 2, 5]].abs().min() > 0


def test_tree_ssd_errors():
    layout, _ = random_forest(0)
    N = layout.num_rows
    x, dt, A, B, C, D = [t.detach() for t in _tree_inputs(N, 4, 2, 2, 3, seed=0)]
    with pytest.raises(ValueError, match="rows"):
        tree_ssd(x[:-1], dt[:-1], A, B[:-1], C[:-1], layout)
    with pytest.raises(ValueError, match="multiple"):
        tree_ssd(x, dt, A, torch.zeros(N, 3, 3, dtype=F64), torch.zeros(N, 3, 3, dtype=F64), layout)
    with pytest.raises(ValueError, match="A"):
        tree_ssd(x, dt, A[:2], B, C, layout)
    with pytest.raises(ValueError, match="backend"):
        tree_ssd(x, dt, A, B, C, layout, backend="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):
            tree_ssd(x, dt, A, B, C, layout, backend="mamba")


# ------------------------------------------------------------------ GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_tree_ssd_torch_backend_on_cuda_matches_cpu():
    layout, samples = random_forest(6, max_len=90)
    x, dt, A, B, C, D = _tree_inputs(layout.num_rows, 4, 8, 2, 8, seed=6)
    y_cpu = tree_ssd(x, dt, A, B, C, layout, D=D, backend="torch")
    dev = [t.detach().cuda().requires_grad_() for t in (x, dt, A, B, C, D)]
    y_gpu = tree_ssd(*dev[:5], layout.to("cuda"), D=dev[5], backend="torch")
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, atol=1e-10, rtol=1e-10)


@cuda
@pytest.mark.skipif(not module_available("mamba_ssm"), reason="needs mamba-ssm")
def test_tree_ssd_mamba_backend_matches_torch():
    layout, samples = random_forest(7, max_len=150, num_trees=3)
    host = _tree_inputs(layout.num_rows, 8, 64, 2, 64, seed=7, dtype=torch.float32)
    ins = [t.detach().cuda() for t in host]
    outs = {}
    for backend in ("torch", "mamba"):
        leaves = [t.clone().requires_grad_() for t in ins]
        y = tree_ssd(*leaves[:5], layout.to("cuda"), D=leaves[5], backend=backend)
        g = torch.Generator(device="cuda").manual_seed(0)
        cot = torch.randn(y.shape, generator=g, device="cuda")
        grads = torch.autograd.grad((y * cot).sum(), leaves)
        outs[backend] = (y, grads)
    scale = outs["torch"][0].abs().max()
    torch.testing.assert_close(outs["mamba"][0], outs["torch"][0], atol=1e-2 * scale, rtol=1e-2)
    for name, a, b in zip("x dt A B C D".split(), outs["mamba"][1], outs["torch"][1]):
        torch.testing.assert_close(a, b, atol=2e-2 * b.abs().max(), rtol=2e-2, msg=name)


def test_tree_ssd_initial_and_final_states_continue_a_cut_chain():
    """A chain cut in two: the second part from the first part's final state (``final_segments``,
    ``initial_state`` / ``initial_index``) equals the whole chain, in value and in every gradient;
    two roots may start from one state (carry's forks under a carried row)."""
    H, P, G, S, n1, n2 = 4, 3, 2, 5, 11, 9
    x, dt, A, B, C, _ = _tree_inputs(n1 + n2, H, P, G, S, seed=3)
    ins = [t.detach().clone().requires_grad_(True) for t in (x, dt, A, B, C)]
    whole = tree_ssd(*ins, TreeLayout.from_segments([n1 + n2], [-1]), backend="torch", chunk_size=4)
    w = torch.randn_like(whole)
    (whole * w).sum().backward()
    want = [t.grad.clone() for t in ins]
    for t in ins:
        t.grad = None
    xs, dts, _, Bs, Cs = ins
    a = slice(0, n1)
    y1, fin = tree_ssd(xs[a], dts[a], ins[2], Bs[a], Cs[a], TreeLayout.from_segments([n1], [-1]), backend="torch",
                       chunk_size=4, final_segments=[0])
    b = slice(n1, n1 + n2)
    # the second part twice, as two roots that start from the same state
    cat = lambda t: torch.cat([t[b], t[b]])
    y2 = tree_ssd(cat(xs), cat(dts), ins[2], cat(Bs), cat(Cs), TreeLayout.from_segments([n2, n2], [-1, -1]),
                  backend="torch", chunk_size=4, initial_state=fin, initial_index=[0, 0])
    torch.testing.assert_close(torch.cat([y1, y2[:n2]]), whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(y2[n2:], y2[:n2], rtol=0, atol=0)
    (torch.cat([y1, 0.5 * y2[:n2] + 0.5 * y2[n2:]]) * w).sum().backward()
    for t, g in zip(ins, want):
        torch.testing.assert_close(t.grad, g, rtol=0, atol=1e-11)
