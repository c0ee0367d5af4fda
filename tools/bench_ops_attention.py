"""Benchmark of tree attention (torch backend) on CPU.

(a) Speed: one GRPO family (prompt 2048 + 8 completions x 256), float32, 8 heads of 64: tree
    attention forward+backward vs per-sample ``scaled_dot_product_attention(is_causal=True)``
    forward+backward over the same 8 samples batched as [8, H, 2304, D]. Runs alternate within one
    process (the machine is shared, so the minimum over repeats is reported, medians alongside).
    "ideal" is the ratio of visible (query, key) pairs flat / tree: the speedup of a kernel that
    spent the same time per visible pair as the flat one.
(b) Memory: peak resident memory of tree attention forward+backward at N = 8K, 16K, 32K rows (a
    1024-row prompt with 512-row branches), each in a fresh subprocess (Linux VmHWM, reset after
    the inputs are built, minus the RSS at that point; it includes the gradients of q, k, v), next
    to the size of one dense N x N fp32 score matrix.

    PYTHONPATH=. .venv/bin/python tools/bench_ops_attention.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from megatron_tree.ops.attention import DEFAULT_BLOCK_SIZE, tree_attention
from megatron_tree.tree.layout import TreeLayout

H, D = 8, 64


def _grpo_layout(prompt=2048, completions=8, completion_len=256) -> TreeLayout:
    return TreeLayout.from_segments([prompt] + [completion_len] * completions, [-1] + [0] * completions)


def _sample_rows(layout: TreeLayout) -> list[torch.Tensor]:
    """Root-to-leaf rows of a one-level family (prompt segment 0, one completion per child)."""
    off = layout.segment_offsets.tolist()
    prompt = torch.arange(off[0], off[1])
    return [torch.cat([prompt, torch.arange(off[s], off[s + 1])]) for s in range(1, layout.num_segments)]


def bench_speed(reps: int = 5, block_size: int | None = None) -> dict:
    torch.manual_seed(0)
    layout = _grpo_layout()
    n = layout.num_rows
    samples = _sample_rows(layout)
    q, k, v = (torch.randn(n, H, D, requires_grad=True) for _ in range(3))
    # the flat baseline runs on exactly the same numbers, gathered per sample
    qf, kf, vf = (torch.stack([x.detach()[r] for r in samples]).transpose(1, 2).contiguous().requires_grad_()
                  for x in (q, k, v))
    g_tree = torch.randn(n, H, D)
    g_flat = torch.randn_like(qf)

    def tree_step():
        o = tree_attention(q, k, v, layout, backend="torch", block_size=block_size)
        o.backward(g_tree)
        return o

    def flat_step():
        o = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
        o.backward(g_flat)
        return o

    with torch.no_grad():  # same numbers: tree rows of each sample == that sample's flat output
        o_t = tree_attention(q, k, v, layout, backend="torch", block_size=block_size)
        o_f = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
        max_err = max(float((o_t[r] - o_f[i].transpose(0, 1)).abs().max()) for i, r in enumerate(samples))

    tree_step(), flat_step()  # warm-up
    t_tree, t_flat = [], []
    for _ in range(reps):
        for fn, acc in ((tree_step, t_tree), (flat_step, t_flat)):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    flat_pairs = sum(len(r) * (len(r) + 1) // 2 for r in samples)
    tree_pairs = layout.visible_pairs()
    ideal = flat_pairs / tree_pairs
    speedup = min(t_flat) / min(t_tree)
    return {
        "layout": "prompt 2048 + 8 x 256", "rows_tree": n, "rows_flat": sum(len(r) for r in samples),
        "heads": H, "head_dim": D, "dtype": "float32", "threads": torch.get_num_threads(),
        "block_size": block_size or DEFAULT_BLOCK_SIZE,
        "tree_s_min": min(t_tree), "tree_s_median": statistics.median(t_tree),
        "flat_sdpa_s_min": min(t_flat), "flat_sdpa_s_median": statistics.median(t_flat),
        "speedup": speedup, "speedup_median": statistics.median(t_flat) / statistics.median(t_tree),
        "visible_pairs_flat": flat_pairs, "visible_pairs_tree": tree_pairs, "ideal": ideal,
        "speedup_over_ideal": speedup / ideal, "max_abs_err_vs_sdpa": max_err,
    }


_MEM_CHILD = r"""
import json, re, sys, time, torch
from megatron_tree.ops.attention import tree_attention
from megatron_tree.tree.layout import TreeLayout
n, H, D = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
def status(field):  # kB
    return int(re.search(field + r":\s+(\d+)", open("/proc/self/status").read()).group(1))
def family(n):
    prompt, branch = 1024, 512
    nb = (n - prompt) // branch
    return TreeLayout.from_segments([prompt] + [branch] * nb, [-1] + [0] * nb)
small = family(2048)  # warm-up on a small tree: thread pools and allocator arenas exist before measuring
x = torch.randn(small.num_rows, H, D, requires_grad=True)
tree_attention(x, x, x, small, backend="torch").sum().backward()
del x
layout = family(n)
q, k, v = (torch.randn(layout.num_rows, H, D, requires_grad=True) for _ in range(3))
g = torch.randn(layout.num_rows, H, D)
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark VmHWM to the current RSS
    f.write("5")
t0 = time.perf_counter()
tree_attention(q, k, v, layout, backend="torch").backward(g)
dt = time.perf_counter() - t0
peak = status("VmHWM")
print(json.dumps({"rows": layout.num_rows, "peak_delta_mb": (peak - base) / 1024, "seconds": dt,
                  "visible_pairs": layout.visible_pairs()}))
"""


def bench_memory(sizes=(8192, 16384, 32768)) -> list[dict]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = []
    for n in sizes:
        res = subprocess.run([sys.executable, "-c", _MEM_CHILD, str(n), str(H), str(D)], capture_output=True,
                             text=True, env=env, check=True)
        row = json.loads(res.stdout.strip().splitlines()[-1])
        io_mb = 7 * n * H * D * 4 / 2**20  # q, k, v, o, dq, dk, dv at fp32
        row.update(dense_scores_per_head_mb=n * n * 4 / 2**20, qkv_o_grads_mb=io_mb,
                   peak_mb_per_1k_rows=row["peak_delta_mb"] / (n / 1024))
        out.append(row)
    return out


def run(quick: bool = False) -> dict:
    speed = bench_speed(reps=3 if quick else 7)
    memory = bench_memory((4096, 8192) if quick else (8192, 16384, 32768))
    return {"speed": speed, "memory": memory}


def _print(res: dict) -> None:
    s = res["speed"]
    print(f"(a) GRPO family {s['layout']}: {s['rows_tree']} tree rows vs {s['rows_flat']} flat rows, "
          f"H={s['heads']} D={s['head_dim']} {s['dtype']}, {s['threads']} threads, block {s['block_size']}")
    print(f"{'':24}{'min s':>9}{'median s':>10}")
    print(f"{'tree fwd+bwd':24}{s['tree_s_min']:9.3f}{s['tree_s_median']:10.3f}")
    print(f"{'flat SDPA fwd+bwd':24}{s['flat_sdpa_s_min']:9.3f}{s['flat_sdpa_s_median']:10.3f}")
    print(f"speedup {s['speedup']:.2f}x (median {s['speedup_median']:.2f}x), ideal {s['ideal']:.2f}x "
          f"(visible pairs {s['visible_pairs_flat']} / {s['visible_pairs_tree']}), "
          f"speedup/ideal {s['speedup_over_ideal']:.2f}; max |o_tree - o_sdpa| {s['max_abs_err_vs_sdpa']:.1e}")
    print("\n(b) peak memory of tree attention fwd+bwd (prompt 1024 + branches of 512)")
    print(f"{'rows':>7}{'peak MB':>10}{'MB/1K rows':>12}{'q,k,v,o+grads MB':>18}{'dense NxN/head MB':>19}{'s':>7}")
    for m in res["memory"]:
        print(f"{m['rows']:7d}{m['peak_delta_mb']:10.1f}{m['peak_mb_per_1k_rows']:12.2f}{m['qkv_o_grads_mb']:18.1f}"
              f"{m['dense_scores_per_head_mb']:19.0f}{m['seconds']:7.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the result dict as JSON too")
    args = ap.parse_args()
    result = run(quick=args.quick)
    _print(result)
    if args.json:
        print(json.dumps(result, indent=1))
