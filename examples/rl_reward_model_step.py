"""A reward-model step on prefix trees with `megatron_tree.rl`: groups of responses ranked per prompt, each prompt
computed once.

A reward model reads one scalar per response: the value head (`megatron_tree.megatron.value_head`) on the final
hidden state of its last row. Trained on ranked groups (K responses to one prompt with a rating each), Bradley-Terry
runs over every two responses of a group whose ratings differ. Per-sample training runs the prompt once per response
(K times per group, InstructGPT's K = 4..9); on a tree the prompt is one path, the responses its leaves, and the
step computes each prompt row once. `RolloutBatch.reward_positions` appends one leaf token per response as its only
target, so the occurrence reads the response's last row.

Run on CPU (a tiny GPT with a value head, 2 DP ranks on gloo, two prompts of 4096 tokens with 8 rated responses
each, three steps):

    .venv/bin/python examples/rl_reward_model_step.py
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_tree.rl import RolloutBatch, build_microbatches, forward_backward  # noqa: E402


def ranked_groups(prompt_len: int, n_prompts: int = 2, responses: int = 8, vocab: int = 128, seed: int = 0):
    """(tokens, group ids, ratings): per prompt of ``prompt_len`` tokens, ``responses`` responses of 16..48 tokens
    with distinct ratings."""
    rng = np.random.default_rng(seed)
    tokens, groups, ratings = [], [], []
    for g in range(n_prompts):
        prompt = rng.integers(1, vocab, prompt_len).tolist()
        for r in rng.permutation(responses):
            tokens.append(prompt + rng.integers(1, vocab, int(rng.integers(16, 49))).tolist())
            groups.append(g)
            ratings.append(float(r))
    return tokens, groups, ratings


def demo_rank(prompt_len: int = 4096, steps: int = 3) -> list:
    from rl_dpo_step import step_figures, step_line, tiny_model

    tokens, groups, ratings = ranked_groups(prompt_len)
    budget = -(-(prompt_len + 8 * 49) // 8) * 8  # one prompt with all its responses per microbatch
    model, opt, dp_rank, dp_size = tiny_model(budget, value_head=True, lr=1e-3)
    batch = RolloutBatch.from_lists(tokens, group_ids=groups, scores=ratings).reward_positions()
    mbs = build_microbatches(batch, budget, dp_rank=dp_rank, dp_size=dp_size)
    lines = []
    for step in range(steps):
        model.zero_grad_buffer()
        opt.zero_grad()
        out = forward_backward(model, mbs, loss="rm")
        _, grad_norm, _ = opt.step()
        m = dict(step_figures(out, mbs), grad_norm=float(grad_norm))
        lines.append(step_line(step, f"Bradley-Terry loss {m['loss']:.5f} (mean over the groups' pairs)", m))
    return lines


if __name__ == "__main__":
    from megatron_tree.training.launch import run_distributed

    print("\n".join(run_distributed(demo_rank, 2, timeout=900)[0]))
