"""Does the CP cost model predict the executed plans? Measured vs predicted attention time per rank.

For a few trees and every strategy, plans are made with a cost model (default: the shipped CPU
profile), executed with `megatron_tree.cp.tree_attention_cp` on local gloo ranks (forward and
backward, float32, the calibration's head shape), and each rank's measured attention time is
compared with the planner's prediction for it (attention forward + backward; token-local work is
not run here). Two clocks per rank: wall time (what a step waits for; compared with the full
prediction) and process CPU time (the rank's own work, all but immune to other load on the
machine; compared with the prediction with transfers costing nothing). Reported per plan:
measured and predicted max / mean over ranks, the per-rank errors, and whether the model orders
the strategies as the measurements do (the decisions are what the model is for).

    .venv/bin/python tools/validate_cp_model.py --cp 2,4

Ranks run one torch thread each; with more ranks than cores (CP4 on a 2-core machine) the ranks
share cores and measured times include that contention.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_tree.cp import CostModel, plan_context_parallel  # noqa: E402
from megatron_tree.cp.planning.planner import STRATEGIES, evaluate_plan  # noqa: E402
from megatron_tree.tree.layout import TreeLayout  # noqa: E402


def _cases():
    from megatron_tree.data.synthetic import make_preset
    from megatron_tree.tree import pack

    out = [("chain_6k", TreeLayout.from_segments([6144], [-1]))]
    for name, scale, copies in (("varied_5k_16x100", 0.12, 2), ("dominant_14745_16x921", 0.15, 1),
                                ("agent_multiturn", 0.6, 2)):
        samples = [x for seed in range(copies) for x in make_preset(name, seed=seed, scale=scale)]
        out.append((name, pack(samples, 1 << 30)[0].layout))
    return out


def _body(plans, heads, kv_heads, head_dim, reps):
    import torch.distributed as dist

    from megatron_tree.cp import tree_attention_cp

    rank = dist.get_rank()
    out = []
    for plan in plans:
        n = int(plan.owner_rows(rank).shape[0])
        g = torch.Generator().manual_seed(1234 + rank)
        q = torch.randn(n, heads, head_dim, generator=g).requires_grad_()
        k = torch.randn(n, kv_heads, head_dim, generator=g).requires_grad_()
        v = torch.randn(n, kv_heads, head_dim, generator=g).requires_grad_()
        wall, cpu = [], []
        for i in range(reps + 1):
            q.grad = k.grad = v.grad = None
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            o = tree_attention_cp(q, k, v, plan)
            o.sum().backward()
            t1, c1 = time.perf_counter(), time.process_time()
            if i:  # the first run warms up (schedules, allocations)
                wall.append((t1 - t0) * 1e3)
                cpu.append((c1 - c0) * 1e3)
        out.append((float(np.min(wall)), float(np.min(cpu))))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", default="2,4")
    ap.add_argument("--cost-model", default="cpu", help="cpu, gpu or a calibrated JSON")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    from megatron_tree.training.launch import run_distributed

    cm = {"cpu": CostModel.cpu, "gpu": CostModel.gpu}.get(args.cost_model, lambda: CostModel.from_json(args.cost_model))()
    shape = cm.meta.get("shape", {}) if cm.meta else {}
    heads, kv_heads, head_dim = shape.get("q_heads", 4), shape.get("kv_heads", 2), shape.get("head_dim", 32)
    print(f"cost model {cm.name}; heads {heads}/{kv_heads} x {head_dim}, float32, gloo, 1 thread per rank")
    import dataclasses

    compute_only = dataclasses.replace(cm, comm_latency_ms=0.0, comm_ms_per_byte=0.0)
    stats = {"wall": ([], [0, 0]), "cpu": ([], [0, 0])}  # clock -> (abs errors, [agree, pairs])
    t_start = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average {load:.1f} on {os.cpu_count()} cores")
    for cp in [int(x) for x in args.cp.split(",")]:
        print(f"\nCP{cp}" + (f" ({cp} ranks on {os.cpu_count()} cores: contended)" if cp > (os.cpu_count() or 1) else ""))
        print(f"  {'tree':22s} {'strategy':10s} {'rows':>6s}  {'wall max  pred':>15s}  {'cpu max  pred':>15s}  "
              f"rank errors % (wall | cpu)")
        for name, layout in _cases():
            plans = [plan_context_parallel(layout, cp, strategy=s, cost_model=cm) for s in STRATEGIES]
            meas = run_distributed(_body, cp, plans, heads, kv_heads, head_dim, args.reps, timeout=900.0)
            mx = {"wall": [], "cpu": []}
            px = {"wall": [], "cpu": []}
            for j, plan in enumerate(plans):
                line = []
                for c, model in (("wall", cm), ("cpu", compute_only)):
                    times, _ = evaluate_plan(layout, plan, cost_model=model)
                    pred = times.attn_fwd + times.attn_bwd
                    got = np.array([meas[r][j][0 if c == "wall" else 1] for r in range(cp)])
                    e = (pred - got) / got * 100
                    stats[c][0].extend(np.abs(e).tolist())
                    mx[c].append(got.max())
                    px[c].append(pred.max())
                    line.append((got.max(), pred.max(), e))
                (wm, wp, we), (cm_, cp_, ce) = line
                print(f"  {name:22s} {plan.strategy:10s} {layout.num_rows:>6,}  {wm:>7.0f} {wp:>7.0f}  {cm_:>7.0f} {cp_:>7.0f}  "
                      + " ".join(f"{x:+.0f}" for x in we) + " | " + " ".join(f"{x:+.0f}" for x in ce))
            for c in ("wall", "cpu"):  # strategy order: pairs of plans whose measured max differ by > 5%
                m, p = mx[c], px[c]
                for a in range(len(plans)):
                    for b in range(a + 1, len(plans)):
                        if abs(m[a] - m[b]) > 0.05 * max(m[a], m[b]):
                            stats[c][1][1] += 1
                            stats[c][1][0] += (m[a] < m[b]) == (p[a] < p[b])
    for c, (errs, (agree, total)) in stats.items():
        errs = np.array(errs)
        print(f"\n{c}: per-rank |error| median {np.median(errs):.0f}%, 90th percentile {np.percentile(errs, 90):.0f}%, "
              f"max {errs.max():.0f}%; strategy order as measured: {agree}/{total} pairs that differ by > 5%")
    print(f"({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
