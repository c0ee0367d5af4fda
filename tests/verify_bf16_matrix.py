"""The bf16 accuracy matrix of `megatron-tree verify --dtype bfloat16` (issue 17, item 3).

Every `--model` at tree CP 1, 2 and 4, GDN models with each GDN CP mode (qwen3next: CP 1 only, stock
TransformerConfig rejects CP with its GDN attention variant; GDN under CP is covered by hybrid); one
set of rank processes per world size (the same `run_verify_many` the tests use). Prints, per run and
metric, the tree side's and the flat-packed bf16 baseline's error against per-sample float64
training and their ratio (``!``: past the bound), and the single parameter nearest its own bound
(reported, not judged).

    .venv/bin/python tests/verify_bf16_matrix.py [--cp 1 2 4] [--models gpt hybrid ...]

Each row equals one CLI run, e.g. ``MEGATRON_TREE_GDN_CP_MODE=heads megatron-tree verify --dtype
bfloat16 --model hybrid --cp 2``.
"""
from __future__ import annotations

import argparse
import sys
import time

from megatron_tree.training.verify import VerifyConfig, metrics_of, metric_passes, run_verify_many

MODELS = ("gpt", "hybrid", "mamba", "qwen3next", "mla", "dsa")
GDN_MODELS = ("hybrid", "qwen3next")
# stock TransformerConfig rejects CP with the experimental gated_delta_net attention variant (qwen3next);
# GDN under tree CP runs in the hybrid stack
NO_CP = ("qwen3next",)


def configs(cp: int, models=MODELS) -> list:
    out = []
    for m in models:
        if cp > 1 and m in NO_CP:
            continue
        modes = ("summary", "heads") if cp > 1 and m in GDN_MODELS else (None,)
        out += [VerifyConfig(model=m, cp=cp, dtype="bfloat16", gdn_cp_mode=g) for g in modes]
    return out


def row(cfg, out) -> str:
    name = f"{cfg.model}{'/' + cfg.gdn_cp_mode if cfg.gdn_cp_mode else ''}"
    cells = []
    for m in metrics_of(cfg):
        ps = out[f"{m}_ps"]
        ratio = out[m] / ps if ps > 0 else float("inf") if out[m] > 0 else 1.0
        cells.append(f"{m} {out[m]:.2e}/{ps:.2e}={ratio:.2f}{'' if metric_passes(cfg, out, m) else '!'}")
    if "param_grad" in out:  # reported, not judged
        cells.append(f"(one param {out['param_grad'] / out['param_grad_ps']:.2f}: {out['param_grad_at']})")
    return f"| {name:<18} | {cfg.cp} | {'PASS' if out['passed'] else 'FAIL'} | " + " | ".join(cells)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    a = p.parse_args(argv)
    ok = True
    for cp in a.cp:
        cfgs = configs(cp, a.models)
        t0 = time.time()
        outs = run_verify_many(cfgs, timeout=3000)
        print(f"# cp={cp}: {len(cfgs)} runs in {time.time() - t0:.0f} s  (metric tree/per-sample=ratio; ! fails)")
        for c, o in zip(cfgs, outs):
            print(row(c, o), flush=True)
            ok &= o["passed"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
