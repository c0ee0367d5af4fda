"""What the sequence-level objectives cost: `rl.forward_backward` step time per loss, one run, side by side.

    python tools/bench_objectives.py [--groups 2] [--prompt 512] [--completions 8] [--budget 2048] [--repeats 5]

A GRPO-shaped batch (``groups`` prompts of ``prompt`` tokens, ``completions`` completions each of ~128
tokens) and, for the preference losses, the same completions paired two by two within their group. A small
GPT (float32, 4 layers, hidden 256) on this host's CPU, one gloo rank. Reported: the median step time of
``grpo`` (token-level: one forward + backward), of ``grpo`` with ``loss_agg="seq-mean-token-mean"`` (a
per-rollout weight, no extra pass), ``gspo`` and ``dpo`` (a forward-only stats pass, then forward +
backward), and their ratio to ``grpo``. The stats pass is a forward without backward: about a third of a
step's FLOPs, plus the schedule's fixed costs.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def _batch(groups: int, prompt: int, completions: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    toks, masks = [], []
    for _ in range(groups):
        p = rng.integers(1, vocab, prompt).tolist()
        for _ in range(completions):
            c = rng.integers(1, vocab, int(np.clip(rng.normal(128, 16), 64, 192))).tolist()
            toks.append(p + c)
            masks.append([False] * prompt + [True] * len(c))
    n = len(toks)
    adv = rng.normal(size=n)
    old = [rng.normal(-np.log(vocab), 0.1, len(t)) for t in toks]
    ref = [rng.normal(-np.log(vocab), 0.1, len(t)) for t in toks]
    pair_ids = np.arange(n) // 2  # consecutive completions of a group pair up (completions is even)
    chosen = np.arange(n) % 2 == 0
    return toks, masks, adv, old, ref, pair_ids, chosen


def _body(args) -> list:
    from megatron_tree import rl
    from megatron_tree.megatron.model import TreeGPTModel
    from megatron_tree.megatron.specs import get_tree_gpt_decoder_block_spec
    from megatron_tree.training.megatron_init import init_megatron
    from megatron_tree.training.models import ModelArgs, make_config, wrap_ddp

    init_megatron(tp=1)
    vocab = 1024
    cfg = make_config(ModelArgs(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4,
                                ffn_hidden_size=768, vocab_size=vocab), dtype=torch.float32)
    model = TreeGPTModel(cfg, get_tree_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                                              normalization="RMSNorm"),
                         vocab_size=vocab, max_sequence_length=8192, position_embedding_type="rope")
    ddp = wrap_ddp(model, cfg)
    toks, masks, adv, old, ref, pair_ids, chosen = _batch(args.groups, args.prompt, args.completions, vocab)
    batch = rl.RolloutBatch.from_lists(toks, loss_mask=masks, advantages=adv, old_logprobs=old, ref_logprobs=ref,
                                       pair_ids=pair_ids, chosen=chosen)
    mbs = rl.build_microbatches(batch, args.budget)
    cases = [("grpo", dict(loss="grpo")), ("grpo seq-mean-token-mean", dict(loss="grpo", loss_agg="seq-mean-token-mean")),
             ("gspo", dict(loss="gspo", clip_eps=3e-4, clip_eps_high=4e-4, loss_agg="seq-mean-token-mean")),
             ("dpo", dict(loss="dpo", beta=0.1))]
    times = {name: [] for name, _ in cases}
    for r in range(args.repeats + 1):  # round robin, so drifts of the host hit every loss alike; round 0 warms up
        for name, kw in cases:
            ddp.zero_grad_buffer()
            t0 = time.perf_counter()
            rl.forward_backward(ddp, mbs, **kw)
            if r:
                times[name].append(time.perf_counter() - t0)
    out = [(name, statistics.median(times[name])) for name, _ in cases]
    rows = sum(mb.num_rows for mb in mbs.microbatches)
    return [(len(toks), len(mbs), rows)] + out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--completions", type=int, default=8)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.completions % 2:
        ap.error("--completions must be even (the preference losses pair completions two by two)")
    from megatron_tree.training.launch import run_distributed

    (rollouts, microbatches, rows), *times = run_distributed(_body, 1, args, timeout=1800)[0]
    print(f"{rollouts} rollouts, {microbatches} tree microbatches, {rows} rows; CPU, {torch.get_num_threads()} threads")
    base = times[0][1]
    print(f"{'loss':<28} {'step s':>8} {'x grpo':>7}")
    for name, t in times:
        print(f"{name:<28} {t:>8.3f} {t / base:>7.2f}")


if __name__ == "__main__":
    main()
