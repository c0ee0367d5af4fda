"""A GRPO actor step on multi-turn screenshot traces (a GUI agent) with `megatron_tree.rl`: every screenshot
encoded once per step, every shared row computed once.

A GUI or browsing agent's trace carries a screenshot at every turn: the task and the first screenshot, then
per turn the agent's action and the screenshot the environment returns. A GRPO group of K rollouts repeats the
task and its first screenshot K times, and rollouts that took the same actions so far saw the same screenshots.
Per-rollout training runs the vision encoder on every screenshot of every rollout and the language model on
every repeated row; on a tree each distinct (tokens, screenshots) prefix runs once, and its screenshot is
encoded once.

The rollout engine hands over, per rollout, its tokens with each image's placeholders expanded (as the
processor did) and its images as it processed them, ``(pixel_values, grid_thw)``:
``RolloutBatch.from_lists(tokens, ..., images=..., vision=VisionInput(image_token_id=..., merge=...))``.
The model is `megatron_tree.megatron.vision_language.TreeVisionLanguageModel`; here a tiny one on CPU
(`training.models` kind "vlm": a GPT with multimodal RoPE and a small patch encoder) where a Qwen-VL
checkpoint's tower and language model take its place.

Run on CPU (2 DP ranks on gloo, 2 groups of 8 rollouts with 3 turns each, three steps):

    .venv/bin/python examples/rl_vlm_grpo_step.py
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_tree.data.images import VisionInput  # noqa: E402
from megatron_tree.rl import RolloutBatch, build_microbatches, forward_backward  # noqa: E402

VOCAB = 128
IMG, VS, VE = VOCAB - 2, VOCAB - 3, VOCAB - 4  # image placeholder, vision start / end (the model's ids)
GRID, PATCH_DIM = (1, 4, 4), 24  # each screenshot: 4 x 4 patches of 24 values, merged 2 x 2: 4 tokens
BUDGET = 512


def screenshot(group: int, actions: tuple) -> tuple:
    """What the environment shows after ``actions`` in task ``group``: processed pixels and grid (deterministic)."""
    seed = hash((group, actions)) % (2 ** 32)
    return torch.from_numpy(np.random.default_rng(seed).normal(size=(16, PATCH_DIM))), GRID


def traces(groups: int = 2, turns: int = 3, seed: int = 0):
    """(tokens, loss masks, images, advantages): per group 2**turns rollouts, rollout r taking action bit t of r at
    turn t (so every action history occurs once and rollouts share prefixes up to their first different action),
    then a final answer of its own. Only the agent's tokens are targets. Advantages: rewards normalised per group."""
    rng = np.random.default_rng(seed)
    image = [VS] + [IMG] * (int(np.prod(GRID)) // 4) + [VE]
    tokens, masks, images, adv = [], [], [], []
    for g in range(groups):
        task = rng.integers(1, 100, 12).tolist()
        acts = {a: rng.integers(1, 100, 3).tolist() for a in (0, 1)}  # "click(x, y)" of each action
        rewards = rng.normal(size=2 ** turns)
        for r in range(2 ** turns):
            toks, mask, ims = task + image, [0] * (len(task) + len(image)), [screenshot(g, ())]
            for t in range(turns):
                a = (r >> t) & 1
                history = tuple((r >> k) & 1 for k in range(t + 1))
                toks += acts[a] + image
                mask += [1] * len(acts[a]) + [0] * len(image)
                ims.append(screenshot(g, history))
            answer = rng.integers(1, 100, int(rng.integers(2, 6))).tolist() + [VOCAB - 1]
            tokens.append(toks + answer)
            masks.append(mask + [1] * len(answer))
            images.append(ims)
            adv.append(float((rewards[r] - rewards.mean()) / (rewards.std() + 1e-6)))
    return tokens, masks, images, adv


def grpo_step(model, opt, data, *, dp_rank: int, dp_size: int, share_prefixes: bool = True,
              step_optimizer: bool = True) -> dict:
    """One GRPO step: old log-probs from a forward-only pass (this policy: ratio 1 on the first epoch), then the
    clipped surrogate's forward-backward and the optimizer step. Figures summed over DP ranks."""
    import torch.distributed as dist

    tokens, masks, images, adv = data
    vision = VisionInput(image_token_id=IMG, merge=2, processor=None)
    batch = RolloutBatch.from_lists(tokens, loss_mask=masks, advantages=adv, images=images, vision=vision)
    mbs = build_microbatches(batch, BUDGET, dp_rank=dp_rank, dp_size=dp_size, share_prefixes=share_prefixes)
    old = forward_backward(model, mbs, forward_only=True).per_rollout("logprobs")
    old_full = [np.zeros(len(t)) for t in tokens]
    for i, lp in enumerate(old):
        if lp is not None:
            old_full[i][np.flatnonzero(np.asarray(masks[i], bool))] = lp
    flat = torch.as_tensor(np.concatenate(old_full))
    dist.all_reduce(flat)  # each DP rank filled its own rollouts: the whole batch on every rank
    old_full = np.split(flat.numpy(), np.cumsum([len(t) for t in tokens])[:-1])
    batch = RolloutBatch.from_lists(tokens, loss_mask=masks, advantages=adv, old_logprobs=old_full, images=images,
                                    vision=vision)
    mbs = build_microbatches(batch, BUDGET, dp_rank=dp_rank, dp_size=dp_size, share_prefixes=share_prefixes)
    model.zero_grad_buffer()
    opt.zero_grad()
    out = forward_backward(model, mbs, loss="grpo", clip_eps=0.2)
    grad_norm = float(opt.step()[1]) if step_optimizer else float("nan")
    lm = sum(r["lm loss"] for r in out.reports)
    slots = [mb.image_slots for mb in mbs.microbatches if mb.image_slots is not None]
    tot = torch.tensor([float(lm[0]), float(lm[1]), sum(mb.stats.tree_tokens for mb in mbs.microbatches),
                        sum(mb.stats.flat_tokens for mb in mbs.microbatches), sum(s.num_images for s in slots),
                        sum(len(s.images) for i in mbs.rollout_ids.tolist() for s in [batch.samples[i]])],
                       dtype=torch.float64)
    dist.all_reduce(tot)
    return {"pg_loss": float(tot[0] / tot[1]), "tree_rows": int(tot[2]), "flat_tokens": int(tot[3]),
            "images_encoded": int(tot[4]), "images_per_rollout": int(tot[5]), "grad_norm": grad_norm}


def tiny_vlm(lr: float = 1e-3, dtype=torch.float32):
    """(DDP model, optimizer, DP rank, DP size): a tiny vision-language model on CPU (gloo) under Megatron-Core."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tree import cpu
    from megatron_tree.training.models import ModelArgs, build_model, make_config, wrap_ddp

    cpu.enable(kernels=True)
    torch._dynamo.config.disable = True
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    margs = ModelArgs(kind="vlm", num_layers=2, hidden_size=32, vocab_size=VOCAB, max_position=BUDGET)
    config = make_config(margs, dtype=dtype)
    model = wrap_ddp(build_model(config, margs), config)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, params_dtype=dtype), [model])
    return model, opt, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def demo_rank(steps: int = 3) -> list:
    model, opt, dp_rank, dp_size = tiny_vlm()
    lines = []
    for step in range(steps):
        m = grpo_step(model, opt, traces(seed=step), dp_rank=dp_rank, dp_size=dp_size)
        lines.append(f"step {step + 1}: GRPO pg_loss {m['pg_loss']:+.5f}, grad_norm {m['grad_norm']:.4f}; rows computed "
                     f"{m['tree_rows']} where per-rollout training runs {m['flat_tokens']} tokens "
                     f"({m['flat_tokens'] / m['tree_rows']:.2f}x); screenshots encoded {m['images_encoded']} where "
                     f"per-rollout training encodes {m['images_per_rollout']}")
    return lines


def tree_vs_per_rollout_rank() -> dict:
    """The first step's loss and gradient, float64, packed as trees and one rollout per chain (no sharing: every
    rollout's prompt and screenshots run again), from the same weights: equal to float64 rounding."""
    import torch.distributed as dist

    out = {}
    for share in (True, False):
        model, opt, dp_rank, dp_size = tiny_vlm(dtype=torch.float64)
        m = grpo_step(model, opt, traces(seed=0), dp_rank=dp_rank, dp_size=dp_size, share_prefixes=share,
                      step_optimizer=False)
        grads = torch.cat([p.main_grad.reshape(-1) for p in model.module.parameters()])
        dist.all_reduce(grads)
        out[share] = dict(m, grads=grads)
    return out


if __name__ == "__main__":
    from megatron_tree.training.launch import run_distributed

    print("\n".join(run_distributed(demo_rank, 2, timeout=900)[0]))
