"""Benchmark: tree gated delta rule vs per-sample runs of the same torch chunked function.

One GRPO family: a prompt shared by several completions. The tree runs the prompt once; the
per-sample baseline runs every (prompt + completion) sample, batched as [B,T,...], through
``chunk_gated_delta_rule_torch``. Both time forward + backward in float32 with the torch backend.
The goal is speedup >= 0.8 x token ratio (flat tokens / tree tokens).

    PYTHONPATH=. python tools/bench_ops_gdn.py [--quick]
"""
from __future__ import annotations

import argparse
import time

import torch

from megatron_tree.ops.gated_delta_rule import chunk_gated_delta_rule_torch, tree_gated_delta_rule
from megatron_tree.tree.layout import TreeLayout


def _inputs(lead, H, K, HV, V, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*lead, *s, generator=gen)
    q = r(H, K)
    k = torch.nn.functional.normalize(r(H, K), dim=-1)
    v = r(HV, V)
    g = torch.nn.functional.logsigmoid(r(HV) + 3.0)
    beta = torch.rand(*lead, HV, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _time(fns, repeats):
    """Best-of-``repeats`` seconds per function, runs interleaved so background load hits all alike.

    The minimum, not the median: on a shared CPU, contention only ever adds time.
    """
    for fn in fns:
        fn()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def run(quick: bool = False) -> dict:
    """Time tree vs per-sample forward+backward; returns the figures as a dict."""
    prompt, completion, n = (512, 64, 8) if quick else (2048, 256, 8)
    H = HV = 4
    K = V = 64
    repeats = 3 if quick else 5
    layout = TreeLayout.from_segments([prompt] + [completion] * n, [-1] + [0] * n)
    N = layout.num_rows
    T = prompt + completion

    xt = _inputs((N,), H, K, HV, V, seed=0)
    # The same values per sample: prompt rows, then that completion's rows.
    rows = torch.stack([torch.cat([torch.arange(prompt), prompt + i * completion + torch.arange(completion)])
                        for i in range(n)])  # [B,T]
    xf = [x.detach()[rows].requires_grad_() for x in xt]
    Gt = torch.randn(N, HV, V)
    Gf = Gt[rows]

    def tree_step():
        o = tree_gated_delta_rule(*xt, layout, backend="torch")
        torch.autograd.grad((o * Gt).sum(), xt)

    def flat_step():
        o, _ = chunk_gated_delta_rule_torch(*xf)
        torch.autograd.grad((o * Gf).sum(), xf)

    with torch.no_grad():  # sanity: the tree reproduces the per-sample outputs
        err = (tree_gated_delta_rule(*xt, layout, backend="torch")[rows] - chunk_gated_delta_rule_torch(*xf)[0])
        max_err = float(err.abs().max())

    t_tree, t_flat = _time([tree_step, flat_step], repeats)
    token_ratio = n * T / N
    speedup = t_flat / t_tree
    return {
        "shape": f"prompt {prompt} + {n} x {completion}, H=HV={H}, K=V={K}, float32, fwd+bwd",
        "tree_tokens": N,
        "flat_tokens": n * T,
        "token_ratio": token_ratio,
        "tree_ms": 1e3 * t_tree,
        "flat_ms": 1e3 * t_flat,
        "speedup": speedup,
        "speedup_over_ratio": speedup / token_ratio,
        "goal_met": speedup >= 0.8 * token_ratio,
        "max_abs_err_vs_flat": max_err,
        "threads": torch.get_num_threads(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 4x smaller family")
    res = run(quick=ap.parse_args().quick)
    print(res["shape"], f"(torch threads: {res['threads']})")
    print(f"{'':<14}{'tokens':>8}{'ms':>10}")
    print(f"{'tree':<14}{res['tree_tokens']:>8}{res['tree_ms']:>10.1f}")
    print(f"{'per-sample':<14}{res['flat_tokens']:>8}{res['flat_ms']:>10.1f}")
    print(f"speedup {res['speedup']:.2f}x vs token ratio {res['token_ratio']:.2f}x "
          f"({res['speedup_over_ratio']:.2f} of it; goal >= 0.80: {'met' if res['goal_met'] else 'NOT met'})")
    print(f"max |tree - per-sample| output: {res['max_abs_err_vs_flat']:.2e}")


if __name__ == "__main__":
    main()
