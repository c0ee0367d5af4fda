"""GDN layout islands: one training step of a tiny hybrid model under tree CP, islands on vs off.

    .venv/bin/python tools/bench_cp_islands.py                   # CP2 and CP4, pattern GGG-*GGG-
    .venv/bin/python tools/bench_cp_islands.py --cp 2 --repeats 3 --json out.json
    .venv/bin/python tools/bench_cp_islands.py --bytes            # analytic table: presets, CP 2..32

Workload: one microbatch of ``--preset`` (default ``varied_5k_16x100`` at ``--scale 0.1``: four
families of 16 completions, packed as one forest), the attention plan of ``--strategy`` (the
balanced planner by default), the island plan of `megatron_tree.megatron.forward_step.gdn_island_plan`.
Same model, weights and schedule (``get_forward_backward_func``, float32, GDN mode "auto") with
islands on (hidden states move to the island ownership at each island's entry / exit) and off (GDN
layers run on the attention ownership). Reported per setting: median over ``--repeats`` of the
slowest rank's wall time and of its CPU time (``time.process_time``: what the rank computed, without
waiting for peers; on a shared 2-core host, CP4 wall time mostly measures oversubscription), and the
bytes the island moves put on the network per step (rows whose owner changes x hidden x 4 bytes,
two moves per island, forward and backward).

``--bytes`` (analytic, no model run): for every preset packed as one forest and each CP size, the
bytes one island move puts on the network (``--model-hidden`` x 2 bytes, bf16, per row whose owner
changes; summed over ranks and for the busiest sender) next to what one attention layer fetches
(remote K/V rows of the balanced plan x ``--attn-kv`` Hkv x (D + D) x 2 bytes) and what one GDN
layer's summary mode sends under the balanced plan vs the island plan (`gdn_cp_figures`, heads of
``--gdn-heads``). A move happens twice per island and forward step, so an island of L GDN layers
pays off when 2 x move < L x (summary bytes saved), and similarly in time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _body(a: dict) -> dict:
    import torch
    import torch.distributed as dist

    torch._dynamo.config.disable = True  # Megatron's jit_fuser would torch.compile on CPU
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tree.cp import plan_context_parallel
    from megatron_tree.cp.execution.redistribute import redistribution_count
    from megatron_tree.cp.planning.row_moves import redistribution_figures
    from megatron_tree.data.synthetic import make_preset
    from megatron_tree.megatron.forward_step import gdn_island_plan
    from megatron_tree.training.megatron_init import init_megatron
    from megatron_tree.training.models import ModelArgs, build_model, forward_backward, make_config, wrap_ddp
    from megatron_tree.tree import pack

    cp = dist.get_world_size()
    init_megatron(cp=cp, seed=0, kernels=True)
    samples = make_preset(a["preset"], vocab=a["vocab"], scale=a["scale"])
    mb = pack(samples, 1 << 30, pad_to_multiple_of=8)[0]
    plan = plan_context_parallel(mb.layout, cp, strategy=a["strategy"])
    margs = ModelArgs(kind="hybrid", pattern=a["pattern"], hidden_size=a["hidden"], num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=2 * a["hidden"], vocab_size=a["vocab"],
                      max_position=mb.num_rows)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = make_config(margs, cp=cp)
    model = build_model(config, margs)
    ddp = wrap_ddp(model, config)
    t0 = time.perf_counter()
    gplan = gdn_island_plan(mb.layout, cp, plan, **model.gdn_island_geometry)
    island_plan_s = time.perf_counter() - t0
    out = dict(rows=mb.num_rows, islands=len(model.gdn_island_spans), kinds=model.gdn_layer_kinds,
               island_plan_s=island_plan_s)
    for setting in ("on", "off"):
        model.gdn_islands = setting == "on"
        item = [(mb, (plan, gplan))]
        forward_backward(ddp, item)  # warm-up (plans, caches)
        wall, cpu = [], []
        redistribution_count(reset=True)
        for _ in range(a["repeats"]):
            ddp.zero_grad_buffer()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            forward_backward(ddp, item)
            w, c = torch.tensor([time.perf_counter() - t0]), torch.tensor([time.process_time() - c0])
            dist.all_reduce(w, op=dist.ReduceOp.MAX)
            dist.all_reduce(c, op=dist.ReduceOp.MAX)
            wall.append(float(w))
            cpu.append(float(c))
        out[setting] = dict(wall_s=statistics.median(wall), cpu_s=statistics.median(cpu),
                            moves_per_step=redistribution_count() // max(1, a["repeats"]))
    fig = redistribution_figures(plan, gplan, a["hidden"] * 4)
    moves = 2 * out["islands"]
    out["bytes"] = dict(per_move=fig["bytes_moved"], fraction_rows_moved=fig["fraction_moved"],
                        max_rank_send_per_move=fig["max_rank_send_bytes"],
                        per_step_fwd_bwd=2 * moves * fig["bytes_moved"])
    return out


def bytes_table(a) -> list:
    from megatron_tree.cp import GDNHeads, plan_context_parallel
    from megatron_tree.cp.planning.gdn_plan import gdn_cp_figures
    from megatron_tree.cp.planning.row_moves import redistribution_figures
    from megatron_tree.cp.planning.schedule import schedule_figures
    from megatron_tree.data.synthetic import PRESETS, make_preset
    from megatron_tree.megatron.forward_step import gdn_island_plan
    from megatron_tree.tree import pack

    heads = GDNHeads(*[int(x) for x in a.gdn_heads.split(",")])
    hkv, d = (int(x) for x in a.attn_kv.split(","))
    MB = float(1 << 20)
    rows = []
    for name in (a.presets.split(",") if a.presets else PRESETS):
        layout = pack(make_preset(name), 1 << 40)[0].layout
        for cp in a.bytes_cp:
            plan = plan_context_parallel(layout, cp)
            t0 = time.perf_counter()
            gplan = gdn_island_plan(layout, cp, plan, heads=heads, hidden_size=a.model_hidden, act_bytes=2,
                                    gdn_layers=a.gdn_layers)
            plan_s = time.perf_counter() - t0
            mv = redistribution_figures(plan, gplan, a.model_hidden * 2)
            attn = float(schedule_figures(plan)["remote_rows"].sum()) * hkv * 2 * d * 2
            s_bal = float(gdn_cp_figures(plan, layout, heads)["summary"]["bytes_sent"].sum())
            s_isl = float(gdn_cp_figures(gplan, layout, heads)["summary"]["bytes_sent"].sum())
            rows.append(dict(preset=name, cp=cp, rows=layout.num_rows, move_mb=mv["bytes_moved"] / MB,
                             move_max_rank_mb=mv["max_rank_send_bytes"] / MB, frac=mv["fraction_moved"],
                             attn_kv_mb=attn / MB, gdn_summary_balanced_mb=s_bal / MB,
                             gdn_summary_island_mb=s_isl / MB, island_plan_ms=1e3 * plan_s))
            r = rows[-1]
            print(f"{name:<22} {cp:>3} {r['rows']:>7} {r['move_mb']:>9.1f} {r['move_max_rank_mb']:>9.1f} "
                  f"{100 * r['frac']:>5.0f}% {r['attn_kv_mb']:>9.1f} {r['gdn_summary_balanced_mb']:>9.1f} "
                  f"{r['gdn_summary_island_mb']:>9.1f} {r['island_plan_ms']:>8.1f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--pattern", default="GGG-*GGG-")
    ap.add_argument("--preset", default="varied_5k_16x100")
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--strategy", default="balanced")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--bytes", action="store_true", help="analytic bytes table only (no model run)")
    ap.add_argument("--bytes-cp", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--presets", default=None, help="comma-separated presets for --bytes (default: all)")
    ap.add_argument("--model-hidden", type=int, default=4096, help="hidden size for --bytes (bf16 rows)")
    ap.add_argument("--gdn-heads", default="16,32,128,128,4", help="H,HV,K,V,W of one TP rank (--bytes)")
    ap.add_argument("--attn-kv", default="2,256", help="Hkv,D of one TP rank's attention (--bytes)")
    ap.add_argument("--gdn-layers", type=int, default=3, help="GDN layers per island (--bytes: the planner's trade-off)")
    a = ap.parse_args()
    if a.bytes:
        print(f"{'preset':<22} {'cp':>3} {'rows':>7} {'move MB':>9} {'max rank':>9} {'rows':>6} {'attn KV':>9} "
              f"{'GDN bal':>9} {'GDN isl':>9} {'plan ms':>8}")
        rows = bytes_table(a)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    from megatron_tree.training.launch import run_distributed

    res = {}
    for cp in a.cp:
        r = run_distributed(_body, cp, vars(a), timeout=1800)[0]
        res[cp] = r
        on, off = r["on"], r["off"]
        print(f"CP{cp} rows={r['rows']} layers={r['kinds']} islands={r['islands']}: "
              f"islands on  wall {on['wall_s']:.3f}s cpu {on['cpu_s']:.3f}s ({on['moves_per_step']} moves/step) | "
              f"off wall {off['wall_s']:.3f}s cpu {off['cpu_s']:.3f}s | cpu off/on {off['cpu_s'] / on['cpu_s']:.2f}x | "
              f"moved {r['bytes']['per_move'] / 1024:.1f} KiB/move ({100 * r['bytes']['fraction_rows_moved']:.0f}% "
              f"of rows), {r['bytes']['per_step_fwd_bwd'] / 1024:.1f} KiB/step | island plan {r['island_plan_s'] * 1e3:.1f} ms",
              flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
