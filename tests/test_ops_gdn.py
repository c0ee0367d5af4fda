"""Tree gated delta rule vs independent per-sample token-by-token recurrences (float64, CPU)."""
from __future__ import annotations

import pytest
import torch

from megatron_tree.ops.backend import module_available
from megatron_tree.ops.gated_delta_rule import (
    chunk_gated_delta_rule_torch,
    gated_delta_rule_state_map,
    recurrent_gated_delta_rule_ref,
    tree_gated_delta_rule,
)
from megatron_tree.tree.layout import TreeLayout
from tests.forests import path_rows, random_forest

F64 = torch.float64
TOL = 1e-10


def oracle(q, k, v, g, beta, scale, S0=None):
    """One sequence, token by token, in the product form S_t = (I - b k k^T) e^g S_{t-1} + b k v^T.

    q, k [T,H,K]; v [T,HV,V]; g, beta [T,HV]; value head h reads q/k head h // (HV // H).
    Returns (o [T,HV,V], S [HV,K,V]). Written independently of the module (different algebra).
    """
    T, H, K = q.shape
    HV, V = v.shape[1:]
    head = torch.arange(HV) // (HV // H)
    S = torch.zeros(HV, K, V, dtype=q.dtype) if S0 is None else S0
    eye = torch.eye(K, dtype=q.dtype)
    outs = []
    for t in range(T):
        kt = k[t, head]  # [HV,K]
        P = eye - beta[t, :, None, None] * kt[:, :, None] * kt[:, None, :]
        S = P @ (g[t].exp()[:, None, None] * S) + beta[t, :, None, None] * kt[:, :, None] * v[t, :, None, :]
        outs.append((S * (scale * q[t, head])[:, :, None]).sum(1))
    o = torch.stack(outs) if outs else v.new_zeros(0, HV, V)
    return o, S


def make_inputs(N, H, K, HV, V, dtype=F64, seed=0, lead=()):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*lead, N, *s, generator=gen, dtype=F64)
    q = r(H, K)
    k = torch.nn.functional.normalize(r(H, K), dim=-1)
    v = r(HV, V)
    g = torch.nn.functional.logsigmoid(r(HV) + 2.0)  # log decay in about (-2, 0)
    beta = torch.rand(*lead, N, HV, generator=gen, dtype=F64)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)]


def long_layout():
    """Segments longer than a chunk, so chunk boundaries fall inside segments; 2 padding rows.

    level 0: 150 (3 chunks), 1;  level 1: 70, 130, 65, 64 (2, 3, 2, 1 chunks);  level 2: 3.
    """
    lengths = [150, 70, 3, 130, 1, 65, 64]
    parents = [-1, 0, 1, 0, -1, 4, 4]
    layout = TreeLayout.from_segments(lengths, parents, num_padding=2)
    off = layout.segment_offsets.tolist()
    ends = [off[3] - 1, off[4] - 1, off[6] - 1, off[7] - 1,  # leaves
            100, off[1] + 30, off[4]]                        # prefixes, mid-segment and single row
    samples = [path_rows(layout, e) for e in ends] + [torch.tensor([layout.num_rows - 1])]  # a padding row
    return layout, samples


CASES = [random_forest(s) for s in (0, 1, 2)] + [random_forest(7, max_len=40, max_depth=2, num_padding=0)] + [
    long_layout()]


# ---------------------------------------------------------------------------- batch-first form
@pytest.mark.parametrize("T,chunk_size,H,HV", [(150, 64, 2, 4), (37, 64, 1, 1), (64, 16, 2, 2), (5, 2, 1, 3)])
def test_chunk_matches_token_recurrence(T, chunk_size, H, HV):
    B, K, V = 2, 5, 3
    q, k, v, g, beta = make_inputs(T, H, K, HV, V, lead=(B,), seed=T)
    S0 = torch.randn(B, HV, K, V, dtype=F64, requires_grad=True)
    scale = 0.7
    o, S = chunk_gated_delta_rule_torch(q, k, v, g, beta, scale=scale, initial_state=S0, output_final_state=True,
                                        chunk_size=chunk_size)
    ref = [oracle(q[b], k[b], v[b], g[b], beta[b], scale, S0[b]) for b in range(B)]
    o_ref = torch.stack([r[0] for r in ref])
    S_ref = torch.stack([r[1] for r in ref])
    torch.testing.assert_close(o, o_ref, rtol=0, atol=TOL)
    torch.testing.assert_close(S, S_ref, rtol=0, atol=TOL)
    Go, GS = torch.randn_like(o), torch.randn_like(S)
    inputs = (q, k, v, g, beta, S0)
    grads = torch.autograd.grad((o * Go).sum() + (S * GS).sum(), inputs)
    grads_ref = torch.autograd.grad((o_ref * Go).sum() + (S_ref * GS).sum(), inputs)
    for name, a, b in zip("q k v g beta S0".split(), grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL, msg=lambda m: f"d{name}: {m}")


def test_recurrent_reference_and_defaults():
    B, T, H, K, HV, V = 2, 20, 2, 4, 4, 3
    q, k, v, g, beta = make_inputs(T, H, K, HV, V, lead=(B,), seed=3)
    o_ref, S_ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, output_final_state=True)
    for b in range(B):  # default scale K**-0.5 and zero initial state
        o_b, S_b = oracle(q[b], k[b], v[b], g[b], beta[b], K ** -0.5)
        torch.testing.assert_close(o_ref[b], o_b, rtol=0, atol=TOL)
        torch.testing.assert_close(S_ref[b], S_b, rtol=0, atol=TOL)
    o, S = chunk_gated_delta_rule_torch(q, k, v, g, beta, chunk_size=8)
    assert S is None and o.shape == (B, T, HV, V)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=TOL)


def test_state_map_is_affine_summary():
    B, T, H, K, HV, V = 2, 90, 1, 4, 2, 3
    q, k, v, g, beta = make_inputs(T, H, K, HV, V, lead=(B,), seed=5)
    S_in = torch.randn(B, HV, K, V, dtype=F64)
    M, E = gated_delta_rule_state_map(k, v, g, beta)
    assert M.shape == (B, HV, K, K) and E.shape == (B, HV, K, V)
    _, S_out = chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=S_in, output_final_state=True)
    torch.testing.assert_close(M @ S_in + E, S_out, rtol=0, atol=TOL)


# ----------------------------------------------------------------------------------- tree op
def _tree_vs_samples(layout, samples, H, HV, dtype=F64, seed=0):
    K, V = 4, 3
    N = layout.num_rows
    inputs = make_inputs(N, H, K, HV, V, dtype=dtype, seed=seed)
    scale = 0.9
    o = tree_gated_delta_rule(*inputs, layout, scale=scale, backend="torch")
    assert o.shape == (N, HV, V) and o.dtype == dtype
    assert torch.isfinite(o).all()
    gen = torch.Generator().manual_seed(seed + 1)
    cot = [torch.randn(len(r), HV, V, generator=gen, dtype=F64) for r in samples]
    x64 = [x.detach().to(F64).requires_grad_() for x in inputs]
    loss_ref = 0.0
    outs_ref = []
    for rows, G in zip(samples, cot):
        o_i, _ = oracle(*(x[rows] for x in x64), scale)
        outs_ref.append(o_i)
        loss_ref = loss_ref + (o_i * G).sum()
    loss_tree = sum((o[rows].to(F64) * G).sum() for rows, G in zip(samples, cot))
    return o, outs_ref, torch.autograd.grad(loss_tree, inputs), torch.autograd.grad(loss_ref, x64)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("H,HV", [(2, 2), (1, 2)])
def test_tree_matches_per_sample_recurrence(case, H, HV):
    layout, samples = CASES[case]
    o, outs_ref, grads, grads_ref = _tree_vs_samples(layout, samples, H, HV, seed=case)
    for rows, o_i in zip(samples, outs_ref):
        torch.testing.assert_close(o[rows], o_i, rtol=0, atol=TOL)
    covered = torch.zeros(layout.num_rows, dtype=torch.bool)
    for rows in samples:
        covered[rows] = True
    for name, a, b in zip("q k v g beta".split(), grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL, msg=lambda m: f"d{name}: {m}")
        assert (a[~covered] == 0).all()  # a row no sample reads gets no gradient


def test_tree_float32_sanity():
    layout, samples = CASES[-1]
    o, outs_ref, grads, grads_ref = _tree_vs_samples(layout, samples, 1, 2, dtype=torch.float32, seed=11)
    for rows, o_i in zip(samples, outs_ref):
        torch.testing.assert_close(o[rows].to(F64), o_i, rtol=1e-4, atol=1e-4)
    for name, a, b in zip("q k v g beta".split(), grads, grads_ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.to(F64), b, rtol=1e-3, atol=1e-3, msg=lambda m: f"d{name}: {m}")


def test_tree_default_scale_and_auto_backend_on_cpu():
    layout, samples = CASES[0]
    inputs = make_inputs(layout.num_rows, 2, 4, 2, 3, seed=4)
    o_auto = tree_gated_delta_rule(*inputs, layout)
    o_torch = tree_gated_delta_rule(*inputs, layout, scale=4 ** -0.5, backend="torch")
    assert torch.equal(o_auto, o_torch)
    rows = samples[0]
    o_i, _ = oracle(*(x[rows] for x in inputs), 4 ** -0.5)
    torch.testing.assert_close(o_auto[rows], o_i, rtol=0, atol=TOL)


def test_backend_and_shape_errors():
    layout, _ = CASES[0]
    N = layout.num_rows
    q, k, v, g, beta = make_inputs(N, 2, 4, 2, 3)
    with pytest.raises(ValueError, match="unknown backend"):
        tree_gated_delta_rule(q, k, v, g, beta, layout, backend="nope")
    if not (torch.cuda.is_available() and module_available("fla.ops.gated_delta_rule")):
        with pytest.raises(RuntimeError, match="fla"):
            tree_gated_delta_rule(q, k, v, g, beta, layout, backend="fla")
    with pytest.raises(ValueError, match="multiple"):
        tree_gated_delta_rule(q, k, v[:, :1].expand(N, 3, 3), g[:, :1].expand(N, 3), beta[:, :1].expand(N, 3), layout)
    with pytest.raises(ValueError, match="q must have shape"):
        tree_gated_delta_rule(q[:-1], k[:-1], v[:-1], g[:-1], beta[:-1], layout)
    with pytest.raises(ValueError, match="g must have shape"):
        tree_gated_delta_rule(q, k, v, g[:, :1], beta, layout)
    with pytest.raises(ValueError, match="k must match"):
        tree_gated_delta_rule(q, k[:, :1], v, g, beta, layout)


def test_fla_glue_with_stand_in_kernel(monkeypatch):
    """The per-level varlen packing of the "fla" backend, run with a CPU stand-in for FLA's kernel.

    The stand-in checks FLA's calling contract (batch 1, equal q/k/v heads, long cu_seqlens, one
    initial state per packed sequence) and runs the oracle per packed sequence.
    """
    import sys
    import types

    from megatron_tree.ops import gated_delta_rule as gdn

    calls = []

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        assert q.shape[0] == 1 and q.shape[2] == v.shape[2] and cu_seqlens.dtype == torch.long
        assert output_final_state and g.dtype == torch.float32
        assert initial_state.shape == (len(cu_seqlens) - 1, v.shape[2], q.shape[3], v.shape[3])
        calls.append(len(cu_seqlens) - 1)
        cu = cu_seqlens.tolist()
        o, S = [], []
        for i in range(len(cu) - 1):
            sl = slice(cu[i], cu[i + 1])
            o_i, S_i = oracle(q[0, sl], k[0, sl], v[0, sl], g[0, sl].to(q.dtype), beta[0, sl], scale,
                              initial_state[i].to(q.dtype))
            o.append(o_i)
            S.append(S_i)
        return torch.cat(o).unsqueeze(0), torch.stack(S)

    mod = types.ModuleType("fla.ops.gated_delta_rule")
    mod.chunk_gated_delta_rule = chunk_gated_delta_rule
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", mod)
    layout, samples = CASES[0]
    inputs = make_inputs(layout.num_rows, 1, 4, 2, 3, seed=21)
    o = gdn._tree_fla(*inputs, layout, 0.8)
    o_ref = gdn._tree_torch(*inputs, layout, 0.8)
    assert calls == [int((layout.segment_level[:layout.num_segments - layout.num_padding] == lv).sum())
                     for lv in range(layout.num_levels)]
    # float32 only where FLA's contract forces it (g, padding rows in closed form)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-6)
    G = torch.randn_like(o)
    grads = torch.autograd.grad((o * G).sum(), inputs)
    grads_ref = torch.autograd.grad((o_ref * G).sum(), inputs)
    for name, a, b in zip("q k v g beta".split(), grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=lambda m: f"d{name}: {m}")


@pytest.mark.skipif(not (torch.cuda.is_available() and module_available("fla.ops.gated_delta_rule")),
                    reason="needs CUDA and fla")
def test_fla_backend_matches_torch_backend():
    layout, samples = CASES[-1]
    layout = layout.to("cuda")
    N, H, K, HV, V = layout.num_rows, 2, 64, 4, 32
    base = make_inputs(N, H, K, HV, V, dtype=torch.float32, seed=9)
    x_fla = [x.detach().cuda() for x in base]
    x_fla = [x.to(torch.bfloat16) if i in (0, 1, 2, 4) else x for i, x in enumerate(x_fla)]
    x_fla = [x.requires_grad_() for x in x_fla]
    x_ref = [x.detach().to(torch.float32).requires_grad_() for x in x_fla]
    o_fla = tree_gated_delta_rule(*x_fla, layout, backend="fla")
    o_auto = tree_gated_delta_rule(*x_fla, layout)  # auto picks fla for CUDA bf16
    o_ref = tree_gated_delta_rule(*x_ref, layout, backend="torch")
    torch.testing.assert_close(o_auto, o_fla, rtol=0, atol=0)
    torch.testing.assert_close(o_fla.float(), o_ref, rtol=3e-2, atol=3e-2)
    G = torch.randn_like(o_ref)
    grads = torch.autograd.grad((o_fla.float() * G).sum(), x_fla)
    grads_ref = torch.autograd.grad((o_ref * G).sum(), x_ref)
    for name, a, b in zip("q k v g beta".split(), grads, grads_ref):
        err = (a.float() - b).norm() / b.norm().clamp_min(1e-6)
        assert err < 5e-2, f"d{name}: relative error {err:.3g}"
