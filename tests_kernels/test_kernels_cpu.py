"""The GPU backends' exact kernel calls, on CPU through Triton's interpreter (kernel tier).

``tree_gated_delta_rule(backend="fla")`` (FLA's varlen ``chunk_gated_delta_rule``, one initial and
final state per segment, level by level), ``tree_ssd(backend="mamba")`` (mamba-ssm's
``mamba_chunk_scan_combined``, segments as batch rows with their initial states) and the
FlexAttention partial (eager, with LSE) against the torch reference backends, float32, forward and
backward, on branching forests of 100-500 rows (forks at several depths, single-row segments,
padding). The reference runs in float64 on the same (float32-rounded) inputs; the torch backend
in float32 is measured against it too, as the yardstick of float32 rounding.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from forests import random_forest
from megatron_tree.ops import tree_attention_partial, tree_gated_delta_rule, tree_ssd
from megatron_tree.ops.backend import allow_cpu_kernels, cpu_kernels_allowed

def _forest(seed: int, lo: int = 100, hi: int = 500):
    """A forest of lo..hi rows with at least 3 levels (searched from ``seed``, deterministic)."""
    for s in range(seed, seed + 500):
        layout, samples = random_forest(s, num_trees=3, max_len=30, max_depth=3, num_padding=3)
        depth = int(layout.segment_parent.numel() and _depth(layout))
        if lo <= layout.num_rows <= hi and depth >= 3 and layout.num_padding:
            return layout
    raise AssertionError("no forest in range")


def _depth(layout) -> int:
    parent = layout.segment_parent.tolist()
    best = 0
    for s in range(len(parent)):
        d, p = 1, parent[s]
        while p >= 0:
            d, p = d + 1, parent[p]
        best = max(best, d)
    return best


def _compare(record, backend, case, names, got, ref64, ref32):
    """Max abs error (relative to the reference's max magnitude) of the kernel and of torch fp32."""
    out = {}
    for name, a, r, t in zip(names, got, ref64, ref32):
        scale = max(float(r.abs().max()), 1e-6)
        e_kernel = float((a.double() - r).abs().max()) / scale
        e_torch = float((t.double() - r).abs().max()) / scale
        record(backend, case, name, e_kernel, e_torch)
        out[name] = (e_kernel, e_torch)
    return out


def _run(fn, inputs, cot):
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    y = fn(*xs)
    ys = y if isinstance(y, tuple) else (y,)
    loss = sum((a * c).sum() for a, c in zip(ys, cot) if c is not None)
    grads = torch.autograd.grad(loss, [x for x in xs if x.requires_grad])
    return [a.detach() for a in ys], list(grads)


def _spy(monkeypatch, module: str, name: str) -> list:
    """Count calls of ``module.name`` (the kernel entry point a backend imports on use), so a
    backend that silently ran something else fails the test."""
    import importlib

    mod = importlib.import_module(module)
    real, calls = getattr(mod, name), []

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, name, spy)
    return calls


def _check(errs, tol):
    bad = {k: v for k, v in errs.items() if not v[0] <= max(tol, 20 * v[1])}
    assert not bad, f"kernel vs float64 reference beyond tolerance {tol}: {bad}"


def test_switch_is_on_only_in_this_tier_and_auto_stays_torch():
    assert cpu_kernels_allowed()  # conftest turned it on
    layout = _forest(0)
    N = layout.num_rows
    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(N, 2, 16, generator=gen), dim=-1)
    args = (q, q, torch.randn(N, 2, 16, generator=gen), -torch.rand(N, 2, generator=gen),
            torch.rand(N, 2, generator=gen), layout)
    # "auto" never runs a GPU kernel on CPU tensors, switch or not: it is the torch backend, bit for bit
    assert torch.equal(tree_gated_delta_rule(*args), tree_gated_delta_rule(*args, backend="torch"))
    previous = allow_cpu_kernels(False)
    try:
        with pytest.raises(RuntimeError, match="CUDA tensors only"):
            tree_gated_delta_rule(*args, backend="fla")
    finally:
        allow_cpu_kernels(previous)


# --------------------------------------------------------------------------------------------- Gated DeltaNet
@pytest.mark.parametrize("seed,H,HV", [(1, 2, 4), (7, 2, 2)])
def test_fla_gated_delta_rule_matches_torch(seed, H, HV, kernel_report, monkeypatch):
    layout = _forest(seed)
    N, K, V = layout.num_rows, 16, 16
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(N, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(N, H, K, generator=gen), dim=-1)
    v = torch.randn(N, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(N, HV, generator=gen) + 2.0)  # log decay <= 0
    beta = torch.rand(N, HV, generator=gen)
    cot = [torch.randn(N, HV, V, generator=gen)]
    inputs = [q, k, v, g, beta]
    calls = _spy(monkeypatch, "fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
    t0 = time.perf_counter()
    got, got_g = _run(lambda *x: tree_gated_delta_rule(*x, layout, backend="fla"), inputs, cot)
    seconds = time.perf_counter() - t0
    assert len(calls) >= 3  # one varlen call per level of the forest
    ref, ref_g = _run(lambda *x: tree_gated_delta_rule(*x, layout, backend="torch"), [x.double() for x in inputs],
                      [c.double() for c in cot])
    t32, t32_g = _run(lambda *x: tree_gated_delta_rule(*x, layout, backend="torch"), inputs, cot)
    names = ["o", "dq", "dk", "dv", "dg", "dbeta"]
    errs = _compare(kernel_report, "fla", f"{N} rows H={H} HV={HV} ({seconds:.0f} s)", names, got + got_g, ref + ref_g,
                    t32 + t32_g)
    _check(errs, 5e-5)


def test_fla_gated_delta_rule_forest_matches_torch(kernel_report, monkeypatch):
    """``gated_delta_rule_forest(backend="fla")`` (what carry's GDN layers run: the own rows as a forest
    whose roots under a carried row start from a stored state, the state rows' final states exported):
    roots from given initial states (two share one) or zero, final states of chosen segments, against
    the float64 torch forest; gradients reach the initial states."""
    import numpy as np

    from megatron_tree.ops.gated_delta_rule import gated_delta_rule_forest

    layout = _forest(5, hi=200)  # (the interpreter's minutes grow with the rows)
    real = layout.num_segments - layout.num_padding  # padding rows: one-row roots, left out here
    start = layout.segment_offsets[:real].numpy()
    length = (layout.segment_offsets[1:real + 1] - layout.segment_offsets[:real]).numpy()
    parent = layout.segment_parent[:real].numpy()
    roots = np.flatnonzero(parent < 0)
    index = np.full(real, -1, np.int64)
    index[roots[: min(3, len(roots))]] = [0, 1, 0][: min(3, len(roots))]  # two roots share state 0
    final = np.unique(np.r_[0, np.flatnonzero(parent >= 0)[:3], real - 1])
    N, H, HV, K, V = int(start[-1] + length[-1]), 2, 4, 16, 16
    gen = torch.Generator().manual_seed(5)
    q = F.normalize(torch.randn(N, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(N, H, K, generator=gen), dim=-1)
    v = torch.randn(N, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(N, HV, generator=gen) + 2.0)
    beta = torch.rand(N, HV, generator=gen)
    h0 = 0.1 * torch.randn(2, HV, K, V, generator=gen)
    cot = [torch.randn(N, HV, V, generator=gen), torch.randn(len(final), HV, K, V, generator=gen)]
    inputs = [q, k, v, g, beta, h0]

    def forest(backend):
        return lambda q, k, v, g, beta, h0: gated_delta_rule_forest(
            q, k, v, g, beta, start, length, parent, initial_state=h0, initial_index=index, final_segments=final,
            backend=backend)

    calls = _spy(monkeypatch, "fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
    t0 = time.perf_counter()
    got, got_g = _run(forest("fla"), inputs, cot)
    seconds = time.perf_counter() - t0
    assert len(calls) >= 3  # one varlen call per level
    ref, ref_g = _run(forest("torch"), [x.double() for x in inputs], [c.double() for c in cot])
    t32, t32_g = _run(forest("torch"), inputs, cot)
    names = ["o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    errs = _compare(kernel_report, "fla", f"forest {N} rows, initial + final states ({seconds:.0f} s)", names,
                    got + got_g, ref + ref_g, t32 + t32_g)
    _check(errs, 5e-5)


# --------------------------------------------------------------------------------------------- Mamba-2 SSD
@pytest.mark.parametrize("seed,H,G", [(3, 4, 2), (11, 2, 1)])
def test_mamba_ssd_matches_torch(seed, H, G, kernel_report, monkeypatch):
    layout = _forest(seed)
    N, P, S = layout.num_rows, 8, 16
    gen = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(N, H, P, generator=gen)
    dt = F.softplus(torch.randn(N, H, generator=gen) - 1.0)
    A = -torch.rand(H, generator=gen) - 0.5
    B = torch.randn(N, G, S, generator=gen)
    C = torch.randn(N, G, S, generator=gen)
    D = torch.randn(H, generator=gen)
    cot = [torch.randn(N, H, P, generator=gen)]
    inputs = [x, dt, A, B, C, D]
    calls = _spy(monkeypatch, "mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
    t0 = time.perf_counter()
    got, got_g = _run(lambda x, dt, A, B, C, D: tree_ssd(x, dt, A, B, C, layout, D=D, backend="mamba"), inputs, cot)
    seconds = time.perf_counter() - t0
    assert len(calls) >= 3  # at least one batch of segments per level
    torch_ssd = lambda x, dt, A, B, C, D: tree_ssd(x, dt, A, B, C, layout, D=D, backend="torch")  # noqa: E731
    ref, ref_g = _run(torch_ssd, [t.double() for t in inputs], [c.double() for c in cot])
    t32, t32_g = _run(torch_ssd, inputs, cot)
    names = ["y", "dx", "ddt", "dA", "dB", "dC", "dD"]
    errs = _compare(kernel_report, "mamba", f"{N} rows H={H} G={G} ({seconds:.0f} s)", names, got + got_g, ref + ref_g,
                    t32 + t32_g)
    _check(errs, 5e-5)


# --------------------------------------------------------------------------------------------- FlexAttention
@pytest.mark.parametrize("window", [None, 17])
def test_flex_attention_partial_matches_torch(window, flex_cpu_backward, kernel_report, monkeypatch):
    """One CP-like stage: a subset of query rows against a disjoint subset of key rows, then the full
    forest; o and lse forward, gradients through both."""
    layout = _forest(5)
    N, Hq, Hkv, D = layout.num_rows, 4, 2, 16
    gen = torch.Generator().manual_seed(23)
    q = torch.randn(N, Hq, D, generator=gen)
    k = torch.randn(N, Hkv, D, generator=gen)
    v = torch.randn(N, Hkv, D, generator=gen)
    calls = _spy(monkeypatch, "torch.nn.attention.flex_attention", "flex_attention")
    perm = torch.randperm(N, generator=gen)
    cases = {"stage": (perm[: N // 2].sort().values, perm[N // 2:].sort().values), "full": (torch.arange(N),) * 2}
    for case, (qr, kr) in cases.items():
        pos = layout.position_ids

        def partial(q, k, v, backend, qr=qr, kr=kr):
            return tree_attention_partial(q[qr], k[kr], v[kr], qr, kr, layout.visible_until[kr],
                                          q_positions=pos[qr] if window else None,
                                          k_positions=pos[kr] if window else None, window=window, backend=backend)

        n = qr.numel()
        cot = [torch.randn(n, Hq, D, generator=gen), torch.randn(n, Hq, generator=gen)]
        got, got_g = _run(lambda *x: _finite_lse(partial(*x, "flex")), [q, k, v], cot)
        ref, ref_g = _run(lambda *x: _finite_lse(partial(*x, "torch")), [t.double() for t in (q, k, v)],
                          [c.double() for c in cot])
        t32, t32_g = _run(lambda *x: _finite_lse(partial(*x, "torch")), [q, k, v], cot)
        assert calls, "the flex backend did not call FlexAttention"
        errs = _compare(kernel_report, "flex (eager)", f"{case} {n}x{kr.numel()} rows window={window}", ["o", "lse", "dq", "dk", "dv"],
                        got + got_g, ref + ref_g, t32 + t32_g)
        _check(errs, 5e-5)


def _finite_lse(out):
    """(o, lse) with -inf (no visible key in this stage) as 0, so sums and errors stay finite."""
    o, lse = out
    return o, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
