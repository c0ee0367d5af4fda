"""Mamba-2 under tree CP (the token -> head transpose, `megatron_tree.cp.tree_mamba_cp`): time and bytes.

1. **Measured CPU time** of the CP Mamba mixer core (the two all-to-alls + tree conv + tree SSD on
   H/cp heads over the whole tree; forward + backward) at CP1 / CP2 / CP4 on one packed preset
   tree (strong scaling: the same tree at every CP size), gloo ranks on this host, float32. Per CP:
   the slowest rank's wall time (median over repeats), its CPU time (``time.process_time``: what
   the rank itself burnt, which does not count waiting for a core; the test host has 2 shared
   cores, so CP4's wall time is inflated by oversubscription), and the wall time spent inside the
   exchanges.
2. **Bytes moved per layer** (analytic, forward + backward, summed over ranks): the Mamba
   all-to-all volume (`mamba_exchange_figures`) against attention's remote K/V plus the returned
   dK/dV (`schedule_figures` of the same plan), at CP 2..32, for Nemotron-Nano-like widths
   (Mamba: 64 heads x 64, 8 groups x 128 state; attention: 8 KV heads x 128), bf16.

    .venv/bin/python tools/bench_cp_mamba.py                                  # both parts
    .venv/bin/python tools/bench_cp_mamba.py --skip-time --cp-bytes 2,4,8,16,32 --scale 1.0
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_tree.cp import CPPlan, mamba_exchange_figures, plan_context_parallel  # noqa: E402
from megatron_tree.cp.planning.schedule import schedule_figures  # noqa: E402
from megatron_tree.data.synthetic import make_preset  # noqa: E402
from megatron_tree.tree import pack  # noqa: E402

BF16 = 2


def preset_layout(name: str, scale: float):
    mbs = pack(make_preset(name, seed=0, scale=scale), 1 << 40)
    assert len(mbs) == 1
    return mbs[0].layout


def make_plan(layout, cp: int, strategy: str) -> CPPlan:
    if strategy == "rows":  # equal contiguous row blocks, no planner (Mamba's compute ignores ownership)
        owner = ((np.arange(layout.num_rows) * cp) // max(1, layout.num_rows)).astype(np.int32)
        return CPPlan(cp, "rows", owner, layout.visible_until.numpy(), layout.position_ids.numpy())
    return plan_context_parallel(layout, cp, strategy=strategy)


# ------------------------------------------------------------------------------------- timing
def _time_body(layout, plan, dims, repeats):
    """One rank: forward + backward of tree_mamba_cp, ``repeats`` times after a warm-up."""
    import torch.distributed as dist

    import megatron_tree.cp.execution.mamba as cpm

    torch.set_num_threads(1)
    H, P, G, S, W = dims
    rank = dist.get_rank() if dist.is_initialized() else 0
    rows = torch.as_tensor(plan.owner_rows(rank))
    g = torch.Generator().manual_seed(0)
    conv_dim = H * P + 2 * G * S
    xfull = torch.randn(layout.num_rows, conv_dim + H, generator=g)
    x = xfull[rows].clone().requires_grad_(True)
    w = (torch.randn(conv_dim, W, generator=g) * 0.3).requires_grad_(True)
    b = torch.zeros(conv_dim, requires_grad=True)
    dt_bias = torch.zeros(H, requires_grad=True)
    A_log = torch.zeros(H, requires_grad=True)
    D = torch.ones(H, requires_grad=True)
    comm = [0.0]
    real = cpm.start_exchange

    def timed(*a, **kw):
        t0 = time.perf_counter()
        out = real(*a, **kw)
        comm[0] += time.perf_counter() - t0
        return out

    cpm.start_exchange = timed
    walls, cpus, comms = [], [], []
    try:
        for it in range(repeats + 1):
            if dist.is_initialized():
                dist.barrier()
            comm[0] = 0.0
            t0, c0 = time.perf_counter(), time.process_time()
            y = cpm.tree_mamba_cp(x, w, b, dt_bias, -torch.exp(A_log), D, layout, plan, head_dim=P, num_groups=G,
                                  d_state=S, backend="torch")
            y.sum().backward()
            if it:  # the first run warms caches (row order, shard indices, level schedule)
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
                comms.append(comm[0])
    finally:
        cpm.start_exchange = real
    return dict(wall=statistics.median(walls), cpu=statistics.median(cpus), comm=statistics.median(comms),
                rows=int(rows.numel()))


def time_part(args):
    from megatron_tree.training.launch import run_distributed

    layout = preset_layout(args.preset, args.scale)
    dims = tuple(int(v) for v in args.dims.split(","))
    H, P, G, S, W = dims
    print(f"\n## measured: {args.preset} at scale {args.scale} ({layout.num_rows} tree rows), Mamba H={H} P={P} G={G} "
          f"S={S} W={W}, float32, forward + backward, median of {args.repeats} (plan: {args.strategy})\n")
    print("| CP | heads/rank | rows/rank (max) | wall ms (slowest rank) | CPU ms (slowest rank) | exchange wall ms "
          "| wall CP1/CPn | CPU CP1/CPn |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for cp in [int(c) for c in args.cp_time.split(",")]:
        plan = make_plan(layout, cp, args.strategy)
        if cp == 1:
            res = [_time_body(layout, plan, dims, args.repeats)]
        else:
            res = run_distributed(_time_body, cp, layout, plan, dims, args.repeats, timeout=1800)
        wall = max(r["wall"] for r in res) * 1e3
        cpu = max(r["cpu"] for r in res) * 1e3
        comm = max(r["comm"] for r in res) * 1e3
        base = base or (wall, cpu)
        print(f"| {cp} | {H // cp} | {max(r['rows'] for r in res)} | {wall:.1f} | {cpu:.1f} | {comm:.1f} | "
              f"{base[0] / wall:.2f} | {base[1] / cpu:.2f} |")


# ------------------------------------------------------------------------------------- bytes
def bytes_part(args):
    H, P, G, S = 64, 64, 8, 128     # Nemotron-Nano-like Mamba layer (one TP rank)
    HKV, DH = 8, 128                # its attention layers' KV heads x head dim
    kv_row = 2 * HKV * DH * BF16    # K and V of one row
    print(f"\n## bytes per layer (analytic, forward + backward, all ranks), bf16: Mamba H={H} P={P} G={G} S={S} "
          f"vs attention KV {HKV}x{DH} (plan: {args.strategy})\n")
    print("| preset | rows | CP | Mamba all-to-all MB | attention K/V + dK/dV MB | Mamba / attention "
          "| Mamba max rank MB | attention max rank MB |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.presets.split(","):
        layout = preset_layout(name, args.scale)
        for cp in [int(c) for c in args.cp_bytes.split(",")]:
            plan = make_plan(layout, cp, args.strategy)
            m = mamba_exchange_figures(plan, H, P, G, S)
            mamba = (m["forward_total"] + m["backward_total"]) * BF16
            mamba_rank = int((m["forward_sent"] + m["backward_sent"]).max()) * BF16
            f = schedule_figures(plan)
            # forward: fetched K/V rows; backward: their dK/dV return to the owners (same size)
            attn = int(f["remote_rows"].sum()) * kv_row * 2
            attn_rank = int((f["sent_rows"] + f["remote_rows"]).max()) * kv_row
            ratio = mamba / attn if attn else float("inf")
            print(f"| {name} | {layout.num_rows} | {cp} | {mamba / 1e6:.2f} | {attn / 1e6:.2f} | {ratio:.2f} | "
                  f"{mamba_rank / 1e6:.2f} | {attn_rank / 1e6:.2f} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="varied_5k_16x100", help="preset of the timing part")
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--dims", default="8,16,2,16,4", help="timing Mamba dims H,P,G,S,W (one TP rank)")
    ap.add_argument("--cp-time", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--strategy", default="balanced", help="planner strategy, or 'rows' (equal contiguous blocks)")
    ap.add_argument("--presets", default="varied_5k_16x100,fixed_5k_16x100,agent_multiturn",
                    help="presets of the bytes part")
    ap.add_argument("--cp-bytes", default="2,4,8,16,32")
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--skip-bytes", action="store_true")
    args = ap.parse_args(argv)
    if not args.skip_time:
        time_part(args)
    if not args.skip_bytes:
        bytes_part(args)


if __name__ == "__main__":
    main()
