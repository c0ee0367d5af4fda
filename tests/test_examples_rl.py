"""The `megatron_tree.rl` examples run as users run them (2 gloo ranks on CPU): the DPO step on prompts shared by
several pairs, the reward-model step on ranked groups of 8 responses, and the actor step with GRPO and with GSPO."""
from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))


def test_dpo_example_computes_each_prompt_once_and_learns():
    """Two prompts of 256 tokens with two pairs each: the first step's loss is log 2 (the policy is its own
    reference), the rows computed are the two prompts once plus every completion (the tree), and the loss falls."""
    import re

    import rl_dpo_step
    from megatron_tree.training.launch import run_distributed

    lines = run_distributed(rl_dpo_step.demo_rank, 2, 256, 3, timeout=600)[0]
    prompts, pairs = rl_dpo_step.synthetic_preferences(256)
    tree_rows = sum(len(p) for p in prompts) + sum(len(g) + len(b) for _, g, b in pairs)
    flat = sum(2 * len(prompts[i]) + len(g) + len(b) for i, g, b in pairs)
    losses, rows = [], []
    for line in lines:
        m = re.search(r"DPO loss ([0-9.]+) .* rows computed (\d+) where per-sample training runs (\d+) tokens", line)
        assert m, line
        losses.append(float(m.group(1)))
        rows.append((int(m.group(2)), int(m.group(3))))
    print("\n" + "\n".join(lines))
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5) and losses[-1] < losses[0] - 1e-3, losses
    # padding rows round each microbatch up to a multiple of 8
    assert all(tree_rows <= r < tree_rows + 8 * 4 and f == flat for r, f in rows), (rows, tree_rows, flat)


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_actor_step_example_runs_grpo_and_gspo(loss):
    import rl_actor_step
    from megatron_tree.training.launch import run_distributed

    lines = [line for rank in run_distributed(rl_actor_step._demo_rank, 2, loss, timeout=600) for line in rank]
    print("\n" + "\n".join(lines))
    assert len(lines) == 6 and all("grad_norm" in line and "nan" not in line for line in lines), lines


def test_reward_model_example_computes_each_prompt_once_and_learns():
    """Two prompts of 256 tokens with 8 rated responses each: the rows computed are the tree's (every distinct prefix
    once: the prompts once, every response and its reward row), per-sample training's tokens are every response
    with its prompt, and the loss falls."""
    import re

    import rl_reward_model_step
    from megatron_tree.training.launch import run_distributed

    lines = run_distributed(rl_reward_model_step.demo_rank, 2, 256, 3, timeout=600)[0]
    tokens, groups, _ = rl_reward_model_step.ranked_groups(256)
    # the tree's rows: every distinct prefix of the responses with their reward token (0) appended
    tree_rows = len({tuple(t[:k]) for t in (list(x) + [0] for x in tokens) for k in range(1, len(t) + 1)})
    flat = sum(len(t) + 1 for t in tokens)
    losses, rows = [], []
    for line in lines:
        m = re.search(r"Bradley-Terry loss ([0-9.]+) .* rows computed (\d+) where per-sample training runs (\d+) tokens",
                      line)
        assert m, line
        losses.append(float(m.group(1)))
        rows.append((int(m.group(2)), int(m.group(3))))
    print("\n" + "\n".join(lines))
    assert losses[-1] < losses[0] - 1e-3, losses
    assert all(tree_rows <= r < tree_rows + 8 * 4 and f == flat for r, f in rows), (rows, tree_rows, flat)


def test_vlm_grpo_example_encodes_each_screenshot_once():
    """Multi-turn screenshot traces (2 groups of 8 rollouts, 3 turns): the rows computed are the tree's (every distinct
    prefix once), the screenshots encoded are the distinct (prefix, screenshot) occurrences (per group the first
    screenshot once and one per action history: 1 + 2 + 4 + 8), against every rollout's own in per-rollout training."""
    import re

    import rl_vlm_grpo_step
    from megatron_tree.training.launch import run_distributed

    lines = run_distributed(rl_vlm_grpo_step.demo_rank, 2, timeout=900)[0]
    print("\n" + "\n".join(lines))
    assert len(lines) == 3
    for step, line in enumerate(lines):
        m = re.search(r"pg_loss ([-+0-9.]+), grad_norm ([0-9.]+); rows computed (\d+) where per-rollout training runs "
                      r"(\d+) tokens .* screenshots encoded (\d+) where per-rollout training encodes (\d+)", line)
        assert m, line
        tokens = rl_vlm_grpo_step.traces(seed=step)[0]
        tree_rows = len({tuple(t[:k]) for t in tokens for k in range(1, len(t) + 1)})
        rows, flat, enc, per = (int(m.group(k)) for k in (3, 4, 5, 6))
        assert flat == sum(len(t) for t in tokens) and tree_rows <= rows < tree_rows + 8 * 2, (rows, tree_rows)
        assert (enc, per) == (2 * (1 + 2 + 4 + 8), 2 * 8 * 4)
        assert float(m.group(2)) > 0


def test_vlm_grpo_tree_step_equals_per_rollout_step():
    """float64: the GRPO step's loss and every gradient (vision encoder included) on trees equal the step with one
    rollout per chain (each rollout's prompt and screenshots run again)."""
    import rl_vlm_grpo_step
    from megatron_tree.training.launch import run_distributed

    out = run_distributed(rl_vlm_grpo_step.tree_vs_per_rollout_rank, 2, timeout=900)[0]
    tree, flat = out[True], out[False]
    assert tree["tree_rows"] < flat["tree_rows"] and tree["images_encoded"] < flat["images_encoded"]
    assert abs(tree["pg_loss"] - flat["pg_loss"]) <= 1e-12 * max(1.0, abs(flat["pg_loss"]))
    err = float((tree["grads"] - flat["grads"]).abs().max() / flat["grads"].abs().max())
    assert err <= 1e-12, err
