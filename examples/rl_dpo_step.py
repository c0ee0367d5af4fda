"""A DPO step on prefix trees with `megatron_tree.rl`: each prompt computed once for all its completions.

A preference dataset (TRL's ``DPOTrainer`` layout: ``prompt``, ``chosen``, ``rejected``) is, per pair, one prompt
and two completions. Per-sample training runs every prompt twice per pair (TRL concatenates chosen and rejected
into one batch of ``2 x pairs`` padded sequences); when several pairs share a prompt (on-policy DPO samples k
completions per prompt and ranks them), it runs the prompt ``2 x pairs`` times. On a tree the prompt is one
path and the completions are its leaves: the step computes each prompt row once.

The reference log-probs are the initial policy's (a forward-only pass before the first step, as TRL precomputes
them); ``forward_backward(loss="dpo")`` then runs a forward-only pass for every completion's summed log-prob and
the graded pass (`megatron_tree.rl.objectives`: exact however carry, CP or DP cut a pair).

Run on CPU (a tiny GPT, 2 DP ranks on gloo, two prompts of 4096 tokens with 2 pairs each, three DPO steps):

    .venv/bin/python examples/rl_dpo_step.py
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_tree.rl import RolloutBatch, build_microbatches, forward_backward  # noqa: E402


def preference_batch(prompts: list, pairs: list, ref_logprobs=None) -> RolloutBatch:
    """``prompts`` [token lists]; ``pairs`` [(prompt index, chosen completion, rejected completion)]: one rollout
    per completion (prompt + completion, the completion's tokens the targets), pair ids and chosen flags."""
    tokens, masks, pair_ids, chosen = [], [], [], []
    for p, (i, good, bad) in enumerate(pairs):
        for completion, is_chosen in ((good, True), (bad, False)):
            tokens.append(list(prompts[i]) + list(completion))
            masks.append([False] * len(prompts[i]) + [True] * len(completion))
            pair_ids.append(p)
            chosen.append(is_chosen)
    return RolloutBatch.from_lists(tokens, loss_mask=masks, ref_logprobs=ref_logprobs, pair_ids=pair_ids,
                                   chosen=chosen)


def dpo_step(model, optimizer, prompts, pairs, ref_logprobs, *, budget: int, beta: float, dp_rank: int,
             dp_size: int) -> dict:
    """One optimizer step of DPO; returns the loss, the rows the step computed and the tokens per-sample
    training would run (over every DP rank)."""
    mbs = build_microbatches(preference_batch(prompts, pairs, ref_logprobs), budget, dp_rank=dp_rank,
                             dp_size=dp_size)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    out = forward_backward(model, mbs, loss="dpo", beta=beta)
    ok, grad_norm, _ = optimizer.step()
    return dict(step_figures(out, mbs), grad_norm=float(grad_norm))


def step_figures(out, mbs) -> dict:
    """The step's loss (the reports' ``lm loss``: a sum and a target count per rank), the rows it computed and the
    tokens per-sample training runs, summed over the DP ranks."""
    import torch.distributed as dist

    lm = sum(r["lm loss"] for r in out.reports)
    tot = torch.tensor([float(lm[0]), float(lm[1]), sum(mb.stats.tree_tokens for mb in mbs.microbatches),
                        sum(mb.stats.flat_tokens for mb in mbs.microbatches)], dtype=torch.float64)
    dist.all_reduce(tot)
    return {"loss": float(tot[0] / tot[1]), "tree_rows": int(tot[2]), "flat_tokens": int(tot[3])}


def step_line(step: int, loss: str, m: dict) -> str:
    """One step's log line: the loss as ``loss`` says it, the grad norm, the rows computed against per-sample tokens."""
    return (f"step {step + 1}: {loss}, grad_norm {m['grad_norm']:.4f}; rows computed {m['tree_rows']} where "
            f"per-sample training runs {m['flat_tokens']} tokens ({m['flat_tokens'] / m['tree_rows']:.2f}x)")


def synthetic_preferences(prompt_len: int, n_prompts: int = 2, pairs_per_prompt: int = 2, vocab: int = 128,
                          seed: int = 0):
    """Prompts of ``prompt_len`` tokens, each with ``pairs_per_prompt`` (chosen, rejected) completions of 16..48."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, vocab, prompt_len).tolist() for _ in range(n_prompts)]
    pairs = [(i, rng.integers(1, vocab, int(rng.integers(16, 49))).tolist(),
              rng.integers(1, vocab, int(rng.integers(16, 49))).tolist())
             for i in range(n_prompts) for _ in range(pairs_per_prompt)]
    return prompts, pairs


def tiny_model(budget: int, *, value_head: bool = False, lr: float = 1e-3):
    """(DDP model, optimizer, DP rank, DP size) on this rank: a tiny GPT on CPU (gloo) under Megatron-Core, with a
    scalar head for a reward / value model (`megatron_tree.megatron.value_head`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tree import cpu
    from megatron_tree.megatron.value_head import add_value_head
    from megatron_tree.training.models import ModelArgs, build_model, make_config, wrap_ddp

    cpu.enable(kernels=True)
    torch._dynamo.config.disable = True
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    margs = ModelArgs(num_layers=2, hidden_size=64, vocab_size=128, max_position=budget)
    config = make_config(margs)
    model = build_model(config, margs)
    if value_head:  # before DDP wraps it; a reward model's has no bias (Bradley-Terry sees differences of rewards)
        add_value_head(model, bias=False)
    model = wrap_ddp(model, config)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr), [model])
    return model, opt, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def demo_rank(prompt_len: int = 4096, steps: int = 3) -> list:
    import torch.distributed as dist

    budget = -(-(prompt_len + 2 * 2 * 48) // 8) * 8  # one prompt with all its completions per microbatch
    model, opt, dp_rank, dp_size = tiny_model(budget)
    prompts, pairs = synthetic_preferences(prompt_len)
    # the reference: the initial policy's log-probs of every completion, forward only (each DP rank fills its own
    # rollouts; summed over DP, every rank has them all)
    batch = preference_batch(prompts, pairs)
    ref = forward_backward(model, build_microbatches(batch, budget, dp_rank=dp_rank, dp_size=dp_size),
                           forward_only=True).per_rollout("logprobs")
    ref_full = []
    for s, lp in zip(batch.samples, ref):
        row = np.zeros(len(s))
        if lp is not None:
            row[np.flatnonzero(s.target_mask())] = lp
        ref_full.append(row)
    flat = torch.as_tensor(np.concatenate(ref_full))
    dist.all_reduce(flat)
    ref_full = np.split(flat.numpy(), np.cumsum([len(s) for s in batch.samples])[:-1])
    lines = []
    for step in range(steps):
        m = dpo_step(model, opt, prompts, pairs, ref_full, budget=budget, beta=0.1, dp_rank=dp_rank, dp_size=dp_size)
        lines.append(step_line(step, f"DPO loss {m['loss']:.5f} (mean over {len(pairs)} pairs)", m))
    return lines


if __name__ == "__main__":
    from megatron_tree.training.launch import run_distributed

    print("\n".join(run_distributed(demo_rank, 2, timeout=900)[0]))
