"""Tree Gated DeltaNet under context parallelism: measured CPU time of both modes, and bytes per layer.

1. **Measured** (``--measure``): one microbatch from ``--measure-preset`` (default
   ``varied_5k_16x100`` at ``--measure-scale 0.1``, about 2.5k rows), planned by the balanced
   planner, one GDN layer call (conv + recurrence, forward + backward, float32, tiny heads) on
   gloo CPU ranks in "summary" and "heads" mode at each ``--measure-cp``, against the same call on
   one rank (CP1). Reported: median over repeats of the slowest rank's wall time and of its CPU
   time (``time.process_time``: what the rank computed, without waiting for peers; on a shared
   2-core host CP4 wall time mostly measures oversubscription).
2. **Analytic** (default): for every preset (one copy, packed as one forest) and CP in ``--cp``,
   bytes one GDN layer moves per forward (both modes, from the plan: conv halos, boundary states,
   summary matrices; the head all-to-alls) next to what one attention layer moves (remote K/V rows
   of the same plan). Shapes: ``--gdn-heads H,HV,K,V,W`` and ``--attn-kv Hkv,D`` for one TP rank;
   activations in bf16, states in fp32. Plus the predicted time of each mode
   (`megatron_tree.cp.planning.gdn_plan.GDNCostModel`, default coefficients) and the mode "auto" picks.

   With ``--md`` also as markdown with the GDN layout island's figures (`gdn_layout.plan_gdn_layout`,
   priced for summary mode with the default coefficients): its summary bytes, entries and rounds, the
   island-boundary redistribution (rows whose owner differs, 2048-wide bf16 rows, in and out), and
   the Mamba-2 all-to-all of a Nemotron-Nano-like layer (``capacity.MAMBA_DEFAULT``).
3. **Calibration** (``--calibrate``): fits `GDNCostModel` on this CPU (CP1 layer calls of a few sizes
   for ``sec_per_flop`` / ``sec_per_call``, 2-rank gloo all-to-alls for ``sec_per_byte`` /
   ``sec_per_collective``) and writes ``megatron_tree/cp/planning/gdn_cost_cpu.json``.
4. **Chained vs local** (``--measure-layout``): summary mode under the balanced attention plan vs
   under `plan_gdn_layout`, predicted (CPU fit) and measured (slowest rank's CPU time) at
   ``--measure-cp`` on scaled-down presets (``--layout-presets preset:scale,...``).
5. **Weak scaling** (``--weak``): predicted GDN time at CP n over CP1 with ~``--weak-rows`` rows per
   rank (CPU fit), summary mode under the GDN layout / under the attention plan, heads mode, and the
   island choice; workloads: CP x k preset copies, ``chain_weak``, and ``tree:<preset>`` (one tree
   scaled with CP).

    .venv/bin/python tools/bench_cp_gdn.py                       # analytic table, CP 2..32
    .venv/bin/python tools/bench_cp_gdn.py --measure --no-bytes  # measured CPU times, CP2 and CP4
    .venv/bin/python tools/bench_cp_gdn.py --calibrate --no-bytes --repeats 5
    .venv/bin/python tools/bench_cp_gdn.py --no-bytes --measure-layout --measure-heads 2,4,32,32,4
    .venv/bin/python tools/bench_cp_gdn.py --no-bytes --weak --weak-cp 2,8,32
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_tree.cp import plan_context_parallel  # noqa: E402
from megatron_tree.cp import mamba_exchange_figures  # noqa: E402
from megatron_tree.cp.planning.capacity import MAMBA_DEFAULT  # noqa: E402
from megatron_tree.cp.planning.gdn_layout import gdn_layout_figures, plan_gdn_layout, predict_gdn_seconds  # noqa: E402
from megatron_tree.cp.planning.gdn_plan import GDNCostModel, GDNHeads, choose_mode, gdn_cp_figures, gdn_pieces  # noqa: E402
from megatron_tree.cp.planning.schedule import schedule_figures  # noqa: E402
from megatron_tree.data.synthetic import PRESETS, make_preset  # noqa: E402
from megatron_tree.tree import pack  # noqa: E402

MB = 1 << 20


def preset_layout(name: str, scale: float = 1.0, seed: int = 0):
    mbs = pack(make_preset(name, seed=seed, scale=scale), 1 << 40)
    assert len(mbs) == 1
    return mbs[0].layout


# ------------------------------------------------------------------------------------ analytic
def bytes_table(presets, cps, heads: GDNHeads, hkv: int, d: int) -> list[dict]:
    rows = []
    for name in presets:
        layout = preset_layout(name)
        for cp in cps:
            plan = plan_context_parallel(layout, cp)
            f = gdn_cp_figures(plan, layout, heads)
            # reference: the same rows owned in cp contiguous blocks (what a GDN-friendly island would do)
            contig = plan_context_parallel(layout, cp, strategy="contiguous")
            fc = gdn_cp_figures(contig, layout, heads)["summary"]
            gl = plan_gdn_layout(layout, cp, heads=heads, cost=GDNCostModel(), mode="summary")  # summary-optimal
            fl = gdn_layout_figures(layout, plan, heads=heads, cost=GDNCostModel(), gdn_plan=gl)
            mam = mamba_exchange_figures(plan, *MAMBA_DEFAULT) if MAMBA_DEFAULT[0] % cp == 0 else None
            s, h = f["summary"], f["heads"]
            attn = float(schedule_figures(plan)["remote_rows"].sum()) * hkv * 2 * d * 2
            unit = dict(halo_rows=heads.conv_channels * 2, state_rows=heads.num_v_heads * heads.head_k_dim
                        * heads.head_v_dim * 4, map_rows=heads.num_v_heads * heads.head_k_dim ** 2 * 4)
            row = dict(preset=name, cp=cp, rows=layout.num_rows, attn_kv_mb=attn / MB,
                       summary_mb=float(s["bytes_sent"].sum()) / MB,
                       halo_mb=float(s["halo_rows"].sum()) / 2 * unit["halo_rows"] / MB,
                       states_mb=float(s["state_rows"].sum()) / 2 * unit["state_rows"] / MB,
                       maps_mb=float(s["map_rows"].sum()) / 2 * unit["map_rows"] / MB,
                       rounds=s["rounds"], entries=int(gdn_pieces(plan, layout).entries.size),
                       contig_summary_mb=float(fc["bytes_sent"].sum()) / MB,
                       layout_summary_mb=fl["layout"]["bytes"] / MB, layout_entries=fl["layout"]["entries"],
                       layout_rounds=fl["layout"]["rounds"],
                       redistribution_mb=fl["layout"]["redistribution_bytes"] / MB,
                       mamba_mb=None if mam is None else 2.0 * mam["forward_total"] / MB,
                       summary_rows_frac=float(s["summary_rows"].sum()) / layout.num_rows,
                       heads_mb=None if h is None else float(h["bytes_sent"].sum()) / MB,
                       summary_ms=1e3 * float(s["seconds"].max()),
                       heads_ms=None if h is None else 1e3 * float(h["seconds"].max()),
                       auto=choose_mode(plan, layout, heads))
            rows.append(row)
    return rows


def print_bytes(rows, heads, hkv, d):
    print(f"\nBytes moved by one layer's forward, summed over ranks (backward moves the same back). GDN heads "
          f"H={heads.num_k_heads} HV={heads.num_v_heads} K={heads.head_k_dim} V={heads.head_v_dim} W={heads.conv_width}"
          f" (bf16 activations, fp32 states); attention K/V: {hkv} heads x {d}+{d} (bf16). Balanced plans;\n"
          "halo / states / maps split the summary-mode MB; entr = state boundaries (entries), rnds = doubling rounds, "
          "sum rows = share of rows run with K+V state columns; *_ms = predicted slowest rank (GDNCostModel);\n"
          "contig sum MB = summary-mode MB if the same rows were owned in contiguous blocks.")
    hdr = (f"{'preset':<22} {'cp':>3} {'rows':>7} {'attn KV MB':>10} {'GDN sum MB':>10} {'halo':>7} {'states':>7} "
           f"{'maps':>7} {'entr':>5} {'rnds':>4} {'sum rows':>8} {'GDN heads MB':>12} {'sum ms':>7} {'heads ms':>8} "
           f"{'auto':>7} {'contig sum MB':>13}")
    print(hdr)
    for r in rows:
        hmb = "-" if r["heads_mb"] is None else f"{r['heads_mb']:.1f}"
        hms = "-" if r["heads_ms"] is None else f"{r['heads_ms']:.3f}"
        print(f"{r['preset']:<22} {r['cp']:>3} {r['rows']:>7} {r['attn_kv_mb']:>10.1f} {r['summary_mb']:>10.1f} "
              f"{r['halo_mb']:>7.2f} {r['states_mb']:>7.1f} {r['maps_mb']:>7.1f} {r['entries']:>5} {r['rounds']:>4} "
              f"{r['summary_rows_frac']:>8.2f} {hmb:>12} {r['summary_ms']:>7.3f} {hms:>8} {r['auto']:>7} "
              f"{r['contig_summary_mb']:>13.1f}")


def print_bytes_md(rows):
    """Figure (b): MiB per layer forward, summed over ranks."""
    print("\n| preset | CP | rows | attn KV MiB | GDN summary @attn MiB (entries, rounds) | GDN summary @layout MiB "
          "(entries, rounds) | + island redistribution MiB | GDN heads MiB | Mamba a2a MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        hmb = "-" if r["heads_mb"] is None else f"{r['heads_mb']:.1f}"
        mmb = "-" if r["mamba_mb"] is None else f"{r['mamba_mb']:.1f}"
        print(f"| {r['preset']} | {r['cp']} | {r['rows']:,} | {r['attn_kv_mb']:.1f} | {r['summary_mb']:.1f} "
              f"({r['entries']}, {r['rounds']}) | {r['layout_summary_mb']:.1f} ({r['layout_entries']}, "
              f"{r['layout_rounds']}) | {r['redistribution_mb']:.1f} | {hmb} | {mmb} |")


# ------------------------------------------------------------------------------------ GDN layout: measured
def _layout_body(preset, scale, heads, repeats, cost):
    """Summary mode under the attention (balanced) plan and under `plan_gdn_layout`: CPU seconds of
    this rank's forward and forward + backward (fastest repeat after a warm-up)."""
    import torch
    import torch.distributed as dist

    from megatron_tree.cp.execution.gdn import tree_gdn_cp

    torch.set_num_threads(1)
    rank, cp = dist.get_rank(), dist.get_world_size()
    layout = preset_layout(preset, scale)
    plans = dict(attention=plan_context_parallel(layout, cp),
                 layout=plan_gdn_layout(layout, cp, heads=heads, cost=cost, act_bytes=4))
    g = torch.Generator().manual_seed(0)
    N, C, HV = layout.num_rows, heads.conv_channels, heads.num_v_heads
    full = [torch.randn(N, C, generator=g), -torch.nn.functional.softplus(torch.randn(N, HV, generator=g)),
            torch.rand(N, HV, generator=g)]
    w, b = 0.3 * torch.randn(C, heads.conv_width, generator=g), 0.1 * torch.randn(C, generator=g)
    go = torch.randn(N, HV, heads.head_v_dim, generator=g)
    out = {}
    for name, plan in plans.items():
        rows = torch.as_tensor(plan.owner_rows(rank))
        x = [t[rows].clone().requires_grad_(True) for t in full]
        fw, fb = [], []
        for it in range(repeats + 1):
            dist.barrier()
            c0 = time.process_time()
            o = tree_gdn_cp(*x, w, b, layout, plan, None, num_k_heads=heads.num_k_heads, head_k_dim=heads.head_k_dim,
                            head_v_dim=heads.head_v_dim, mode="summary", backend="torch")
            c1 = time.process_time()
            if o.requires_grad:
                (o * go[rows]).sum().backward()
            c2 = time.process_time()
            if it:
                fw.append(c1 - c0)
                fb.append(c2 - c0)
        out[name] = dict(fwd=min(fw), fwd_bwd=min(fb), rows=int(rows.numel()), hash=plan.hash)
    return out


def measure_layout(presets, cps, heads: GDNHeads, repeats: int, cost: GDNCostModel) -> list[dict]:
    """Figure (a): predicted (``cost``) and measured slowest-rank CPU time of summary-mode GDN under the
    attention plan (chained pieces) and under the GDN layout (families local, long chains split)."""
    from megatron_tree.training.launch import run_distributed

    res = []
    for spec in presets:
        name, scale = spec.split(":") if ":" in spec else (spec, "0.1")
        scale = float(scale)
        layout = preset_layout(name, scale)
        one = run_distributed(_layout_body, 1, name, scale, heads, repeats, cost, timeout=1200)[0]["attention"]
        p1 = plan_context_parallel(layout, 1)
        pred1 = float(predict_gdn_seconds(p1, layout, heads=heads, cost=cost, act_bytes=4).max())
        for cp in cps:
            per_rank = run_distributed(_layout_body, cp, name, scale, heads, repeats, cost, timeout=1200)
            plans = dict(attention=plan_context_parallel(layout, cp),
                         layout=plan_gdn_layout(layout, cp, heads=heads, cost=cost, act_bytes=4))
            row = dict(preset=name, scale=scale, rows=layout.num_rows, cp=cp, cp1_fwd=one["fwd"],
                       cp1_fwd_bwd=one["fwd_bwd"], cp1_pred=pred1)
            for k, plan in plans.items():
                assert all(r[k]["hash"] == plan.hash for r in per_rank)
                f = gdn_cp_figures(plan, layout, heads, act_bytes=4, cost=cost)["summary"]
                row[k] = dict(pred=float(f["seconds"].max()), fwd=max(r[k]["fwd"] for r in per_rank),
                              fwd_bwd=max(r[k]["fwd_bwd"] for r in per_rank),
                              entries=int(gdn_pieces(plan, layout).entries.size), rounds=f["rounds"],
                              summary_rows=int(f["summary_rows"].sum()))
            res.append(row)
    return res


def print_layout_measure(rows, heads, cost):
    print(f"\nSummary-mode GDN, chained (attention plan) vs GDN layout; heads H={heads.num_k_heads} "
          f"HV={heads.num_v_heads} K={heads.head_k_dim} V={heads.head_v_dim} W={heads.conv_width}, float32, 1 thread per "
          f"gloo rank; predicted = CPU-calibrated GDNCostModel ({cost}), forward; measured = slowest rank's CPU time "
          "(process_time, fastest repeat).")
    print("| preset (scale) | rows | CP | plan | entries | rounds | summary rows | predicted fwd ms | measured fwd ms | "
          "measured fwd+bwd ms | CP1 fwd ms (pred / meas) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for k in ("attention", "layout"):
            e = r[k]
            print(f"| {r['preset']} ({r['scale']:g}) | {r['rows']:,} | {r['cp']} | {k} | {e['entries']} | {e['rounds']} "
                  f"| {e['summary_rows']:,} | {1e3 * e['pred']:.1f} | {1e3 * e['fwd']:.1f} | {1e3 * e['fwd_bwd']:.1f} | "
                  f"{1e3 * r['cp1_pred']:.1f} / {1e3 * r['cp1_fwd']:.1f} |")


# ------------------------------------------------------------------------------------ weak scaling goal
def weak_scaling(presets, cps, rows_per_rank: int, heads: GDNHeads, cost: GDNCostModel, hidden: int,
                 gdn_layers: int) -> list[dict]:
    """Figure (c): predicted GDN time at CP n over CP1 with ~``rows_per_rank`` rows per rank
    (`tools/bench_cp.weak_layout`: CP x k copies of the preset), slowest rank, forward."""
    from bench_cp import weak_layout as copies_layout

    def weak_layout(name, cp, rows):
        """``tree:<preset>``: ONE tree of the preset scaled to ~rows x cp rows (families grow with CP,
        the hard case for a contiguous layout); else `bench_cp.weak_layout` (CP x k copies)."""
        if not name.startswith("tree:"):
            return copies_layout(name, cp, rows)
        base = name[5:]
        one = preset_layout(base).num_rows
        mbs = pack(make_preset(base, seed=0, scale=rows * cp / one), 1 << 40)
        return mbs[0].layout, "one scaled tree"

    out = []
    for name in presets:
        l1, _ = weak_layout(name, 1, rows_per_rank)
        t1 = float(predict_gdn_seconds(plan_context_parallel(l1, 1), l1, heads=heads, cost=cost).max())
        for cp in cps:
            layout, how = weak_layout(name, cp, rows_per_rank)
            attn = plan_context_parallel(layout, cp)
            free = plan_gdn_layout(layout, cp, heads=heads, cost=cost, hidden_size=hidden, gdn_layers=gdn_layers,
                                   mode="summary")  # the scan goal: the layout priced for summary mode
            f = gdn_layout_figures(layout, attn, heads=heads, cost=cost, hidden_size=hidden, gdn_layers=gdn_layers,
                                   gdn_plan=free)
            island = plan_gdn_layout(layout, cp, attention_plan=attn, heads=heads, cost=cost, hidden_size=hidden,
                                     gdn_layers=gdn_layers)
            # one CP1 rank holds as many rows as the busiest CP rank of the layout plan
            n1 = layout.num_rows / cp
            s = f["layout"]["seconds"]
            summ = gdn_cp_figures(free, layout, heads, cost=cost)["summary"]
            k = int(np.argmax(s))
            parts = dict(rows=float(summ["rows"][k]), summary_rows=float(summ["summary_rows"][k]),
                         bytes=float(max(summ["bytes_sent"][k], summ["bytes_recv"][k])),
                         collectives=int(summ["collectives"]), calls=float(summ["calls"][k]))
            out.append(dict(preset=name, cp=cp, rows=layout.num_rows, how=how, cp1_rows=l1.num_rows, cp1_s=t1,
                            rows_per_rank=n1, layout_s=float(s.max()), attn_s=f["attention"]["max_s"],
                            heads_s=None if f["heads"] is None else f["heads"]["max_s"],
                            redistribution_s=f["layout"]["redistribution_s"],
                            island=f"{island.stats['source']}/{island.stats['mode']}",
                            island_s=island.stats["gdn_ms"] / 1e3 + island.stats["redistribution_ms"] / 1e3 / gdn_layers,
                            worst=parts, entries=f["layout"]["entries"], rounds=f["layout"]["rounds"]))
    return out


def print_weak(rows, heads, cost, rows_per_rank):
    print(f"\nWeak scaling of one GDN layer (forward, slowest rank), ~{rows_per_rank:,} rows per rank, predicted with "
          f"{cost}; heads H={heads.num_k_heads} HV={heads.num_v_heads} K={heads.head_k_dim} V={heads.head_v_dim}. "
          "ratio = time at CP n / time at CP1 (one rank, one copy set). island = plan_gdn_layout given the attention "
          "plan (redistribution amortised over the island's GDN layers).")
    print("| workload | CP | rows (CP1 rows) | summary @layout / CP1 | summary @attn / CP1 | heads / CP1 | island / CP1 (choice) | "
          "layout: entries, rounds; slowest rank rows + summary rows |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        h = "-" if r["heads_s"] is None else f"{r['heads_s'] / r['cp1_s']:.2f}"
        w = r["worst"]
        print(f"| {r['preset']} | {r['cp']} | {r['rows']:,} ({r['cp1_rows']:,}) | {r['layout_s'] / r['cp1_s']:.2f} | "
              f"{r['attn_s'] / r['cp1_s']:.2f} | {h} | {r['island_s'] / r['cp1_s']:.2f} ({r['island']}) | "
              f"{r['entries']}, {r['rounds']}; {w['rows']:,.0f} + {w['summary_rows']:,.0f} |")


# ------------------------------------------------------------------------------------ measured
def _timing_body(preset, scale, heads, modes, repeats, strategy="balanced"):
    import torch
    import torch.distributed as dist

    from megatron_tree.cp.execution.gdn import tree_gdn_cp

    torch.set_num_threads(1)
    rank, cp = dist.get_rank(), dist.get_world_size()
    layout = preset_layout(preset, scale)
    plan = plan_context_parallel(layout, cp, strategy=strategy)  # CP1: all rows on rank 0, single-device ops
    g = torch.Generator().manual_seed(0)
    N, C, HV = layout.num_rows, heads.conv_channels, heads.num_v_heads
    full = [torch.randn(N, C, generator=g), -torch.nn.functional.softplus(torch.randn(N, HV, generator=g)),
            torch.rand(N, HV, generator=g)]
    w, b = 0.3 * torch.randn(C, heads.conv_width, generator=g), 0.1 * torch.randn(C, generator=g)
    go = torch.randn(N, HV, heads.head_v_dim, generator=g)
    rows = torch.as_tensor(plan.owner_rows(rank))
    x = [t[rows].clone().requires_grad_(True) for t in full]
    wl, bl = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    out = {}
    for mode in modes:
        walls, cpus = [], []
        for it in range(repeats + 1):  # the first call builds and caches the host plan
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            o = tree_gdn_cp(*x, wl, bl, layout, plan, None, num_k_heads=heads.num_k_heads,
                            head_k_dim=heads.head_k_dim, head_v_dim=heads.head_v_dim, mode=mode, backend="torch")
            if o.requires_grad:
                (o * go[rows]).sum().backward()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if it:
                walls.append(wall)
                cpus.append(cpu)
        out[mode] = dict(wall=walls, cpu=cpus)
    out["rows"] = int(rows.numel())
    return out


def measure(preset, scale, cps, heads: GDNHeads, repeats: int, strategy: str = "balanced") -> dict:
    from megatron_tree.training.launch import run_distributed

    layout = preset_layout(preset, scale)
    one = run_distributed(_timing_body, 1, preset, scale, heads, ("summary",), repeats, timeout=1200)[0]["summary"]
    res = dict(preset=preset, scale=scale, strategy=strategy, rows=layout.num_rows,
               cp1_s=statistics.median(one["wall"]),
               cp1_cpu_s=statistics.median(one["cpu"]), by_cp={})
    for cp in cps:
        per_rank = run_distributed(_timing_body, cp, preset, scale, heads, ("summary", "heads"), repeats, strategy,
                                   timeout=1200)
        entry = {}
        for mode in ("summary", "heads"):
            wall = [max(r[mode]["wall"][i] for r in per_rank) for i in range(repeats)]
            cpu = [max(r[mode]["cpu"][i] for r in per_rank) for i in range(repeats)]
            entry[mode] = dict(wall_s=statistics.median(wall), cpu_s=statistics.median(cpu))
        entry["rows_per_rank"] = [r["rows"] for r in per_rank]
        plan = plan_context_parallel(layout, cp, strategy=strategy)
        entry["auto"] = choose_mode(plan, layout, heads, act_bytes=4, state_bytes=4)
        f = gdn_cp_figures(plan, layout, heads, act_bytes=4)
        entry["summary_rows"] = [int(x) for x in f["summary"]["summary_rows"]]
        entry["rounds"] = f["summary"]["rounds"]
        res["by_cp"][cp] = entry
    return res


def print_measure(m, heads):
    print("\nMeasured (CPU, gloo, float32, 1 thread per rank): one GDN layer call, forward + backward, on "
          f"{m['preset']} x{m['scale']} ({m['rows']} rows, {m['strategy']} plans); heads H={heads.num_k_heads} "
          f"HV={heads.num_v_heads} K={heads.head_k_dim} V={heads.head_v_dim} W={heads.conv_width}. CP1 (one gloo "
          f"rank, the single-device ops): {1e3 * m['cp1_s']:.1f} ms wall, {1e3 * m['cp1_cpu_s']:.1f} ms CPU.")
    print(f"{'cp':>3} {'mode':>8} {'slowest wall ms':>15} {'slowest CPU ms':>14} {'CPU vs CP1':>10}   rows/rank, "
          "summary rows/rank, rounds, auto")
    for cp, e in m["by_cp"].items():
        for mode in ("summary", "heads"):
            r = e[mode]
            extra = (f"{e['rows_per_rank']}, {e['summary_rows']}, {e['rounds']}, {e['auto']}"
                     if mode == "summary" else "")
            print(f"{cp:>3} {mode:>8} {1e3 * r['wall_s']:>15.1f} {1e3 * r['cpu_s']:>14.1f} "
                  f"{r['cpu_s'] / m['cp1_cpu_s']:>10.2f}   {extra}")


# ------------------------------------------------------------------------------------ calibration
def _compute_body(heads, sizes, repeats):
    """CP1 (one rank): forward seconds of one GDN layer call (conv + recurrence, autograd on) on a
    chain and on a forked tree of each size; returns [(flops, seconds)]."""
    import numpy as np
    import torch

    from megatron_tree.cp import CPPlan
    from megatron_tree.cp.execution.gdn import tree_gdn_cp
    from megatron_tree.tree.layout import TreeLayout

    torch.set_num_threads(1)
    H, HV, K, V, W, C = (heads.num_k_heads, heads.num_v_heads, heads.head_k_dim, heads.head_v_dim,
                         heads.conv_width, heads.conv_channels)
    out = []
    for N in sizes:
        q = N // 8
        for layout in (TreeLayout.from_segments([N], [-1]),
                       TreeLayout.from_segments([N - 7 * q] + [q] * 7, [-1, 0, 0, 0, 1, 1, 2, 2])):
            plan = CPPlan(1, "one", np.zeros(N, np.int32), layout.visible_until.numpy(), layout.position_ids.numpy())
            g = torch.Generator().manual_seed(N)
            x = [torch.randn(N, C, generator=g).requires_grad_(True),
                 (-torch.nn.functional.softplus(torch.randn(N, HV, generator=g))).requires_grad_(True),
                 torch.rand(N, HV, generator=g).requires_grad_(True)]
            w, b = 0.3 * torch.randn(C, W, generator=g), torch.zeros(C)
            ts = []
            for it in range(repeats + 1):
                t0 = time.process_time()
                tree_gdn_cp(*x, w, b, layout, plan, num_k_heads=H, head_k_dim=K, head_v_dim=V, mode="summary",
                            backend="torch")
                if it:
                    ts.append(time.process_time() - t0)
            out.append((float(HV * 8 * K * V * N + 2 * W * C * N), min(ts)))  # min: least disturbed by peers
    return out


def _comm_body(sizes, repeats):
    """Two gloo ranks: wall seconds of one ``all_to_all_single`` moving ``nbytes`` each way."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = []
    for nbytes in sizes:
        n = max(nbytes // 4, 0)
        src = torch.zeros(2 * n)
        dst = torch.empty(2 * n)
        ts = []
        for it in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(dst, src, [n, n], [n, n])
            if it:
                ts.append(time.perf_counter() - t0)
        out.append((float(4 * n), min(ts)))
    return out


def calibrate(heads: GDNHeads, sizes, comm_sizes, repeats: int, path: str | None) -> dict:
    """Fit `GDNCostModel` on this CPU: ``seconds = sec_per_call + flops * sec_per_flop`` from CP1
    layer calls, ``seconds = sec_per_collective + bytes * sec_per_byte`` from gloo all-to-alls;
    least squares on relative error over the fastest repeat (the one least disturbed by
    other processes), coefficients clipped at 0. Writes the JSON to ``path`` when given."""
    import numpy as np

    from megatron_tree.training.launch import run_distributed

    comp = run_distributed(_compute_body, 1, heads, sizes, repeats, timeout=1200)[0]
    comm = run_distributed(_comm_body, 2, comm_sizes, repeats, timeout=600)
    comm = [(b, max(r[i][1] for r in comm)) for i, (b, _) in enumerate(comm[0])]

    def fit(pts):
        x = np.array([p[0] for p in pts])
        y = np.array([p[1] for p in pts])
        a = np.stack([np.ones_like(x), x], 1) / y[:, None]  # relative error: small points count as much
        (c, m), *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
        return max(float(c), 0.0), max(float(m), 0.0)

    call, spf = fit(comp)
    coll, spb = fit(comm)
    d = dict(sec_per_flop=spf, sec_per_byte=spb, sec_per_collective=coll, sec_per_call=call,
             meta=dict(what="GDNCostModel CPU fit (tools/bench_cp_gdn.py --calibrate): forward of one GDN layer "
                            "call, 1 thread per rank, float32, torch backend; gloo all_to_all_single between 2 ranks",
                       heads=[heads.num_k_heads, heads.num_v_heads, heads.head_k_dim, heads.head_v_dim,
                              heads.conv_width],
                       compute_points=[[f, t] for f, t in comp], comm_points=[[b, t] for b, t in comm],
                       gflops_per_s=(1e-9 / spf) if spf else None, gb_per_s=(1e-9 / spb) if spb else None))
    if path:
        with open(path, "w") as f:
            json.dump(d, f, indent=1)
            f.write("\n")
    return d


def print_calibration(d):
    m = d["meta"]
    print(f"\nGDN CPU calibration (heads {m['heads']}): sec_per_flop={d['sec_per_flop']:.3e} "
          f"({m['gflops_per_s'] or 0:.2f} GFLOP/s), sec_per_call={1e3 * d['sec_per_call']:.3f} ms, "
          f"sec_per_byte={d['sec_per_byte']:.3e} ({m['gb_per_s'] or 0:.2f} GB/s), "
          f"sec_per_collective={1e3 * d['sec_per_collective']:.3f} ms")
    print("compute points (flops, s):", [(f"{f:.3g}", f"{t * 1e3:.2f}ms") for f, t in m["compute_points"]])
    print("comm points (bytes, s):", [(f"{b:.3g}", f"{t * 1e3:.3f}ms") for b, t in m["comm_points"]])


def planning_time(repeats: int = 3) -> float:
    """Best-of-``repeats`` milliseconds of `plan_gdn_layout` on trees of a 2K-row prefix and 8 branches
    of 500-3000 rows, 100K rows in all, CP8 (the attention plan made first, outside the timing)."""
    import time

    from megatron_tree.cp.planning.planner import plan_context_parallel
    from megatron_tree.tree.layout import TreeLayout

    rng = np.random.default_rng(0)
    lengths, parents = [], []
    while sum(lengths) < 100_000:
        root = len(lengths)
        lengths.append(2000)
        parents.append(-1)
        for _ in range(8):
            lengths.append(int(rng.integers(500, 3000)))
            parents.append(root)
    layout = TreeLayout.from_segments(lengths, parents)
    attn = plan_context_parallel(layout, 8)
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms caches
        t0 = time.perf_counter()
        plan_gdn_layout(layout, 8, attention_plan=attn, cost=GDNCostModel())
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp", default="2,4,8,16,32")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--gdn-heads", default="16,32,128,128,4", help="H,HV,K,V,W of one TP rank")
    ap.add_argument("--attn-kv", default="2,256", help="Hkv,D of one TP rank's attention")
    ap.add_argument("--no-bytes", action="store_true")
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--measure-preset", default="varied_5k_16x100")
    ap.add_argument("--measure-scale", type=float, default=0.1)
    ap.add_argument("--measure-cp", default="2,4")
    ap.add_argument("--measure-heads", default="2,4,16,16,4")
    ap.add_argument("--measure-strategy", default="balanced", help="CP planner strategy of the measured plans")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", action="store_true", help="print the bytes table as markdown too (figure b)")
    ap.add_argument("--measure-layout", action="store_true",
                    help="figure (a): chained (attention plan) vs GDN layout, predicted and measured, CP2/CP4")
    ap.add_argument("--layout-presets", default="varied_5k_16x100:0.1,long_8k_16x8k:0.02,agent_multiturn:0.25,"
                                                "dominant_14745_16x921:0.08", help="preset:scale,...")
    ap.add_argument("--weak", action="store_true", help="figure (c): predicted weak-scaling ratio CP n / CP1")
    ap.add_argument("--weak-cp", default="2,8,32")
    ap.add_argument("--weak-presets", default=",".join(PRESETS) + ",chain_weak,tree:varied_5k_16x100,"
                    "tree:long_8k_16x8k,tree:dominant_14745_16x921,tree:agent_multiturn")
    ap.add_argument("--weak-rows", type=int, default=20480, help="rows per rank of the weak-scaling layouts")
    ap.add_argument("--weak-heads", default="16,32,128,128,4")
    ap.add_argument("--calibrate", action="store_true", help="fit GDNCostModel on this CPU (writes --calib-out)")
    ap.add_argument("--calib-heads", default="2,4,32,32,4")
    ap.add_argument("--calib-sizes", default="512,1024,2048,4096")
    ap.add_argument("--calib-out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                        "megatron_tree", "cp", "planning", "gdn_cost_cpu.json"))
    ap.add_argument("--planning-time", action="store_true",
                    help="host time of plan_gdn_layout on a 100K-row step at CP8 (was a timed test; ~10-20 ms)")
    args = ap.parse_args(argv)
    report = {}
    if args.planning_time:
        report["planning_ms"] = planning_time()
        print(f"plan_gdn_layout, 100K rows, CP8: {report['planning_ms']:.1f} ms (best of {args.repeats})")
    if args.calibrate:
        heads = GDNHeads(*[int(x) for x in args.calib_heads.split(",")])
        d = calibrate(heads, [int(x) for x in args.calib_sizes.split(",")],
                      [0, 1 << 16, 1 << 20, 1 << 22, 1 << 24], args.repeats, args.calib_out)
        print_calibration(d)
        report["calibration"] = d
    if not args.no_bytes:
        heads = GDNHeads(*[int(x) for x in args.gdn_heads.split(",")])
        hkv, d = (int(x) for x in args.attn_kv.split(","))
        rows = bytes_table(args.presets.split(","), [int(c) for c in args.cp.split(",")], heads, hkv, d)
        print_bytes(rows, heads, hkv, d)
        if args.md:
            print_bytes_md(rows)
        report["bytes"] = rows
    if args.measure_layout:
        heads = GDNHeads(*[int(x) for x in args.measure_heads.split(",")])
        cost = GDNCostModel.cpu()
        m = measure_layout(args.layout_presets.split(","), [int(c) for c in args.measure_cp.split(",")], heads,
                           args.repeats, cost)
        print_layout_measure(m, heads, cost)
        report["layout_measured"] = m
    if args.weak:
        heads = GDNHeads(*[int(x) for x in args.weak_heads.split(",")])
        cost = GDNCostModel.cpu()
        w = weak_scaling(args.weak_presets.split(","), [int(c) for c in args.weak_cp.split(",")], args.weak_rows, heads,
                         cost, 2048, 3)
        print_weak(w, heads, cost, args.weak_rows)
        report["weak"] = w
    if args.measure:
        heads = GDNHeads(*[int(x) for x in args.measure_heads.split(",")])
        m = measure(args.measure_preset, args.measure_scale, [int(c) for c in args.measure_cp.split(",")], heads,
                    args.repeats, args.measure_strategy)
        print_measure(m, heads)
        report["measured"] = m
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
