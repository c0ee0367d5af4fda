"""GPU backends vs flat kernels on one GRPO family (for a session that is lent a GPU).

    python tools/bench_gpu.py                     # CUDA: auto backends (flex / fla / mamba), bf16
    python tools/bench_gpu.py --device cpu --quick --dtype float32   # dry run of the script on CPU

For each op, forward+backward on one family (prompt P + C completions x L), same run:
  attention  tree_attention(backend) vs per-sample SDPA (is_causal) over the C samples batched
  gdn        tree_gated_delta_rule(backend) vs the same backend over the C samples as root chains
  ssd        tree_ssd(backend) vs the same backend over the C samples as root chains
and the max error of the chosen backend against the torch backend on the tree (float32 reference).
Times are CUDA-event medians over --repeats after a warm-up (compilation excluded).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from megatron_tree.ops import tree_attention, tree_gated_delta_rule, tree_ssd
from megatron_tree.tree.layout import TreeLayout


def _timer(device):
    if device.type == "cuda":
        def run(fn, repeats):
            fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(repeats):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            return statistics.median(times)
    else:
        def run(fn, repeats):
            fn()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--backend", default="auto", help="auto, torch, or a named GPU backend for all ops")
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--completions", type=int, default=16)
    ap.add_argument("--completion-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="small sizes (a CPU dry run)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; run with --device cpu --quick for a dry run")
        return
    if args.quick:
        args.prompt, args.completions, args.completion_len, args.repeats = 256, 4, 64, 2
    dt = getattr(torch, args.dtype)
    P, C, L = args.prompt, args.completions, args.completion_len
    tree = TreeLayout.from_segments([P] + [L] * C, [-1] + [0] * C).to(dev)
    chains = TreeLayout.from_segments([P + L] * C, [-1] * C).to(dev)
    rows = [torch.cat([torch.arange(P), torch.arange(P + i * L, P + (i + 1) * L)]).to(dev) for i in range(C)]
    flat_rows = torch.cat(rows)
    timer = _timer(dev)
    ideal_tokens = (C * (P + L)) / (P + C * L)
    out = {"shape": f"prompt {P} + {C} x {L}", "dtype": args.dtype, "device": str(dev), "token_ratio": ideal_tokens}
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dt).requires_grad_()

    # attention: 16 heads of 128 (GQA 4 kv heads)
    Hq, Hk, D = 16, 4, 128
    q, k, v = rnd(tree.num_rows, Hq, D), rnd(tree.num_rows, Hk, D), rnd(tree.num_rows, Hk, D)

    def att_tree():
        tree_attention(q, k, v, tree, backend=args.backend).float().sum().backward()

    qf, kf, vf = (x.detach()[flat_rows].view(C, P + L, -1, D).transpose(1, 2).contiguous().requires_grad_()
                  for x in (q, k, v))

    def att_flat():
        F.scaled_dot_product_attention(qf, kf.repeat_interleave(Hq // Hk, 1), vf.repeat_interleave(Hq // Hk, 1),
                                       is_causal=True).float().sum().backward()

    ref = tree_attention(q.detach().float(), k.detach().float(), v.detach().float(), tree, backend="torch")
    err = (tree_attention(q.detach(), k.detach(), v.detach(), tree, backend=args.backend).float() - ref).abs().max()
    pairs_flat = C * (P + L) * (P + L + 1) / 2
    pairs_tree = tree.visible_pairs()
    t_t, t_f = timer(att_tree, args.repeats), timer(att_flat, args.repeats)
    out["attention"] = {"tree_s": t_t, "flat_sdpa_s": t_f, "speedup": t_f / t_t, "ideal_pairs": pairs_flat / pairs_tree,
                        "max_err_vs_torch": float(err)}

    # gated delta rule: 8 heads, K = V = 128
    H, K = 8, 128
    qg = F.normalize(torch.randn(tree.num_rows, H, K, generator=g), dim=-1).to(dev, dt).requires_grad_()
    kg = F.normalize(torch.randn(tree.num_rows, H, K, generator=g), dim=-1).to(dev, dt).requires_grad_()
    vg = rnd(tree.num_rows, H, K)
    gg = (-torch.rand(tree.num_rows, H, generator=g)).to(dev, torch.float32).requires_grad_()
    bg = torch.rand(tree.num_rows, H, generator=g).to(dev, dt).requires_grad_()
    gdn_in = (qg, kg, vg, gg, bg)

    def gdn_tree():
        tree_gated_delta_rule(*gdn_in, tree, backend=args.backend).float().sum().backward()

    gdn_flat_in = [x.detach()[flat_rows].requires_grad_() for x in gdn_in]

    def gdn_flat():
        tree_gated_delta_rule(*gdn_flat_in, chains, backend=args.backend).float().sum().backward()

    ref = tree_gated_delta_rule(*[x.detach().float() for x in gdn_in], tree, backend="torch")
    err = (tree_gated_delta_rule(*[x.detach() for x in gdn_in], tree, backend=args.backend).float() - ref).abs().max()
    t_t, t_f = timer(gdn_tree, args.repeats), timer(gdn_flat, args.repeats)
    out["gated_delta_rule"] = {"tree_s": t_t, "flat_s": t_f, "speedup": t_f / t_t, "max_err_vs_torch": float(err)}

    # SSD: 32 heads of 64, 1 group, state 128
    Hs, Pd, G, S = 32, 64, 1, 128
    x = rnd(tree.num_rows, Hs, Pd)
    dtv = (torch.rand(tree.num_rows, Hs, generator=g) * 0.1 + 0.01).to(dev, torch.float32).requires_grad_()
    A = (-torch.rand(Hs, generator=g) - 0.5).to(dev, torch.float32).requires_grad_()
    B, Cm = rnd(tree.num_rows, G, S, scale=0.3), rnd(tree.num_rows, G, S, scale=0.3)
    ssd_in = (x, dtv, A, B, Cm)

    def ssd_tree():
        tree_ssd(*ssd_in, tree, backend=args.backend).float().sum().backward()

    ssd_flat_in = [t.detach()[flat_rows].requires_grad_() if t.dim() > 1 else t for t in ssd_in]

    def ssd_flat():
        tree_ssd(*ssd_flat_in, chains, backend=args.backend).float().sum().backward()

    ref = tree_ssd(*[t.detach().float() for t in ssd_in], tree, backend="torch")
    err = (tree_ssd(*[t.detach() for t in ssd_in], tree, backend=args.backend).float() - ref).abs().max()
    t_t, t_f = timer(ssd_tree, args.repeats), timer(ssd_flat, args.repeats)
    out["ssd"] = {"tree_s": t_t, "flat_s": t_f, "speedup": t_f / t_t, "max_err_vs_torch": float(err)}

    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
