"""Data pipeline benchmark: per-step packing+sharding time (every DP rank pays it), balance, and how
much of it a lookahead thread hides behind a simulated training step.

    .venv/bin/python tools/bench_pipeline.py
"""
import time

import numpy as np

from megatron_tree.data.pipeline import TreeDataPipeline
from megatron_tree.data.synthetic import make_preset
from megatron_tree.tree import Sample


def grpo(seed, families=32, per=16, prompt=2048, completion=512, jitter=64, vocab=32000):
    rng = np.random.default_rng(seed)
    out = []
    for g in range(families):
        p = rng.integers(1, vocab, prompt)
        adv = rng.normal(size=per)
        for j in range(per):
            toks = np.concatenate([p, rng.integers(1, vocab, completion + int(rng.integers(-jitter, jitter + 1)))])
            mask = np.zeros(len(toks), bool)
            mask[prompt:] = True
            out.append(Sample(tokens=toks, loss_mask=mask, advantage=float(adv[j]), group=g))
    return out


def run(name, samples, budget, gbs, dp, train_s, lookahead):
    p = TreeDataPipeline(samples, max_tokens_per_mb=budget, global_batch_samples=gbs, dp_size=dp, seed=0,
                         lookahead=lookahead)
    t0 = time.perf_counter()
    bal, ratio, waits = [], [], []
    for st in p:
        waits.append(st.wait_s)
        bal.append(st.balance_ratio)
        ratio.append(st.tree_token_ratio)
        time.sleep(train_s)
    wall = time.perf_counter() - t0
    t = p.timing
    flat = sum(len(s) for s in samples)
    print(f"{name:28s} dp={dp} la={lookahead} steps={t.steps:3d} pack/step={1e3 * t.pack_s / t.steps:7.1f} ms "
          f"({flat / t.pack_s / 1e6:5.2f} M flat tok/s) wait/step={1e3 * t.wait_s / t.steps:7.1f} ms "
          f"(after step 0: {1e3 * np.mean(waits[1:]):5.1f} ms) hidden={t.hidden_fraction:5.2f} wall={wall:5.2f}s balance(max/mean)={np.mean(bal):.3f} "
          f"tree_ratio={np.mean(ratio):.2f}")


data = grpo(0)  # 512 samples, 32 families x 16 x (2048 + 512±64) = 1.31 M flat tokens
run("grpo 32x16x(2048+512)", data, 16384, 64, 8, 0.0, 0)
run("grpo 32x16x(2048+512)", data, 16384, 64, 8, 0.25, 0)
run("grpo 32x16x(2048+512)", data, 16384, 64, 8, 0.25, 2)
small = make_preset("many_small_64_4x16")
run("many_small_64_4x16", small, 4096, 64, 4, 0.0, 0)
agent = make_preset("agent_multiturn")
run("agent_multiturn", agent, 4096, 8, 4, 0.0, 0)
