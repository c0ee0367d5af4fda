"""Benchmark: tree SSD / tree causal conv1d vs per-sample runs of the same torch functions.

Case: one GRPO family, a prompt shared by G completions (``[prompt] + [completion] * G``). The
per-sample baseline runs the G flattened samples ``prompt + completion`` as one batch ``[G,T,...]``
through the same chunked SSD (resp. a depthwise ``F.conv1d``); the tree runs every token once.
Forward + backward, float32, CPU by default. Speedup is compared with the token ratio
(flat tokens / tree tokens), the most a tree can save; the goal is >= 0.8x that ratio.

    PYTHONPATH=. python tools/bench_ops_ssd.py [--quick] [--device cuda] [--threads N] [--clock wall|cpu]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from megatron_tree.ops.causal_conv1d import tree_causal_conv1d
from megatron_tree.ops.ssd import ssd_chunked_torch, tree_ssd
from megatron_tree.tree.layout import TreeLayout


def _time(fn, reps: int, device: str, clock: str = "wall") -> float:
    """Best time of ``fn`` in ms over ``reps`` calls, after one warm-up call (the minimum is the
    estimate least disturbed by other processes on a shared machine). ``clock="cpu"`` counts this
    process's CPU time instead of wall time: steadier on an oversubscribed host, meaningful with
    one thread."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    now = time.process_time if clock == "cpu" else time.perf_counter
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = now()
        fn()
        sync()
        times.append((now() - t0) * 1e3)
    return min(times)


def _fwd_bwd(make_out, leaves):
    def step():
        for t in leaves:
            t.grad = None
        out = make_out()
        out.backward(torch.ones_like(out))
    return step


def run(quick: bool = False, *, device: str = "cpu", reps: int | None = None, threads: int | None = None,
        clock: str | None = None) -> dict:
    """Returns {"ssd": {...}, "conv": {...}, "config": {...}}, times in ms (best of ``reps``).

    ``threads`` sets ``torch.set_num_threads`` for the run (restored after); ``clock`` is "wall" or
    "cpu" (process CPU time). On CPU the defaults are one thread and the CPU clock: on a small shared
    machine, multi-threaded wall times swing by 10x with the neighbours' load (OpenMP threads
    waiting on descheduled peers), which says nothing about the ops.
    """
    on_cpu = not device.startswith("cuda")
    if threads is None and on_cpu:
        threads = 1
    if clock is None:
        clock = "cpu" if on_cpu and threads == 1 else "wall"
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(quick, device, reps, clock)
    finally:
        torch.set_num_threads(saved_threads)


def _run(quick, device, reps, clock):
    prompt, completion, group = (512, 64, 8) if quick else (2048, 256, 8)
    H, P, G, S, W = 8, 64, 1, 64, 4
    reps = reps or (2 if quick else 3)
    dtype = torch.float32
    layout = TreeLayout.from_segments([prompt] + [completion] * group, [-1] + [0] * group).to(device)
    N = layout.num_rows
    T = prompt + completion
    token_ratio = group * T / N
    gen = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=dtype).to(device)
    leaf = lambda t: t.requires_grad_()

    # --- SSD
    x, dt = leaf(rnd(N, H, P)), leaf(F.softplus(rnd(N, H) - 2))
    A, B, C, D = leaf(-torch.linspace(0.5, 4, H, dtype=dtype, device=device)), leaf(rnd(N, G, S)), leaf(rnd(N, G, S)), leaf(rnd(H))
    tree_ms = _time(_fwd_bwd(lambda: tree_ssd(x, dt, A, B, C, layout, D=D, backend="torch"), [x, dt, A, B, C, D]),
                    reps, device, clock)
    xb, dtb = leaf(rnd(group, T, H, P)), leaf(F.softplus(rnd(group, T, H) - 2))
    Bb, Cb = leaf(rnd(group, T, G, S)), leaf(rnd(group, T, G, S))
    flat_ms = _time(_fwd_bwd(lambda: ssd_chunked_torch(xb, dtb, A, Bb, Cb, D=D), [xb, dtb, A, Bb, Cb, D]),
                    reps, device, clock)
    # The batched baseline's per-row cost grows with its footprint on CPU (caches, page faults), so
    # also time the samples one at a time and report the speedup against the faster of the two.
    loop = lambda: torch.cat([ssd_chunked_torch(xb[i:i + 1], dtb[i:i + 1], A, Bb[i:i + 1], Cb[i:i + 1], D=D)
                              for i in range(group)])
    loop_ms = _time(_fwd_bwd(loop, [xb, dtb, A, Bb, Cb, D]), reps, device, clock)
    ssd = {"tree_ms": tree_ms, "per_sample_ms": flat_ms, "per_sample_one_by_one_ms": loop_ms,
           "speedup": min(flat_ms, loop_ms) / tree_ms}

    # --- conv (the conv in front of Mamba-2 runs on x, B and C together)
    Cn = H * P + 2 * G * S
    xc, w, bias = leaf(rnd(N, Cn)), leaf(rnd(Cn, W)), leaf(rnd(Cn))
    tree_ms = _time(_fwd_bwd(lambda: tree_causal_conv1d(xc, w, bias, layout, activation="silu"), [xc, w, bias]),
                    reps, device, clock)
    # same contract as the tree op: token-major in, token-major (contiguous) out
    xcb = leaf(rnd(group, T, Cn))
    per_sample = lambda: F.silu(F.conv1d(xcb.transpose(1, 2), w.unsqueeze(1), bias, padding=W - 1, groups=Cn)
                                [..., :T]).transpose(1, 2).contiguous()
    flat_ms = _time(_fwd_bwd(per_sample, [xcb, w, bias]), reps, device, clock)
    conv = {"tree_ms": tree_ms, "per_sample_ms": flat_ms, "per_sample_one_by_one_ms": None,
            "speedup": flat_ms / tree_ms}

    for r in (ssd, conv):
        r["token_ratio"] = token_ratio
        r["speedup_over_ratio"] = r["speedup"] / token_ratio
        r["goal_met"] = r["speedup"] >= 0.8 * token_ratio
    config = dict(prompt=prompt, completion=completion, group=group, H=H, P=P, G=G, S=S, W=W, dtype=str(dtype),
                  device=device, threads=torch.get_num_threads(), clock=clock, reps=reps, tree_rows=N, flat_rows=group * T)
    return {"ssd": ssd, "conv": conv, "config": config}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default=None)
    args = ap.parse_args()
    res = run(args.quick, device=args.device, reps=args.reps, threads=args.threads, clock=args.clock)
    c = res["config"]
    print(f"GRPO family: prompt {c['prompt']} + {c['group']} x {c['completion']}  (tree rows {c['tree_rows']}, "
          f"flat rows {c['flat_rows']}); H={c['H']} P={c['P']} G={c['G']} S={c['S']} W={c['W']} {c['dtype']} "
          f"{c['device']} threads={c['threads']}; fwd+bwd, best of {c['reps']} ({c['clock']} clock)")
    print(f"{'op':<6}{'tree ms':>9}{'per-sample ms':>15}{'one-by-one ms':>15}{'speedup':>9}{'token ratio':>13}"
          f"{'speedup/ratio':>15}  goal>=0.8")
    for op in ("ssd", "conv"):
        r = res[op]
        one = r["per_sample_one_by_one_ms"]
        print(f"{op:<6}{r['tree_ms']:>9.1f}{r['per_sample_ms']:>15.1f}{'-' if one is None else f'{one:.1f}':>15}"
              f"{r['speedup']:>9.2f}{r['token_ratio']:>13.2f}{r['speedup_over_ratio']:>15.2f}  "
              f"{'yes' if r['goal_met'] else 'NO'}")
    print("speedup = best per-sample time / tree time")


if __name__ == "__main__":
    main()
