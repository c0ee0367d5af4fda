"""Routing replay figures (issue 18): rows of token-only vs route-aware sharing, and the step-time cost
of replay on CPU.

1. Rows. GRPO-shaped batch: ``--groups`` prompts x ``--per`` rollouts (prompt ``--prompt`` tokens,
   completions ``--completion`` tokens), every token routed in ``--moe-layers`` MoE layers top-``--topk``
   of ``--experts``. Each group's prompt has one routing, except that ``d`` rollouts per group were
   prefilled elsewhere: they disagree with it at ``--positions`` random prompt positions (the
   first disagreement forks the trie). For each ``d``: flat rows, token-only trie rows, route-aware
   trie rows, the forks routes caused, and the packing time of `pack(..., route_aware=True)` vs
   token-only `pack`.
2. Step time. A small GPT MoE model on one CPU rank (float32): forward + backward over the same
   microbatches with and without replay. ``agree``: routes that agree wherever tokens agree (the
   layouts are the same, only the replay differs); ``forked``: the batch of part 1 with ``d`` = 2
   (the replay and the rows its forks add).

    .venv/bin/python tools/bench_routes.py [--skip-step] [--repeats 5]
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def grpo_batch(seed, groups, per, prompt, completion, moe_layers, topk, experts, disagree, positions, vocab=32000):
    from megatron_tree.tree import Sample

    rng = np.random.default_rng(seed)

    def route(n):
        return np.argsort(rng.random((n, moe_layers, experts)), axis=2)[:, :, :topk].astype(np.int32)

    out = []
    for _ in range(groups):
        p, pr = rng.integers(0, vocab, prompt), route(prompt)
        for j in range(per):
            n = completion + int(rng.integers(-completion // 8, completion // 8 + 1))
            r = np.concatenate([pr, route(n)])
            if j < disagree:  # prefilled in another batch: other experts at a few prompt positions
                at = rng.choice(prompt, positions, replace=False)
                r[at] = route(positions)
            out.append(Sample(tokens=np.concatenate([p, rng.integers(0, vocab, n)]), routed_experts=r))
    return out


def rows_figure(a) -> None:
    from megatron_tree.tree import pack
    from megatron_tree.tree.routes import route_sharing_cost

    print(f"rows: {a.groups} groups x {a.per} rollouts, prompt {a.prompt}, completion {a.completion}+-"
          f"{a.completion // 8}, routes [{a.moe_layers} MoE layers, top-{a.topk} of {a.experts}], "
          f"{a.positions} disagreeing prompt positions per rollout routed elsewhere; budget {a.budget}")
    print(f"{'routed elsewhere':>16} {'flat rows':>10} {'token-only':>11} {'route-aware':>12} {'forks':>6} "
          f"{'extra rows':>11} {'saved token-only':>17} {'saved route-aware':>18} {'pack s (tok/route)':>19}")
    for d in a.disagree:
        s = grpo_batch(0, a.groups, a.per, a.prompt, a.completion, a.moe_layers, a.topk, a.experts, d, a.positions)
        c = route_sharing_cost(s)
        t0 = time.perf_counter()
        mt = pack(s, a.budget)
        t1 = time.perf_counter()
        mr = pack(s, a.budget, route_aware=True)
        t2 = time.perf_counter()
        rt, rr = sum(m.stats.tree_tokens for m in mt), sum(m.stats.tree_tokens for m in mr)
        assert (rt, rr) == (c["token_rows"], c["route_rows"]) or a.budget < c["route_rows"]
        f = c["flat_rows"]
        print(f"{f'{d}/{a.per}':>16} {f:>10,} {rt:>11,} {rr:>12,} {c['route_forks']:>6} {rr - rt:>+11,} "
              f"{1 - rt / f:>16.1%} {1 - rr / f:>18.1%} {t1 - t0:>9.3f}/{t2 - t1:.3f}")


def _step_body(a):
    import torch

    from megatron_tree.training.megatron_init import init_megatron

    torch.set_num_threads(1)
    init_megatron(seed=0)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tree.megatron.routing_replay import install_routing_replay
    from megatron_tree.training.models import ModelArgs, build_model, forward_backward, make_config, wrap_ddp
    from megatron_tree.tree import pack

    samples = grpo_batch(1, a.step_groups, a.step_per, a.step_prompt, a.step_completion, a.step_layers, 2, 8, 2,
                         a.positions, vocab=512)
    table = np.argsort(np.random.default_rng(2).random((512, a.step_layers, 8)), axis=2)[:, :, :2]
    agree = [type(s)(tokens=s.tokens, routed_experts=table[s.tokens]) for s in samples]  # route = f(token)
    out = {}
    for name, batch, replay in (("no replay", samples, False), ("replay, agree", agree, True),
                                ("replay, forked", samples, True)):
        margs = ModelArgs(kind="gpt", num_layers=a.step_layers, hidden_size=64, num_attention_heads=4,
                          num_query_groups=2, ffn_hidden_size=128, vocab_size=512, num_experts=8,
                          moe_ffn_hidden_size=64, moe_router_topk=2)
        if replay:
            margs.extra["moe_enable_routing_replay"] = True
        config = make_config(margs, dtype=torch.float32)
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        model = build_model(config, margs)
        if replay:
            install_routing_replay(model)
        ddp = wrap_ddp(model, config)
        mbs = pack(batch, a.step_budget, pad_to_multiple_of=8, route_aware=replay)
        times = []
        for _ in range(a.repeats + 1):
            ddp.zero_grad_buffer()
            t0 = time.perf_counter()
            forward_backward(ddp, mbs)
            times.append(time.perf_counter() - t0)
        out[name] = (min(times[1:]), sum(m.stats.tree_tokens for m in mbs), len(mbs))
    return out


def step_figure(a) -> None:
    from megatron_tree.training.launch import run_distributed

    out = run_distributed(_step_body, 1, a, timeout=1800)[0]
    base = out["no replay"][0]
    print(f"\nstep time (CPU, 1 thread, float32 GPT {a.step_layers} MoE layers hidden 64, 8 experts top-2; "
          f"{a.step_groups} groups x {a.step_per} rollouts of {a.step_prompt}+{a.step_completion}; best of "
          f"{a.repeats}):")
    for name, (t, rows, n) in out.items():
        print(f"  {name:<16} {t * 1e3:8.1f} ms  ({rows:,} rows in {n} microbatches)  x{t / base:.3f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per", type=int, default=16)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--completion", type=int, default=256)
    p.add_argument("--moe-layers", type=int, default=8)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--positions", type=int, default=3)
    p.add_argument("--disagree", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16])
    p.add_argument("--budget", type=int, default=65536)
    p.add_argument("--skip-step", action="store_true")
    p.add_argument("--step-layers", type=int, default=2)
    p.add_argument("--step-groups", type=int, default=2)
    p.add_argument("--step-per", type=int, default=8)
    p.add_argument("--step-prompt", type=int, default=96)
    p.add_argument("--step-completion", type=int, default=32)
    p.add_argument("--step-budget", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    rows_figure(a)
    if not a.skip_step:
        step_figure(a)


if __name__ == "__main__":
    main()
