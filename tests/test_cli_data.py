"""`megatron-tree stats`, JSONL reading and the synthetic presets."""
from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_tree.cli import main
from megatron_tree.data.io import ReadReport, read_jsonl, write_jsonl
from megatron_tree.data.synthetic import PRESETS, make_preset
from megatron_tree.tree import pack, summarize


def test_presets_are_seeded_and_shaped():
    a = make_preset("fixed_5k_16x100", seed=3)
    b = make_preset("fixed_5k_16x100", seed=3)
    assert [s.tokens.tolist() for s in a] == [s.tokens.tolist() for s in b]
    assert len(a) == 16 and all(len(s) == 5100 for s in a)
    v = make_preset("varied_5k_16x100")
    prompts = {}
    for s in v:
        n_prompt = int(np.argmax(s.target_mask()))
        assert 5000 - 1024 <= n_prompt <= 5000 + 1024 and 100 - 64 <= len(s) - n_prompt <= 100 + 64
        prompts.setdefault(s.group, set()).add(n_prompt)
    assert len(prompts) == 4 and all(len(p) == 1 for p in prompts.values())
    tot = summarize(pack(make_preset("many_small_64_4x16"), 4096))
    assert tot["tree_tokens"] == 64 * (64 + 4 * 16)
    agent = make_preset("agent_multiturn", scale=0.25)
    tot = summarize(pack(agent, 4096))
    assert tot["num_trees"] == 2 and tot["num_segments"] == 2 * 31  # forks at every one of 4 turns
    for name in PRESETS:
        make_preset(name, scale=0.01)


def test_jsonl_roundtrip_and_bad_lines(tmp_path):
    samples = make_preset("many_small_64_4x16", scale=0.25)[:5]
    p = tmp_path / "d.jsonl"
    write_jsonl(samples, p)
    back = read_jsonl(p)
    assert [s.tokens.tolist() for s in back] == [s.tokens.tolist() for s in samples]
    assert all(np.array_equal(a.target_mask(), b.target_mask()) for a, b in zip(back, samples))
    with open(p, "a") as f:
        f.write(json.dumps({"tokens": []}) + "\n")
        f.write("{not json\n")
        f.write(json.dumps({"tokens": [1, 2], "loss_mask": [0]}) + "\n")
    with pytest.raises(ValueError, match="d.jsonl:6: empty sample"):
        read_jsonl(p)
    rep = ReadReport()
    kept = read_jsonl(p, bad_sample="skip", report=rep)
    assert len(kept) == 5 and [w for w, _ in rep.skipped] == ["d.jsonl:6", "d.jsonl:7", "d.jsonl:8"]
    assert "invalid JSON" in rep.skipped[1][1] and "loss_mask has shape" in rep.skipped[2][1]


def test_stats_cli_prints_report_and_plot(tmp_path, capsys):
    png = tmp_path / "t.png"
    assert main(["stats", "--preset", "agent_multiturn", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "tree_token_ratio" in out and "attention pairs saved" in out
    assert png.stat().st_size > 1000
    p = tmp_path / "d.jsonl"
    p.write_text('{"tokens": [1, 2, 3]}\n{"tokens": [1, 2, 4]}\n')
    assert main(["stats", "--data", str(p), "--max-tokens-per-mb", "16"]) == 0
    out = capsys.readouterr().out
    assert "1.500" in out  # 6 flat tokens over 4 tree rows
