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
   (`megatron_tree.cp.gdn_plan.GDNCostModel`, default coefficients) and the mode "auto" picks.

    .venv/bin/python tools/bench_cp_gdn.py                       # analytic table, CP 2..32
    .venv/bin/python tools/bench_cp_gdn.py --measure --no-bytes  # measured CPU times, CP2 and CP4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_tree.cp import plan_context_parallel  # noqa: E402
from megatron_tree.cp.gdn_plan import GDNHeads, choose_mode, gdn_cp_figures, gdn_pieces  # noqa: E402
from megatron_tree.cp.schedule import schedule_figures  # noqa: E402
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


# ------------------------------------------------------------------------------------ measured
def _timing_body(preset, scale, heads, modes, repeats, strategy="balanced"):
    import torch
    import torch.distributed as dist

    from megatron_tree.cp.gdn import tree_gdn_cp

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
    args = ap.parse_args(argv)
    report = {}
    if not args.no_bytes:
        heads = GDNHeads(*[int(x) for x in args.gdn_heads.split(",")])
        hkv, d = (int(x) for x in args.attn_kv.split(","))
        rows = bytes_table(args.presets.split(","), [int(c) for c in args.cp.split(",")], heads, hkv, d)
        print_bytes(rows, heads, hkv, d)
        report["bytes"] = rows
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
