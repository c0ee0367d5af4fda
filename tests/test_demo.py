"""`megatron-tree demo` (what `make demo` runs), shrunk: 6 tree steps and 3 flat steps of the demo's
hybrid model on DP2 gloo ranks, on its preset at x0.05 with a 512-row budget (~15 s on 2 cores)."""
from __future__ import annotations

import json
import math

from megatron_tree.cli import main
from megatron_tree.training.demo import TREE_FLAT_LOSS_RTOL


def test_tiny_demo_trains_and_matches_flat(tmp_path, capfd):
    out_dir = tmp_path / "demo"
    assert main(["demo", "--out-dir", str(out_dir), "--steps", "6", "--flat-steps", "3", "--scale", "0.05",
                 "--max-tokens-per-mb", "512"]) == 0
    printed = capfd.readouterr().out
    with open(out_dir / "metrics.json") as f:
        m = json.load(f)
    s, tree, flat = m["summary"], m["tree"], m["flat"]
    th, fh = tree["history"], flat["history"]
    assert [h["step"] for h in th] == [1, 2, 3, 4, 5, 6] and [h["step"] for h in fh] == [1, 2, 3]
    assert tree["dp_size"] == 2 and tree["packing"] == "tree" and flat["packing"] == "flat"
    losses = [h["loss"] for h in th]
    assert all(math.isfinite(x) for x in losses) and all(h["num_targets"] > 0 for h in th)
    # SFT on random completions: the tiny model memorises them, so the loss falls clearly
    assert s["loss_first"] == losses[0] and s["loss_last"] == losses[-1] < losses[0] - 0.3, losses
    # the flat run trains the same samples from the same weights: the same losses, to rounding
    for a, b in zip(th, fh):
        assert a["sample_ids"] == b["sample_ids"] and a["num_targets"] == b["num_targets"]
        assert abs(a["loss"] - b["loss"]) <= TREE_FLAT_LOSS_RTOL * abs(b["loss"])
    assert s["tree_flat_loss_rtol"] == TREE_FLAT_LOSS_RTOL
    assert s["tree_flat_loss_agree"] and s["tree_flat_loss_max_rel_diff"] <= TREE_FLAT_LOSS_RTOL
    # the preset's 16 completions share each prompt: far fewer tree rows than flat tokens
    assert tree["tree_token_ratio"] > 4 and s["ideal_gain"] == tree["tree_token_ratio"]
    assert all(h["tree_token_ratio"] == 1.0 for h in fh) and flat["tree_token_ratio"] == 1.0
    assert s["useful_tokens_per_s_tree"] > 0 and s["useful_tokens_per_s_flat"] > 0
    if m["png"] is not None:
        assert (out_dir / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"loss: {losses[0]:.4f} (first step) -> {losses[-1]:.4f} (last step)" in printed, printed
    assert f"(tree training is exact: within {TREE_FLAT_LOSS_RTOL:.0e})" in printed, printed
