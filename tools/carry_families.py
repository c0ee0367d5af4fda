"""Carry through the entry point users run, on every model family: ``megatron-tree train --nproc 2``
(DP2) with ``--tree-carry`` at a budget shorter than every sample (each path is cut and carried),
against the same run with every tree whole, and against split packing (no carry, each tree cut into
parts that recompute its prefix), step by step: the same samples and targets, the losses and grad norms.

    python tools/carry_families.py                       # every family, 3 steps
    python tools/carry_families.py --families dsa --steps 10

float32 on CPU, as a user's run. The exactness bar is verify's float64 comparison against per-sample
training (``megatron-tree verify --carry``); this checks the loop users run. DSA with a top-k below the
visible keys selects keys discontinuously: a float32 rounding difference between two microbatch
arrangements can flip a near-tied selection, and training then drifts apart (over 10 steps here, by
~1e-2 in the loss). Split packing, which has no carry, drifts likewise; ``dsa_dense`` (a top-k above
every path's length, so nothing is left to select) agrees as the other families do.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

FAMILIES = {
    "gpt": ["--num-layers", "2"],
    "hybrid": ["--hybrid-override-pattern", "MG*-"],
    "mamba": ["--model-family", "mamba", "--hybrid-override-pattern", "M*-E", "--num-experts", "2"],
    "qwen3next": ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2",
                  "--num-layers", "2"],
    "mla": ["--multi-latent-attention", "--num-layers", "2"],
    "dsa": ["--experimental-attention-variant", "dsa", "--dsa-indexer-topk", "3", "--num-layers", "2"],
    "dsa_dense": ["--experimental-attention-variant", "dsa", "--dsa-indexer-topk", "64", "--num-layers", "2"],
}
# the many_small_64_4x16 preset at 3/8 scale: trees of a 24-token prompt + 4 completions of 6 (48 rows),
# paths of 30 tokens
WORKLOAD = ["--synthetic-preset", "many_small_64_4x16", "--synthetic-scale", "0.375"]
PACKINGS = {"carry": ["--tree-carry", "--tree-max-tokens-per-mb", "16"], "split": ["--tree-max-tokens-per-mb", "32"],
            "whole": ["--tree-max-tokens-per-mb", "64"]}


def run(workdir: str, family: str, packing: str, steps: int) -> list:
    """One ``megatron-tree train`` run's metrics, step by step."""
    log = os.path.join(workdir, f"{family}_{packing}.jsonl")
    argv = [*WORKLOAD, "--vocab-size", "128", "--hidden-size", "32", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--ffn-hidden-size", "64", "--lr", "2e-2", "--lr-decay-style", "constant",
            "--weight-decay", "0", "--tree-global-batch-samples", "12", "--tree-pad-to-multiple-of", "8", "--quiet",
            "--seed", "7", "--train-iters", str(steps), "--nproc", "2", "--metrics-jsonl", log,
            *FAMILIES[family], *PACKINGS[packing]]
    p = subprocess.run([sys.executable, "-m", "megatron_tree", "train", *argv], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    if p.returncode:
        raise SystemExit(f"{family} {packing}: megatron-tree train exited {p.returncode}\n{p.stdout[-3000:]}"
                         f"{p.stderr[-3000:]}")
    with open(log) as f:
        return [json.loads(line) for line in f]


def rel(a: list, b: list, key: str) -> float:
    return max(abs(x[key] - y[key]) / abs(y[key]) for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        print("rows computed over the run (carry / split / whole); max relative difference to whole trees "
              "(loss, grad norm): carry | split; seconds (carry, whole)")
        for family in a.families:
            t, runs = {}, {}
            for packing in PACKINGS:
                t0 = time.perf_counter()
                runs[packing] = run(workdir, family, packing, a.steps)
                t[packing] = time.perf_counter() - t0
            whole = runs["whole"]
            for packing in ("carry", "split"):
                got = runs[packing]
                if len(got) != len(whole) or any(x["sample_ids"] != y["sample_ids"] or x["num_targets"] != y["num_targets"]
                                                 for x, y in zip(got, whole)):
                    raise SystemExit(f"{family} {packing}: not the same steps, samples or targets as whole trees")
            rows = lambda r: sum(m["tree_rows"] for m in r)  # noqa: E731
            print(f"{family:10} {rows(runs['carry']):6,} / {rows(runs['split']):6,} / {rows(whole):6,}   "
                  f"{rel(runs['carry'], whole, 'loss'):.1e}, {rel(runs['carry'], whole, 'grad_norm'):.1e} | "
                  f"{rel(runs['split'], whole, 'loss'):.1e}, {rel(runs['split'], whole, 'grad_norm'):.1e}    "
                  f"{t['carry']:.0f}, {t['whole']:.0f}", flush=True)


if __name__ == "__main__":
    main()
