"""Carry vs split packing vs the unlimited budget: rows computed per step, microbatches, carried rows.

    python tools/bench_carry.py            # GRPO (4 x 8,192-token prompt + 16 x ~2K) and agent_multiturn

Workloads: the issue's GRPO batch (4 groups, an 8,192-token prompt and 16 completions of 2,048 +- 256
tokens) and the ``agent_multiturn`` preset; budgets 8K / 16K / 32K. One run, side by side; the
planning time is the host time of ``pack(..., carry=True)``.
"""
from __future__ import annotations

import time

import numpy as np

from megatron_tree.data.synthetic import make_preset
from megatron_tree.tree import pack, summarize
from megatron_tree.tree.carry import carry_summary


def grpo(seed: int = 0, groups: int = 4, prompt: int = 8192, completions: int = 16, vocab: int = 32000):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(groups):
        p = rng.integers(1, vocab, prompt)
        for _ in range(completions):
            n = int(np.clip(rng.normal(2048, 256), 1024, 3072))
            out.append(np.concatenate([p, rng.integers(1, vocab, n)]))
    return out


def main() -> None:
    for name, samples in (("grpo 4x(8192 + 16x~2K)", grpo()), ("agent_multiturn", make_preset("agent_multiturn"))):
        flat = sum(len(s.tokens) if hasattr(s, "tokens") else len(s) for s in samples)
        unlimited = summarize(pack(samples, 1 << 62))["tree_tokens"]
        print(f"\n{name}: {len(samples)} samples, {flat:,} flat tokens, unlimited budget {unlimited:,} rows "
              f"({flat / unlimited:.2f}x)")
        print(f"{'budget':>7} | {'split rows':>10} {'x':>5} {'mbs':>4} | {'carry rows':>10} {'x':>5} {'mbs':>4} "
              f"{'carried':>8} {'stored':>7} {'plan s':>6}")
        for budget in (8192, 16384, 32768):
            longest = max(len(s.tokens) if hasattr(s, "tokens") else len(s) for s in samples)
            sp = summarize(pack(samples, budget)) if longest <= budget else None
            t0 = time.perf_counter()
            mbs = pack(samples, budget, carry=True)
            dt = time.perf_counter() - t0
            c = carry_summary(mbs)
            real = c["rows_computed"] - sum(mb.stats.padding_tokens for mb in mbs)
            split = ("refused" if sp is None else f"{sp['tree_tokens']:>10,} {flat / sp['tree_tokens']:>5.2f} "
                     f"{sp['num_microbatches']:>4}")
            print(f"{budget:>7} | {split:>21} | {real:>10,} {flat / real:>5.2f} {len(mbs):>4} "
                  f"{c['carried_rows']:>8,} {c['stored_rows']:>7,} {dt:>6.2f}")


if __name__ == "__main__":
    main()
