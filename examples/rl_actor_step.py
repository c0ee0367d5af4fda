"""An RL actor's Megatron step on prefix trees with `megatron_tree.rl`.

verl's ``MegatronPPOActor`` (slime's and NeMo-RL's Megatron policy workers are built the same way)
holds a mini-batch as padded tensors: ``input_ids = cat(prompt, response)`` ``[B, P + R]`` (prompts
left-padded to P, responses right-padded to R), ``attention_mask``, and response-only ``[B, R]``
tensors ``response_mask``, ``advantages``, ``old_log_probs``, ``ref_log_prob``. Its packed path does,
per micro-batch:

    input_ids_rmpad, indices, cu_seqlens = unpad_input(input_ids, attention_mask)   # THD packing
    packed_seq_params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, ...)
    logits = model(input_ids_rmpad, position_ids_rmpad, None, packed_seq_params=packed_seq_params)
    log_probs = vocab_parallel_log_probs_from_logits(logits, labels_rmpad)        # [total_tokens]
    entropy = vocab_parallel_entropy(logits)                                      # [total_tokens, V] pass
    log_probs = pad_input(log_probs, indices, B, P + R)[:, -R - 1:-1]              # back to [B, R]
    pg_loss = compute_policy_loss(old_log_probs, log_probs, advantages, response_mask, ...)

inside a hand-written ``forward_step`` / ``loss_func`` pair for ``get_forward_backward_func``, with
micro-batches cut by a token budget (``use_dynamic_bsz``). Every rollout of a GRPO group runs its
prompt again. With trees the lines marked ``# tree:`` below replace all of that: the prompt (and
any longer shared prefix) runs once per microbatch, and the log-probs, entropies and per-token losses
come back in the same ``[B, R]`` layout. The optimizer step, DDP, grad clipping and the advantage
computation stay the framework's. (Note the alignment: our per-token tensors are ``[B, P + R]``
with column c holding token c *as a target*, so a response-only tensor is padded on the left by P
columns and read back with ``[:, P:]``; no ``-1`` shift.)

Run on CPU (a tiny GPT, 2 DP ranks on gloo, three GRPO steps on synthetic rollouts; ``--loss gspo`` for
GSPO's actor step, whose sequence ratios take one more forward-only pass):

    .venv/bin/python examples/rl_actor_step.py [--loss gspo]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_tree.rl import RolloutBatch, build_microbatches, forward_backward  # noqa: E402  # tree:

MAX_TOKENS_PER_MB = 128  # the actor's ppo_max_token_len_per_gpu; forward-only passes may use more


def _full(x, P):
    """A response-only ``[B, R]`` tensor in the ``[B, P + R]`` layout (zeros over the prompt columns)."""
    return torch.cat([torch.zeros(x.shape[0], P, dtype=x.dtype), x], dim=1)


def compute_log_prob(model, data: dict, *, dp_rank: int, dp_size: int) -> torch.Tensor:
    """Old-policy (or, with the reference model, reference) log-probs ``[B, R]``, forward only."""
    P = data["prompts"].shape[1]
    batch = RolloutBatch.from_padded(data["input_ids"], data["attention_mask"],  # tree:
                                     loss_mask=_full(data["response_mask"], P))  # tree:
    mbs = build_microbatches(batch, 2 * MAX_TOKENS_PER_MB, dp_rank=dp_rank, dp_size=dp_size)  # tree:
    out = forward_backward(model, mbs, forward_only=True)  # tree:
    return out.to_padded("logprobs")[:, P:]  # tree: (this DP rank's rollouts; others are 0)


def update_policy(model, optimizer, data: dict, *, dp_rank: int, dp_size: int, clip_ratio: float = 0.2,
                  kl_coef: float = 0.01, entropy_coeff: float = 0.001, loss: str = "grpo") -> dict:
    """One optimizer step of GRPO (clipped surrogate, k3 KL to the reference, entropy bonus), or with
    ``loss="gspo"`` of GSPO (one clipped ratio per rollout, exp of its mean log-ratio, from a forward-only pass
    first; the clip range as the paper's, 3e-4 / 4e-4, and its seq-mean-token-mean aggregation)."""
    gspo = dict(clip_eps=3e-4, clip_eps_high=4e-4, loss_agg="seq-mean-token-mean") if loss == "gspo" else {}
    P = data["prompts"].shape[1]
    batch = RolloutBatch.from_padded(  # tree:
        data["input_ids"], data["attention_mask"], loss_mask=_full(data["response_mask"], P),  # tree:
        advantages=_full(data["advantages"], P), old_logprobs=_full(data["old_log_probs"], P),  # tree:
        ref_logprobs=_full(data["ref_log_prob"], P))  # tree:
    mbs = build_microbatches(batch, MAX_TOKENS_PER_MB, dp_rank=dp_rank, dp_size=dp_size)  # tree:
    model.zero_grad_buffer()
    optimizer.zero_grad()
    out = forward_backward(model, mbs, loss=loss, **({"clip_eps": clip_ratio} | gspo), kl_coef=kl_coef,  # tree:
                           entropy_coef=entropy_coeff)  # tree:
    ok, grad_norm, _ = optimizer.step()
    lm = sum(r["lm loss"] for r in out.reports)  # [loss sum, targets] of this rank
    ent = sum(r["entropy"] for r in out.reports)
    return {"pg_loss": float(lm[0] / max(lm[1], 1)), "entropy": float(ent[0] / max(ent[1], 1)), "grad_norm": float(grad_norm),
            "tree_rows": sum(mb.stats.tree_tokens for mb in mbs.microbatches),
            "flat_tokens": sum(mb.stats.flat_tokens for mb in mbs.microbatches)}


# ------------------------------------------------------------------------- a runnable CPU demo of the two calls
def _synthetic_rollouts(seed: int, B: int = 16, P: int = 24, R: int = 12, vocab: int = 128) -> dict:
    """Two GRPO groups of 8 in verl's layout: left-padded prompts, right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.zeros(B, P, dtype=torch.long)
    pmask = torch.zeros(B, P, dtype=torch.bool)
    for grp in range(2):
        n = 16 + 4 * grp
        p = torch.randint(1, vocab, (n,), generator=g)
        prompts[grp * 8:(grp + 1) * 8, P - n:] = p
        pmask[grp * 8:(grp + 1) * 8, P - n:] = True
    lens = torch.randint(4, R + 1, (B,), generator=g)
    resp_mask = torch.arange(R)[None] < lens[:, None]
    responses = torch.randint(1, vocab, (B, R), generator=g) * resp_mask
    rewards = torch.randn(B, generator=g)
    adv = (rewards.view(2, 8) - rewards.view(2, 8).mean(1, keepdim=True)).view(B, 1) * resp_mask
    return dict(prompts=prompts, input_ids=torch.cat([prompts, responses], 1),
                attention_mask=torch.cat([pmask, resp_mask], 1), response_mask=resp_mask,
                advantages=adv.double(), ref_log_prob=torch.full((B, R), -4.8, dtype=torch.float64) * resp_mask)


def _demo_rank(loss: str = "grpo") -> list:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tree import cpu
    from megatron_tree.training.models import ModelArgs, build_model, make_config, wrap_ddp

    cpu.enable(kernels=True)
    torch._dynamo.config.disable = True
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    margs = ModelArgs(num_layers=2, hidden_size=64, vocab_size=128, max_position=2 * MAX_TOKENS_PER_MB)
    config = make_config(margs)
    model = wrap_ddp(build_model(config, margs), config)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [model])
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    lines = []
    for step in range(3):
        data = _synthetic_rollouts(step)
        old = compute_log_prob(model, data, dp_rank=dp_rank, dp_size=dp_size)
        dist.all_reduce(old)  # each DP rank filled its own rollouts' rows: the whole batch on every rank
        data["old_log_probs"] = old.double()
        m = update_policy(model, opt, data, dp_rank=dp_rank, dp_size=dp_size, loss=loss)
        lines.append(f"step {step + 1}: rank {dist.get_rank()} pg_loss {m['pg_loss']:+.4f} entropy {m['entropy']:.4f} "
                     f"grad_norm {m['grad_norm']:.4f} rows {m['tree_rows']} for {m['flat_tokens']} tokens")
    return lines


if __name__ == "__main__":
    from megatron_tree.training.launch import run_distributed

    loss = "gspo" if "--loss=gspo" in sys.argv or sys.argv[-2:] == ["--loss", "gspo"] else "grpo"
    for rank_lines in run_distributed(_demo_rank, 2, loss, timeout=600):
        print("\n".join(rank_lines))
