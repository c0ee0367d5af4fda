"""`megatron_tree.rl`: a framework-neutral rollout-batch API for an RL actor's Megatron step.

    from megatron_tree.rl import RolloutBatch, build_microbatches, forward_backward

    batch = RolloutBatch.from_padded(input_ids, attention_mask, loss_mask=response_mask,
                                     advantages=adv, old_logprobs=old_lp, ref_logprobs=ref_lp)
    mbs = build_microbatches(batch, max_tokens_per_mb=16384)          # this DP rank's tree microbatches
    out = forward_backward(model, mbs, loss="grpo", entropy_coef=0.001)  # Megatron's schedule
    old_log_probs = out.to_padded("logprobs")                          # [B, T], the caller's layout

`RolloutBatch` holds per-rollout token lists (or takes padded tensors + masks) with optional
advantages, old / reference log-probs and weights. `build_microbatches` packs them into prefix-tree
microbatches under a token budget (a rollout longer than the budget runs alone in a microbatch of
its own length: never dropped, never truncated) and, with ``dp_size > 1``, keeps this DP rank's
share of a global batch (balanced by predicted cost, the same count on every rank). `forward_backward`
runs Megatron-Core's ``get_forward_backward_func`` (any PP schedule; tree CP planned per microbatch;
``forward_only`` for old / reference log-probs) with our loss (``"sft"``, ``"grpo"``, ``"ppo"``) or
a user's ``loss_fn`` over per-occurrence tensors, and `RolloutOutputs` maps log-probs, entropies and
per-token losses back to the caller's per-rollout lists or padded layout. See
``examples/rl_actor_step.py`` for a verl / slime / NeMo-RL-style actor step using it.
"""
from .batch import (RankMicrobatches, RolloutBatch, RolloutOutputs, build_microbatches, forward_backward,
                    per_occurrence_loss)

__all__ = ["RolloutBatch", "RankMicrobatches", "RolloutOutputs", "build_microbatches", "forward_backward",
           "per_occurrence_loss"]
