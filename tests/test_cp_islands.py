"""GDN layout islands under tree context parallelism: exactness, boundaries, sensitivity.

Islands (`megatron_tree.megatron.model`): each maximal run of non-attention layers holding a GDN
layer runs on a second, GDN-friendly ownership; hidden states move (`cp.execution.redistribute`) only at the
island's entry and exit. Oracles: the single-rank permutation (redistribution), and CP1 of the same
tree model (itself equal to per-sample training, `megatron-tree verify`), float64: loss and every
parameter gradient after Megatron's DP x CP reduction (the CP1 reference turns the CP ranks into DP
ranks that each run every microbatch, as in tests/test_cp_megatron.py).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dist import init_megatron, run_distributed
from forests import branching_samples
from megatron_tree.cp import CPPlan
from megatron_tree.megatron.model import gdn_island_spans
from megatron_tree.tree import pack


def test_island_spans():
    assert gdn_island_spans("GG-G*GG") == [(0, 4), (5, 7)]
    assert gdn_island_spans("*-M*E") == []  # runs without a GDN layer stay on the attention ownership
    assert gdn_island_spans("MG*-*E") == [(0, 2)]
    assert gdn_island_spans("G") == [(0, 1)]
    assert gdn_island_spans("-*G") == [(2, 3)]


# ---------------------------------------------------------------- redistribution round trip


def _plans(n: int, cp: int, seed: int):
    rng = np.random.default_rng(seed)
    vis, pos = np.arange(1, n + 1, dtype=np.int64), np.zeros(n, np.int64)
    a = rng.integers(0, cp, n).astype(np.int32)
    b = np.sort(rng.integers(0, cp, n)).astype(np.int32)  # contiguous runs
    b[: n // 3] = cp - 1  # a rank that may own nothing elsewhere
    return CPPlan(cp, "random", a, vis, pos), CPPlan(cp, "runs", b, vis, pos)


def _redistribute_body(cases):
    import torch.distributed as dist

    from megatron_tree.cp.execution import redistribute as rd

    rank = dist.get_rank()
    out = []
    for n, seed, pad_a, pad_b, fault in cases:
        rd._FAULT = fault
        cp = dist.get_world_size()
        pa, pb = _plans(n, cp, seed)
        full = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        w = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
        ra, rb = torch.from_numpy(pa.owner_rows(rank)), torch.from_numpy(pb.owner_rows(rank))
        x = torch.cat([full[ra], torch.full((pad_a, 3), 7.0, dtype=torch.float64)]).requires_grad_()
        y = rd.redistribute_rows(x, pa, pb, None, src_padding=pad_a, dst_padding=pad_b)
        back = rd.redistribute_rows(y, pb, pa, None, src_padding=pad_b, dst_padding=pad_a)
        # loss = sum over rows of w[r] . y[r] (+ the round trip): dL/dx[r] = w[r] (+ w[r]) on the owner
        loss = (y[: len(rb)] * w[rb]).sum() + (back[: len(ra)] * w[ra]).sum()
        loss.backward()
        out.append(dict(
            y_ok=bool(torch.equal(y[: len(rb)], full[rb])) and bool((y[len(rb):] == 0).all()),
            back_ok=bool(torch.equal(back[: len(ra)], full[ra])) and bool((back[len(ra):] == 0).all()),
            grad_ok=bool(torch.equal(x.grad[: len(ra)], 2 * w[ra])) and bool((x.grad[len(ra):] == 0).all()),
            shape=(tuple(y.shape), len(rb) + pad_b)))
        rd._FAULT = None
    return out


RD_CASES = [(37, 0, 0, 0, None), (50, 1, 2, 1, None), (9, 2, 1, 3, None), (40, 3, 0, 0, "no_reorder")]


@pytest.mark.parametrize("world", [2, 4])
def test_redistribution_round_trip_and_gradient(world):
    res = [r["redistribute"] for r in _run(world)]
    cases = RD_CASES
    for i, case in enumerate(cases):
        ok = all(r[i]["y_ok"] and r[i]["back_ok"] and r[i]["grad_ok"] for r in res)
        assert all(r[i]["shape"][0][0] == r[i]["shape"][1] for r in res)
        if case[-1] is None:
            assert ok, (case, res)
        else:  # sensitivity: rows left in arrival order are caught
            assert not ok, case


# ---------------------------------------------------------------- tiny hybrid models vs CP1


def _train_body(cfgs):
    from megatron.core import parallel_state as ps

    from megatron_tree.cp import plan_context_parallel
    from megatron_tree.cp.execution import redistribute as rd
    from megatron_tree.megatron import model as tree_model
    from megatron_tree.megatron.forward_step import gdn_island_plan
    from megatron_tree.training.models import ModelArgs, build_model, forward_backward, make_config, report_totals
    from megatron_tree.training.models import wrap_ddp

    results = []
    for cfg in cfgs:
        out = {}
        for cp in (cfg["cp"], 1):
            tp, pp = cfg.get("tp", 1), cfg.get("pp", 1)
            init_megatron(tp=tp, pp=pp, cp=cp, seed=7, kernels=True)
            torch.set_default_dtype(torch.float64)
            margs = ModelArgs(kind="hybrid", pattern=cfg["pattern"], hidden_size=16, ffn_hidden_size=32)
            config = make_config(margs, tp=tp, pp=pp, cp=cp, sp=cfg.get("sp", False), dtype=torch.float64,
                                 recompute=cfg.get("recompute", "none"))
            model = build_model(config, margs)
            model.gdn_islands = cfg.get("islands", True)
            ddp = wrap_ddp(model, config)
            tree_model._FAULT = cfg.get("fault") if cp > 1 else None
            rd._FAULT = cfg.get("rd_fault") if cp > 1 else None
            mbs = pack(branching_samples(cfg.get("seed", 0)), 48, pad_to_multiple_of=4)
            items = mbs
            if cp > 1 and cfg.get("random_gdn"):  # an arbitrary (non-contiguous) island ownership, made ahead
                rng = np.random.default_rng(cfg.get("seed", 0))
                items = [(mb, (plan_context_parallel(mb.layout, cp, strategy=cfg.get("strategy", "zigzag")),
                               CPPlan(cp, "random", rng.integers(0, cp, mb.num_rows).astype(np.int32),
                                      mb.layout.visible_until.numpy(), mb.layout.position_ids.numpy())))
                         for mb in mbs]
            # microbatches whose island ownership differs from the attention one (others skip the moves)
            differ = len(items) if cp > 1 and cfg.get("random_gdn") else sum(
                cp > 1 and not np.array_equal(p.owner, gdn_island_plan(
                    mb.layout, cp, p, **model.gdn_island_geometry).owner)
                for mb in mbs for p in [plan_context_parallel(mb.layout, cp, strategy=cfg.get("strategy", "zigzag"))])
            rd.redistribution_count(reset=True)
            err = None
            try:
                # zigzag attention ownership by default: the small microbatches here would get a
                # contiguous balanced plan, which equals the island plan and moves nothing
                reports = forward_backward(ddp, items, loss_type="sft", cp_strategy=cfg.get("strategy", "zigzag"))
            except Exception as e:  # a planted fault may also stop the run (shape checks): it failed
                err, reports = f"{type(e).__name__}: {e}"[:300], []
            tree_model._FAULT = rd._FAULT = None
            tot = report_totals(reports)
            if tot is not None and err is None:
                torch.distributed.all_reduce(tot, group=ps.get_data_parallel_group(with_context_parallel=True))
            out[cp] = dict(loss=None if tot is None else tot.clone(), error=err, moving_microbatches=differ,
                           moves=rd.redistribution_count(), spans=list(model.gdn_island_spans),
                           grads={n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()})
            ps.destroy_model_parallel()
            torch.set_default_dtype(torch.float32)
            if err is not None and "fault" not in cfg and "rd_fault" not in cfg:
                raise RuntimeError(err)
        results.append(out)
    return results


CONFIGS = {
    2: [dict(cp=2, pattern="GG-G*GG"),  # 2 islands -> 4 moves per microbatch forward
        dict(cp=2, pattern="MG*E-G", seed=1, random_gdn=True),
        dict(cp=2, pattern="GM*-G", recompute="full", seed=2),
        dict(cp=2, pattern="GG-G*GG", islands=False),
  # switch off: no moves, still exact
        dict(cp=2, pattern="GG-G*GG", rd_fault="no_reorder"),
        dict(cp=2, pattern="G-G*G", fault="skip_exit"),
        dict(cp=2, pattern="G-G*G", fault="attention_rows")],
    4: [dict(cp=4, pattern="G-*GEM"),
        dict(cp=4, pattern="GM-*G", strategy="balanced", random_gdn=True, seed=3),
        dict(cp=2, tp=2, sp=True, pattern="GE*G-"),
        dict(cp=2, pp=2, pattern="G-GG*G")],  # "G-G|G*G": the run G-GG is cut at the stage boundary
}


def _max_grad_error(per_rank, i, cp) -> float:
    return max(float((r[i][cp]["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
               for r in per_rank for n, g in r[i][1]["grads"].items())


def _body(cfgs):
    return dict(redistribute=_redistribute_body(RD_CASES), train=_train_body(cfgs))


_RUNS: dict = {}


def _run(world: int) -> list:
    """One spawn per world size for both tests (rank start-up and the Megatron import dominate)."""
    if world not in _RUNS:
        _RUNS[world] = run_distributed(_body, world, CONFIGS[world], timeout=600)
    return _RUNS[world]


@pytest.mark.parametrize("world", sorted(CONFIGS))
def test_hybrid_islands_equal_cp1(world):
    per_rank = [r["train"] for r in _run(world)]
    for i, cfg in enumerate(CONFIGS[world]):
        cp = cfg["cp"]
        if "fault" in cfg or "rd_fault" in cfg:  # a broken island must show (error or wrong gradients)
            failed = any(r[i][cp]["error"] is not None for r in per_rank) or _max_grad_error(per_rank, i, cp) > 1e-4
            assert failed, cfg
            continue
        losses = [r[i][cp]["loss"] for r in per_rank if r[i][cp]["loss"] is not None]
        ref = [r[i][1]["loss"] for r in per_rank if r[i][1]["loss"] is not None]
        assert losses and ref
        assert float(losses[0][1]) * cp == float(ref[0][1])
        assert abs(float(losses[0][0] / losses[0][1] - ref[0][0] / ref[0][1])) < 1e-12, cfg
        for rank, r in enumerate(per_rank):
            g_cp, g_ref = r[i][cp]["grads"], r[i][1]["grads"]
            for name, g in g_ref.items():
                err = (g_cp[name] - g).abs().max() / g.abs().max().clamp_min(1e-30)
                assert err < 1e-9, f"{cfg} rank {rank} {name}: {err:.2e}"
        # moves happen only at island boundaries: 2 per island per microbatch forward (+ the same
        # again when full recomputation replays the forward); none at CP1, with islands off, or for a
        # microbatch whose island plan has the attention plan's ownership
        for r in per_rank:
            n_isl = len(r[i][cp]["spans"])
            assert r[i][cp]["moving_microbatches"] > 0, cfg  # the island ownership really differs somewhere
            per_fwd = 2 * n_isl * r[i][cp]["moving_microbatches"]
            want = 0 if not cfg.get("islands", True) else per_fwd * (2 if cfg.get("recompute") == "full" else 1)
            assert r[i][cp]["moves"] == want, (cfg, r[i][cp]["moves"], want)
            assert r[i][1]["moves"] == 0
    spans = {tuple(map(tuple, r[0][CONFIGS[world][0]["cp"]]["spans"])) for r in per_rank}
    if world == 2:
        assert spans == {((0, 4), (5, 7))}
    pp_spans = {tuple(map(tuple, r[3][2]["spans"])) for r in per_rank} if world == 4 else None
    if world == 4:  # each stage closes its own island: stage 0 "G-G" -> (0, 3), stage 1 "G*G" -> (0, 1), (2, 3)
        assert pp_spans == {((0, 3),), ((0, 1), (2, 3))}
