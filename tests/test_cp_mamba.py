"""Context-parallel Mamba-2 (`megatron_tree.cp.tree_mamba_cp`, the token -> head transpose) against
the single-device tree conv + `ops.tree_ssd`, and sensitivity: planted executor bugs must make the
equivalence fail.

Plans are built directly as `CPPlan` objects (random row-level, chunked, contiguous, zigzag-like,
everything on one rank, an empty rank), independent of the planner. Head / group shapes cover
groups == cp, groups < cp (B/C replicated, gradients summed), groups > cp, and a head shard that
straddles a group boundary unevenly. The distributed checks run on gloo in float64, many cases per
spawned run (spawning costs seconds).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_tree.cp import CPPlan, mamba_exchange_figures, mamba_head_shards, tree_mamba_cp

try:
    from tests.dist import run_distributed
    from tests.forests import random_forest, test_plan
except ImportError:  # run from inside tests/
    from dist import run_distributed
    from forests import random_forest, test_plan


# ------------------------------------------------------------------------------ plans and data
def _plan(layout, kind: str, cp: int, seed: int = 0) -> CPPlan:
    return test_plan(layout, kind, cp, seed, chunk=3)


def _forest(seed: int):
    layout, _ = random_forest(seed, num_trees=3, max_len=8, max_depth=3, num_padding=2)
    return layout


def _case(seed, kind, *, H=4, P=3, G=2, S=4, W=4, D="head", conv_bias=True, chunk=64, fault=None, plan_seed=0):
    return dict(seed=seed, kind=kind, H=H, P=P, G=G, S=S, W=W, D=D, conv_bias=conv_bias, chunk=chunk, fault=fault,
                plan_seed=plan_seed)


def _tensors(c, n):
    """Whole-tree inputs and parameters of one case (float64, same on every rank)."""
    H, P, G, S, W = c["H"], c["P"], c["G"], c["S"], c["W"]
    g = torch.Generator().manual_seed(1000 + c["seed"])
    f64 = dict(generator=g, dtype=torch.float64)
    conv_dim = H * P + 2 * G * S
    t = dict(xBCdt=torch.randn(n, conv_dim + H, **f64),
             conv_weight=torch.randn(conv_dim, W, **f64) * 0.5,
             conv_bias=torch.randn(conv_dim, **f64) * 0.1 if c["conv_bias"] else None,
             dt_bias=torch.randn(H, **f64) * 0.5,
             A_log=torch.rand(H, **f64) + 0.2,
             D={"head": torch.randn(H, **f64), "hdim": torch.randn(H * P, **f64), None: None}[c["D"]],
             go=torch.randn(n, H, P, **f64))
    return t


def _reference(t, layout, c):
    """Single device, all heads, written out from the op contracts (not the executor)."""
    from megatron_tree.ops import tree_causal_conv1d, tree_ssd

    H, P, G, S = c["H"], c["P"], c["G"], c["S"]
    n = layout.num_rows
    xBC, dt = t["xBCdt"].split([H * P + 2 * G * S, H], dim=1)
    xBC = tree_causal_conv1d(xBC, t["conv_weight"], t["conv_bias"], layout, activation="silu")
    x, B, C = xBC.split([H * P, G * S, G * S], dim=1)
    x, B, C = x.reshape(n, H, P), B.reshape(n, G, S), C.reshape(n, G, S)
    dt = F.softplus(dt + t["dt_bias"])
    A = -torch.exp(t["A_log"])
    D = t["D"]
    if D is not None and D.shape[0] == H * P:
        return tree_ssd(x, dt, A, B, C, layout, backend="torch", chunk_size=c["chunk"]) + x * D.reshape(H, P)
    return tree_ssd(x, dt, A, B, C, layout, D=D, backend="torch", chunk_size=c["chunk"])


_PARAMS = ("conv_weight", "conv_bias", "dt_bias", "A_log", "D")


def _run_cases(cases):
    """On every rank: each case through tree_mamba_cp vs the single-device reference on this rank's
    rows; parameter gradients summed over the ranks (all_reduce) vs the reference's. Also counts the
    elements each exchange sends to other ranks (vs `mamba_exchange_figures`)."""
    import torch.distributed as dist

    import megatron_tree.cp.execution.mamba as cpm

    rank, cp = dist.get_rank(), dist.get_world_size()
    out = []
    for c in cases:
        layout = _forest(c["seed"])
        n = layout.num_rows
        plan = _plan(layout, c["kind"], cp, c["plan_seed"])
        t = _tensors(c, n)
        ref = {k: (None if v is None else v.clone().requires_grad_(k != "go")) for k, v in t.items()}
        y_ref = _reference(ref, layout, c)
        (y_ref * t["go"]).sum().backward()

        rows = torch.as_tensor(plan.owner_rows(rank))
        loc = {k: (None if v is None else v.clone().requires_grad_(True)) for k, v in t.items() if k != "go"}
        loc["xBCdt"] = t["xBCdt"][rows].clone().requires_grad_(True)
        sent = []
        real = cpm.start_exchange

        def counting(send, send_splits, recv_splits, group=None, **kw):
            sent.append(sum(int(s) for d, s in enumerate(send_splits) if d != rank))
            return real(send, send_splits, recv_splits, group, **kw)

        cpm._FAULT, cpm.start_exchange = c["fault"], counting
        try:
            def run():
                return tree_mamba_cp(loc["xBCdt"], loc["conv_weight"], loc["conv_bias"], loc["dt_bias"],
                                     -torch.exp(loc["A_log"]), loc["D"], layout, plan, None, head_dim=c["P"],
                                     num_groups=c["G"], d_state=c["S"], backend="torch", chunk_size=c["chunk"])
            y = run()
            (y * t["go"][rows]).sum().backward()
            with torch.no_grad():  # inference: same collectives, no graph
                y_ng = run()
        finally:
            cpm._FAULT, cpm.start_exchange = None, real

        def err(a, b):
            return float((a.detach() - b.detach()).abs().max()) if a.numel() else 0.0

        r = dict(y=err(y, y_ref[rows]), y_nograd=err(y_ng, y_ref[rows]), dxBCdt=err(loc["xBCdt"].grad,
                 ref["xBCdt"].grad[rows]), n_local=int(rows.numel()), sent=sent)
        for k in _PARAMS:
            if loc[k] is None:
                continue
            gsum = torch.zeros_like(loc[k]) if loc[k].grad is None else loc[k].grad.clone()
            dist.all_reduce(gsum)  # each rank's gradient covers its own heads' slice
            r["d" + k] = err(gsum, ref[k].grad)
        out.append(r)

    # clear errors, raised identically on every rank before any collective
    errors = {}
    layout = _forest(1)
    plan = _plan(layout, "random", cp)
    rows = plan.owner_rows(rank)
    for name, H in (("heads", 3 * cp - 1), ("rows", 2 * cp)):
        t = _tensors(_case(1, "random", H=H, G=1), layout.num_rows)
        x = t["xBCdt"][rows] if name == "heads" else t["xBCdt"][rows[1:] if rows.size else [0]]
        try:
            tree_mamba_cp(x, t["conv_weight"], t["conv_bias"], t["dt_bias"], -torch.exp(t["A_log"]), t["D"],
                          layout, plan, head_dim=3, num_groups=1, d_state=4)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    return dict(cases=out, errors=errors)


_TOL = 1e-10
_METRICS = ("y", "y_nograd", "dxBCdt") + tuple("d" + k for k in _PARAMS)


def _check_exact(results, cases, cp):
    for i, c in enumerate(cases):
        per_rank = [r["cases"][i] for r in results]
        for m in _METRICS:
            if m not in per_rank[0]:
                continue
            worst = max(p[m] for p in per_rank)
            assert worst < _TOL, f"case {c}: {m} differs by {worst}"
        # the exchanges moved what the analytic figures say (forward + backward, to other ranks)
        layout = _forest(c["seed"])
        figs = mamba_exchange_figures(_plan(layout, c["kind"], cp, c["plan_seed"]), c["H"], c["P"], c["G"], c["S"])
        for r, p in enumerate(per_rank):
            if figs["forward_total"] == 0:  # single owner: no collective at all
                assert p["sent"] == [], (c, p["sent"])
                continue
            # per case: the two forward moves, their two backward moves, the no-grad forward's two
            sent = p["sent"]
            assert len(sent) == 6, (c, sent)
            assert sent[0] + sent[1] == sent[4] + sent[5] == figs["forward_sent"][r], (c, r, sent, figs)
            assert sent[2] + sent[3] == figs["backward_sent"][r], (c, r, sent, figs)
    for r in results:
        e = r["errors"]
        assert e["heads"] is not None and f"CP size {cp}" in e["heads"] and f"heads on this tensor-parallel rank, " \
            f"{3 * cp - 1}" in e["heads"], e["heads"]
        assert e["rows"] is not None and "owner_rows" in e["rows"], e["rows"]


_FAULT_CASES = [
    # each fault with the metric it must break (G=1 < cp: the group is replicated)
    (_case(21, "random", H=4, G=1), "no_bc_grad_sum", "dxBCdt"),
    (_case(22, "random"), "y_wrong_rows", "y"),
    (_case(23, "chunks", G=4), "param_slice", "y"),
]


def test_cp_mamba_2_ranks_and_sensitivity():
    cases = [
        _case(1, "random"),                                        # groups == cp
        _case(2, "chunks", H=4, G=1, D="hdim", conv_bias=False),  # groups < cp: B/C replicated
        _case(3, "contiguous", H=8, G=4, P=2, S=3, W=3, chunk=4),  # groups > cp, several SSD chunks
        _case(4, "zigzag", H=6, G=3, D=None),                      # a shard straddles a group boundary
        _case(5, "all_on_1"),                                      # single owner: nothing moves
        _case(6, "random", H=2, G=1, W=1, plan_seed=3),            # one head per rank, no conv halo
        _case(7, "random", H=4, G=2, W=2, chunk=2, plan_seed=5),
    ]
    faults = [dict(c, fault=f) for c, f, _ in _FAULT_CASES]
    results = run_distributed(_run_cases, 2, cases + faults, timeout=180)
    _check_exact(results, cases, 2)
    assert results[0]["cases"][4]["n_local"] == 0
    for j, (c, fault, metric) in enumerate(_FAULT_CASES):
        worst = max(r["cases"][len(cases) + j][metric] for r in results)
        assert worst > 1e-3, f"fault {fault!r} went unnoticed: max {metric} error {worst}"


def test_cp_mamba_4_ranks():
    cases = [
        _case(8, "random", H=8, G=2),                      # groups < cp: each group on 2 ranks
        _case(9, "empty_last", H=4, G=1, D="hdim"),        # rank 3 owns nothing, still runs head 3
        _case(10, "zigzag", H=8, G=8, chunk=3),            # groups > cp
        _case(11, "chunks", H=12, G=3, P=2, S=3),          # uneven straddle: ranks read 1 or 2 groups
        _case(12, "all_on_2", H=4, G=4, conv_bias=False),  # single owner
    ]
    results = run_distributed(_run_cases, 4, cases, timeout=180)
    _check_exact(results, cases, 4)
    assert results[3]["cases"][1]["n_local"] == 0


# ------------------------------------------------------------------------------ host-side (no dist)
def test_head_shards():
    sh = mamba_head_shards(8, 2, 2, 3, 4)  # H=8, P=2, G=2, S=3: heads 2/rank, each group on 2 ranks
    assert sh.heads == ((0, 2), (2, 4), (4, 6), (6, 8)) and sh.groups == ((0, 1), (0, 1), (1, 2), (1, 2))
    assert not any(sh.expand)
    # rank 2: x of heads 4,5 (channels 8..11), B of group 1 (16+3..16+5), C of group 1, dt of heads 4,5
    np.testing.assert_array_equal(sh.channels[2], [8, 9, 10, 11, 19, 20, 21, 25, 26, 27, 32, 33])
    assert sh.conv_width[2] == 10 and sh.row_width == 8 * 2 + 2 * 2 * 3 + 8
    odd = mamba_head_shards(12, 1, 3, 1, 4)  # 3 heads per rank, 4 heads per group
    assert odd.groups == ((0, 1), (0, 2), (1, 3), (2, 3)) and odd.expand == (False, True, True, False)
    np.testing.assert_array_equal(odd.head_group[1], [0, 1, 1])
    with pytest.raises(ValueError, match="CP size 4 must divide the number of Mamba heads .* 6"):
        mamba_head_shards(6, 2, 2, 3, 4)
    with pytest.raises(ValueError, match="multiple of the number of B/C groups"):
        mamba_head_shards(6, 2, 4, 3, 2)


def test_cp1_without_process_group_and_exchange_figures():
    c = _case(4, "all_on_0", H=4, G=2, D="hdim")
    layout = _forest(4)
    t = _tensors(c, layout.num_rows)
    plan = _plan(layout, "all_on_0", 1)
    y = tree_mamba_cp(t["xBCdt"], t["conv_weight"], t["conv_bias"], t["dt_bias"], -torch.exp(t["A_log"]), t["D"],
                      layout, plan, head_dim=3, num_groups=2, d_state=4, backend="torch")
    torch.testing.assert_close(y, _reference(t, layout, c), rtol=0, atol=1e-12)
    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        tree_mamba_cp(t["xBCdt"], t["conv_weight"], t["conv_bias"], t["dt_bias"], -torch.exp(t["A_log"]), t["D"],
                      layout, _plan(layout, "random", 2), head_dim=3, num_groups=2, d_state=4)
    # figures: H=8, P=4, G=2, S=16 over 2 ranks, 10 rows on rank 0 and 6 on rank 1
    lay = _forest(0)
    owner = np.zeros(lay.num_rows, np.int32)
    owner[:6] = 1
    plan = CPPlan(2, "test", owner, lay.visible_until.numpy(), lay.position_ids.numpy())
    N = lay.num_rows
    f = mamba_exchange_figures(plan, 8, 4, 2, 16)
    width = 4 * 4 + 2 * 16 + 4  # F_j: x of 4 heads, B and C of 1 group, dt of 4 heads
    n0, n1 = N - 6, 6
    assert list(f["forward_sent"]) == [n0 * width + n1 * 16, n1 * width + n0 * 16]
    assert list(f["backward_sent"]) == [n1 * width + n0 * 16, n0 * width + n1 * 16]
    assert mamba_exchange_figures(_plan(lay, "all_on_1", 2), 8, 4, 2, 16)["forward_total"] == 0


# ------------------------------------------------------------------------------ TreeMambaMixer under CP
_HIDDEN = 8


def _mixer_config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=_HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
                params_dtype=torch.float64, normalization="RMSNorm", activation_func=F.silu, hidden_dropout=0.0,
                attention_dropout=0.0, context_parallel_size=2, mamba_state_dim=5, mamba_head_dim=3,
                mamba_num_groups=2, mamba_num_heads=4)
    base.update(kw)
    return TransformerConfig(**base)


def _module_body(variants):
    """Rank body (CP 2): TreeMambaMixer on a random non-contiguous plan against the same module on a
    single-owner plan (rank 0 holds every row: no exchange, all heads local; rank 1 holds one
    padding row), outputs and input / parameter gradients over the whole tree; plus the
    constructor's clear errors."""
    import torch.distributed as dist
    from megatron.core.transformer.spec_utils import build_module

    try:
        from tests.dist import init_megatron
    except ImportError:
        from dist import init_megatron
    init_megatron(cp=2, kernels=True)
    from megatron_tree.megatron.mamba import tree_mamba_module_spec
    from megatron_tree.megatron.packed_seq import TreePackedSeqParams, context_parallel_view

    rank = dist.get_rank()
    errors = {}
    for name, kw in (("heads", dict(mamba_num_heads=3, mamba_num_groups=1)),
                     ("groups", dict(mamba_num_heads=6, mamba_num_groups=3))):
        try:
            build_module(tree_mamba_module_spec(), config=_mixer_config(**kw), layer_number=1)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)

    out = []
    for v in variants:
        params = dict(v["params"])
        module = build_module(tree_mamba_module_spec(backend="torch", **params),
                              config=_mixer_config(**v["config"]), layer_number=1).to(torch.float64)
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for pname, p in sorted(module.named_parameters()):
                r = torch.randn(p.shape, generator=gen, dtype=torch.float64)
                p.copy_(r * 0.5 if "norm" not in pname else 1.0 + 0.3 * r)
        layout = _forest(v["seed"])
        N = layout.num_rows
        hidden = torch.randn(N, _HIDDEN, generator=gen, dtype=torch.float64)
        go = torch.randn(N, _HIDDEN, generator=gen, dtype=torch.float64)
        res = {}
        for kind in ("all_on_0", "random"):
            plan = _plan(layout, kind, 2, v["seed"])
            psp = context_parallel_view(TreePackedSeqParams(layout=layout), plan, rank)
            rows, n = psp.local_rows, int(psp.local_rows.shape[0])
            h = torch.cat([hidden[rows], hidden.new_zeros(psp.num_local_padding, _HIDDEN)]).unsqueeze(1)
            h.requires_grad_(True)
            y, _ = module(h, None, packed_seq_params=psp)
            (y[:n, 0] * go[rows]).sum().backward()
            full_y, full_dh = torch.zeros(N, _HIDDEN, dtype=torch.float64), torch.zeros(N, _HIDDEN, dtype=torch.float64)
            full_y[rows], full_dh[rows] = y[:n, 0].detach(), h.grad[:n, 0]
            grads = {pn: p.grad.clone() for pn, p in module.named_parameters()}
            for t in [full_y, full_dh, *grads.values()]:
                dist.all_reduce(t)
            module.zero_grad()
            res[kind] = (full_y, full_dh, grads)
        (y0, dh0, g0), (y1, dh1, g1) = res["all_on_0"], res["random"]
        out.append(dict(y=float((y0 - y1).abs().max()), dh=float((dh0 - dh1).abs().max()),
                        grads=max(float((g0[k] - g1[k]).abs().max()) for k in g0),
                        scale=float(y0.abs().max()), empty=int(_plan(layout, "all_on_0", 2).rows_per_rank()[1])))
    return dict(errors=errors, variants=out)


def test_tree_mamba_mixer_under_cp2():
    variants = [
        dict(seed=31, config={}, params={}),                                          # groups == cp
        dict(seed=32, config=dict(mamba_num_groups=1), params=dict(D_has_hdim=True, rmsnorm=False)),  # G < cp
    ]
    results = run_distributed(_module_body, 2, variants, timeout=240)
    for r in results:
        e = r["errors"]
        assert e["heads"] is not None and "CP size 2" in e["heads"] and "3 Mamba heads" in e["heads"], e["heads"]
        assert e["groups"] is not None and "3 Mamba B/C groups" in e["groups"] and "CP size 2" in e["groups"], \
            e["groups"]
        for v in r["variants"]:
            assert v["scale"] > 1e-2 and v["empty"] == 0
            for m in ("y", "dh", "grads"):
                assert v[m] < 1e-10, (m, v)
