"""CP planner benchmark: balanced vs zigzag vs contiguous on the synthetic presets, weak scaling.

For every preset (megatron_tree.data.synthetic.PRESETS) and CP size, one microbatch of about
``--rows-per-rank`` x CP rows is built from CP x k copies of the preset (distinct seeds, so varied
presets vary from copy to copy; presets larger than a rank's share are shrunk with ``scale``),
packed as one prefix forest. Two chains are added: ``chain_100k``, one unbranched chain of 100,000
rows at every CP size (the issue's named case: strong scaling), and ``chain_weak``, one chain of
rows-per-rank x CP rows (655,360 at CP32: the causal triangle the zigzag fold is made for).

Reported per (preset, CP): rows; predicted imbalance (max / mean rank time) of balanced, zigzag and
contiguous; balanced's slowest rank against the best fold's; the model-neutral balance of the
balanced plan (visible pairs and rows per rank, max / mean); its slowest rank against the ideal
(one rank's predicted time / CP); remote K/V moved and the peak held at once; waves; planning ms
(median of ``--repeats``; the planner thread's CPU time, immune to other load on the machine, and
wall time). Then the issue's goals, counted.

    .venv/bin/python tools/bench_cp.py                       # GPU cost profile, CP 2..32
    .venv/bin/python tools/bench_cp.py --cost-model cpu --cp 2,4 --presets agent_multiturn
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_tree.cp import CostModel, plan_context_parallel  # noqa: E402
from megatron_tree.cp.planning.planner import _peak_rows, evaluate_ownership  # noqa: E402
from megatron_tree.data.synthetic import PRESETS, make_preset  # noqa: E402
from megatron_tree.tree import pack  # noqa: E402
from megatron_tree.tree.layout import TreeLayout  # noqa: E402
from megatron_tree.tree.packing import PrefixPlan  # noqa: E402

CHAINS = ("chain_100k", "chain_weak")
GOALS = dict(imbalance=1.05, neutral=1.15, vs_ideal=1.15, planning_ms=50.0)


def weak_layout(name: str, cp: int, rows_per_rank: int) -> tuple[TreeLayout, str]:
    """The weak-scaled microbatch of ``name`` at ``cp`` ranks and how it was built."""
    if name == "chain_100k":
        return TreeLayout.from_segments([100_000], [-1]), "one chain of 100,000 rows"
    if name == "chain_weak":
        return TreeLayout.from_segments([rows_per_rank * cp], [-1]), f"one chain of {rows_per_rank:,} x CP rows"
    one = int(PrefixPlan([s.tokens for s in make_preset(name, seed=0)]).tree_rows().sum())
    if one >= rows_per_rank:
        copies, scale = 1, rows_per_rank / one
    else:
        copies, scale = max(1, round(rows_per_rank / one)), 1.0
    samples = [x for seed in range(copies * cp) for x in make_preset(name, seed=seed, scale=scale)]
    mbs = pack(samples, 1 << 40)
    assert len(mbs) == 1
    return mbs[0].layout, f"{copies} cop{'y' if copies == 1 else 'ies'}/rank at scale {scale:.3f}"


def _cost_model(spec: str) -> CostModel:
    if spec == "gpu":
        return CostModel.gpu()
    if spec == "cpu":
        return CostModel.cpu()
    return CostModel.from_json(spec)


def bench(presets, cps, rows_per_rank: int, cm: CostModel, repeats: int) -> list[dict]:
    out = []
    for name in presets:
        for cp in cps:
            layout, how = weak_layout(name, cp, rows_per_rank)
            plans = {s: plan_context_parallel(layout, cp, strategy=s, cost_model=cm)
                     for s in ("balanced", "zigzag", "contiguous")}
            times = [plans["balanced"].stats["planning_ms"]]
            cpu = [plans["balanced"].stats["planning_cpu_ms"]]
            for _ in range(repeats - 1):
                again = plan_context_parallel(layout, cp, cost_model=cm)
                assert again.hash == plans["balanced"].hash  # deterministic
                times.append(again.stats["planning_ms"])
                cpu.append(again.stats["planning_cpu_ms"])
            single = float(plan_context_parallel(layout, 1, cost_model=cm).predicted_ms[0])
            b = plans["balanced"]
            s = b.stats
            best_fold = min(plans["zigzag"].predicted_ms.max(), plans["contiguous"].predicted_ms.max())
            out.append(dict(
                preset=name, cp=cp, rows=layout.num_rows, built=how,
                imb_balanced=b.imbalance, imb_zigzag=plans["zigzag"].imbalance,
                imb_contiguous=plans["contiguous"].imbalance,
                max_ms_balanced=float(b.predicted_ms.max()), max_ms_zigzag=float(plans["zigzag"].predicted_ms.max()),
                max_ms_contiguous=float(plans["contiguous"].predicted_ms.max()),
                vs_best_fold=float(b.predicted_ms.max()) / best_fold,
                pair_balance=s["pair_balance"], row_balance=s["row_balance"], neutral=s["neutral_balance"],
                vs_ideal=float(b.predicted_ms.max()) / (single / cp),
                remote_kv_mib=s["remote_kv_bytes"] / 2**20, peak_remote_kv_rows=s["peak_remote_kv_rows"],
                waves=b.num_waves, chunks=s["num_chunks"], planning_ms=float(np.median(times)),
                planning_cpu_ms=float(np.median(cpu)),
                fallback=s["fallback"]))
            r = out[-1]
            print(f"  {name} CP{cp}: {r['rows']:,} rows, imbalance {r['imb_balanced']:.3f} "
                  f"(zigzag {r['imb_zigzag']:.3f}, contiguous {r['imb_contiguous']:.3f}), "
                  f"plan {r['planning_ms']:.1f} ms", file=sys.stderr, flush=True)
    return out


def table(rows: list[dict], cm: CostModel, rows_per_rank: int) -> str:
    lines = [f"cost model: {cm.name}; weak scaling at ~{rows_per_rank:,} rows per rank; predicted ms per "
             "attention layer with its token-local work", "",
             "| preset | CP | rows | imb balanced | imb zigzag | imb contig | bal / best fold | pairs bal | rows bal "
             "| vs ideal | remote KV MiB | peak KV rows | waves | plan ms (cpu) | plan ms (wall) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['cp']} | {r['rows']:,} | {r['imb_balanced']:.3f} | {r['imb_zigzag']:.3f} | "
            f"{r['imb_contiguous']:.3f} | {r['vs_best_fold']:.3f} | {r['pair_balance']:.3f} | {r['row_balance']:.3f} | "
            f"{r['vs_ideal']:.3f} | {r['remote_kv_mib']:,.1f} | {r['peak_remote_kv_rows']:,} | {r['waves']} | "
            f"{r['planning_cpu_ms']:.1f} | {r['planning_ms']:.1f} |")
    n = len(rows)
    ok = lambda f: sum(1 for r in rows if f(r))
    lines += ["", "goals (met / cases):",
              f"- balanced imbalance <= {GOALS['imbalance']}: {ok(lambda r: r['imb_balanced'] <= GOALS['imbalance'])}/{n}"
              f" (worst {max(r['imb_balanced'] for r in rows):.3f})",
              f"- balanced never predicted slower than zigzag or contiguous: "
              f"{ok(lambda r: r['vs_best_fold'] <= 1 + 1e-9)}/{n}",
              f"- model-neutral balance (pairs and rows) <= {GOALS['neutral']}: "
              f"{ok(lambda r: r['neutral'] <= GOALS['neutral'])}/{n} (worst {max(r['neutral'] for r in rows):.3f})",
              f"- slowest rank <= {GOALS['vs_ideal']} x ideal: {ok(lambda r: r['vs_ideal'] <= GOALS['vs_ideal'])}/{n}"
              f" (worst {max(r['vs_ideal'] for r in rows):.3f})",
              f"- planning < {GOALS['planning_ms']:.0f} ms (planner thread CPU time): "
              f"{ok(lambda r: r['planning_cpu_ms'] < GOALS['planning_ms'])}/{n} (worst "
              f"{max(r['planning_cpu_ms'] for r in rows):.1f} ms, at {max(rows, key=lambda r: r['planning_cpu_ms'])['rows']:,} rows;"
              f" wall clock worst {max(r['planning_ms'] for r in rows):.1f} ms at load average "
              f"{os.getloadavg()[0] if hasattr(os, 'getloadavg') else float('nan'):.1f} on {os.cpu_count()} cores)"]
    return "\n".join(lines)


def memory_table(presets, cp: int, rows_per_rank: int, cm: CostModel) -> str:
    """Remote K/V rows held at once per rank vs the total fetched, by wave count, in the executor's
    recompute mode (``bwd_refetch``: backward fetches each wave again, so at most the current and the
    prefetched wave are held) and the predicted time each wave count costs."""
    import dataclasses

    rc = dataclasses.replace(cm, bwd_refetch=True)
    lines = ["", f"memory at CP{cp} (recompute mode: backward refetches each wave; without it every fetched row "
             "is held until backward, i.e. the total):", "",
             "| preset | total fetched (max rank) | " + " | ".join(f"peak held, {w} wave{'s' if w > 1 else ''}"
                                                          for w in (1, 2, 4, 8)) + " | max ms 1 / 8 waves |",
             "|---|---:|" + "---:|" * 5]
    for name in presets:
        layout, _ = weak_layout(name, cp, rows_per_rank)
        plan = plan_context_parallel(layout, cp, cost_model=rc)  # one ownership, waves varied below
        peaks, ms = [], []
        total = 0
        for w in (1, 2, 4, 8):
            times, loads = evaluate_ownership(layout, plan.owner, cp, cost_model=rc, chunk_size=plan.chunk_size,
                                              chunk_starts=plan.chunk_starts, num_waves=w)
            total = int(loads.wave_rows.sum(1).max())
            peaks.append(int(round(_peak_rows(loads, rc))))
            ms.append(float(times.total.max()))
        lines.append(f"| {name} | {total:,} | " + " | ".join(f"{x:,}" for x in peaks) + f" | {ms[0]:.2f} / {ms[-1]:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default=",".join(PRESETS + CHAINS), help="comma-separated presets (and chain_100k, chain_weak)")
    ap.add_argument("--cp", default="2,4,8,16,32")
    ap.add_argument("--rows-per-rank", type=int, default=20480)
    ap.add_argument("--cost-model", default="gpu", help="gpu, cpu or a calibrated JSON")
    ap.add_argument("--repeats", type=int, default=3, help="planning runs per case (median reported)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON")
    ap.add_argument("--memory-cp", type=int, default=8, help="CP size of the memory table (0: none)")
    args = ap.parse_args(argv)
    presets = [p for p in args.presets.split(",") if p]
    bad = [p for p in presets if p not in PRESETS + CHAINS]
    if bad:
        ap.error(f"unknown preset {bad[0]!r}; choose from {', '.join(PRESETS + CHAINS)}")
    cm = _cost_model(args.cost_model)
    t0 = time.perf_counter()
    rows = bench(presets, [int(x) for x in args.cp.split(",")], args.rows_per_rank, cm, args.repeats)
    print(table(rows, cm, args.rows_per_rank))
    if args.memory_cp:
        print(memory_table(presets, args.memory_cp, args.rows_per_rank, cm))
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
