"""Packing benchmark (issue 2): 48 GRPO families of 16 x (2048 + 512±64) tokens at 65536 rows/mb.

Reports flat tokens/s of `pack` and, on the same input in the same run, of a bare per-token Python
dict trie insertion (the baseline a naive packer pays before it has even laid anything out); rows
packed vs the optimum (distinct prefixes) and microbatch count vs the lower bound, for the samples
in order and shuffled.

    .venv/bin/python tools/bench_pack.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from megatron_tree.tree import pack, summarize


def make_families(seed=0, families=48, per=16, prompt=2048, completion=512, jitter=64, vocab=32000):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(families):
        p = rng.integers(0, vocab, prompt)
        for _ in range(per):
            out.append(np.concatenate([p, rng.integers(0, vocab, completion + int(rng.integers(-jitter, jitter + 1)))]))
    return out


def dict_trie_insert(samples) -> int:
    """Bare per-token dict trie insertion; returns the number of nodes (= distinct prefixes)."""
    root: dict = {}
    nodes = 0
    for s in samples:
        node = root
        for t in s.tolist():
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                nodes += 1
            node = nxt
    return nodes


def best_of(fn, repeats):
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def run(repeats=3, budget=65536) -> dict:
    samples = make_families()
    flat = sum(len(s) for s in samples)
    t_trie, optimum = best_of(lambda: dict_trie_insert(samples), repeats)
    res = {"flat_tokens": flat, "optimum_rows": optimum, "dict_trie_s": t_trie,
           "dict_trie_tokens_per_s": flat / t_trie}
    rng = np.random.default_rng(1)
    for name, order in (("in_order", np.arange(len(samples))), ("shuffled", rng.permutation(len(samples)))):
        inp = [samples[i] for i in order]
        t, mbs = best_of(lambda: pack(inp, budget), repeats)
        tot = summarize(mbs)
        res[name] = {"pack_s": t, "tokens_per_s": flat / t, "speedup_vs_dict_trie": t_trie / t,
                     "rows": tot["tree_tokens"], "microbatches": tot["num_microbatches"],
                     "min_microbatches": -(-optimum // budget), "fill": tot["fill"]}
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    r = run(args.repeats)
    print(f"input: 48 families x 16 x (2048 + 512±64) tokens = {r['flat_tokens']:,} flat tokens, budget 65536")
    print(f"bare dict trie insertion: {r['dict_trie_s']:.3f} s ({r['dict_trie_tokens_per_s'] / 1e6:.2f} M tok/s), "
          f"distinct prefixes (optimum rows) = {r['optimum_rows']:,}")
    for name in ("in_order", "shuffled"):
        x = r[name]
        print(f"pack [{name:8s}]: {x['pack_s']:.3f} s ({x['tokens_per_s'] / 1e6:.2f} M tok/s, "
              f"{x['speedup_vs_dict_trie']:.1f}x the dict trie), rows {x['rows']:,} "
              f"({'optimal' if x['rows'] == r['optimum_rows'] else 'NOT optimal'}), microbatches "
              f"{x['microbatches']} (lower bound {x['min_microbatches']}), fill {x['fill']:.1%}")


if __name__ == "__main__":
    main()
