"""`megatron-tree stats`, JSONL reading and the synthetic presets."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from megatron_tree.cli import main
from megatron_tree.data.io import ReadReport, read_jsonl, write_jsonl
from megatron_tree.data.pipeline import read_samples
from megatron_tree.data.synthetic import PRESETS, make_preset, shared_prompt
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


def test_shared_prompt_is_one_tree_with_loss_on_the_completions():
    s = shared_prompt(48, 5, 7, vocab=50, seed=1)
    assert [s_.tokens.tolist() for s_ in s] == [x.tokens.tolist() for x in shared_prompt(48, 5, 7, vocab=50, seed=1)]
    assert len(s) == 5 and all(len(x) == 55 and x.tokens.min() >= 1 and x.tokens.max() < 50 for x in s)
    assert all((x.tokens[:48] == s[0].tokens[:48]).all() for x in s)
    assert all(x.loss_mask.tolist() == [False] * 48 + [True] * 7 for x in s)
    tot = summarize(pack(s, 4096))
    # one tree whose rows are the samples' distinct prefixes (a trie's nodes): the prompt once
    distinct = {x.tokens[:k].tobytes() for x in s for k in range(1, len(x) + 1)}
    assert tot["num_trees"] == 1 and tot["tree_tokens"] == len(distinct) <= 48 + 5 * 7


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
    with pytest.raises(ValueError, match=re.escape(f"{p}:6: empty sample")):
        read_jsonl(p)
    rep = ReadReport()
    kept = read_jsonl(p, bad_sample="skip", report=rep)
    assert len(kept) == 5 and [w for w, _ in rep.skipped] == [f"{p}:6", f"{p}:7", f"{p}:8"]
    assert rep.skipped[1][1] == f"{p}:7:2: invalid JSON: Expecting property name enclosed in double quotes"
    assert rep.skipped[2][1].startswith(f"{p}:8: loss_mask has shape")
    assert rep.sources == [f"{p}:{i}" for i in range(1, 6)]


def test_jsonl_errors_name_the_path_as_given_line_and_column(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    lines = ['{"tokens": [1, 2]}', '{"tokens": [1, 2] "loss_mask": [0, 1]}', '{"tokens": [3]}']
    (tmp_path / "data" / "rollouts.jsonl").write_text("\n".join(lines) + "\n")
    msg = "data/rollouts.jsonl:2:19: invalid JSON: Expecting ',' delimiter"
    with pytest.raises(ValueError) as e:
        read_jsonl("data/rollouts.jsonl")
    assert str(e.value) == msg
    with pytest.raises(ValueError) as e:  # the same through read_samples, a directory spelled "./data"
        read_samples("./data")
    assert str(e.value) == "./" + msg
    rep = ReadReport()
    assert len(read_samples(["data/rollouts.jsonl"], bad_sample="skip", report=rep)) == 2
    assert rep.skipped == [("data/rollouts.jsonl:2", msg)] and rep.sources[1] == "data/rollouts.jsonl:3"


def test_read_report_summary_names_skipped_lines_and_counts(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"tokens": [1, 2]}\n{"tokens": [1, 2,, 3]}\n{"tokens": [4]}\n{"tokens": [9, 99]}\n')
    rep = ReadReport()
    assert rep.summary() == "" and rep.num_skipped == 0
    assert len(read_jsonl(p, vocab_size=50, bad_sample="skip", report=rep)) == 2
    assert rep.num_skipped == 2
    assert rep.summary() == "\n".join([
        "skipped 2 bad samples (--tree-bad-sample skip):",
        f"  {p}:2:18: invalid JSON: Expecting value",
        f"  {p}:4: token id 99 >= vocab size 50"])
    # many: the first max_items, then the rest counted
    many = ReadReport(skipped=[(f"x.jsonl:{i}", f"x.jsonl:{i}: empty sample (no tokens)") for i in range(1, 9)]
                      + [("y.parquet:row 3", "a reason without the location")])
    lines = many.summary(max_items=5).splitlines()
    assert lines[0] == "skipped 9 bad samples (--tree-bad-sample skip):"
    assert lines[1:6] == [f"  x.jsonl:{i}: empty sample (no tokens)" for i in range(1, 6)]
    assert lines[6:] == ["  ... and 4 more"]
    assert many.summary(max_items=9).splitlines()[-1] == "  y.parquet:row 3: a reason without the location"


def test_stats_cli_prints_report_and_plot(tmp_path, capsys):
    import re

    def report_rows(text):  # "key  value" lines of the sharing report
        return dict(re.split(r"\s{2,}", ln, maxsplit=1) for ln in text.splitlines() if re.search(r"\S\s{2,}\S", ln))

    png = tmp_path / "t.png"
    assert main(["stats", "--preset", "agent_multiturn", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    rows = report_rows(out)
    # agent_multiturn: 2 trees, a 96-token system prompt forking 2 ways at each of 4 turns (a 32-token
    # action, the target, then a 96-token observation): 32 samples of 96 + 4 x 128 tokens; a tree
    # holds 96 + (2 + 4 + 8 + 16) x 128 rows in 31 segments, and fits a 4096-row microbatch alone
    assert {k: rows[k] for k in ("samples", "flat tokens", "tree tokens", "tree_token_ratio (flat/tree)",
                                 "microbatches", "trees / segments", "padding rows", "loss targets")} == {
        "samples": "32", "flat tokens": "19,456", "tree tokens": "7,872", "tree_token_ratio (flat/tree)": "2.472",
        "microbatches": "2", "trees / segments": "2 / 62", "padding rows": "0", "loss targets": "4,096"}, out
    flat_pairs, tree_pairs = (int(rows[f"attention pairs {k}"].replace(",", "")) for k in ("flat", "tree"))
    assert tree_pairs < flat_pairs and rows["attention pairs saved"].startswith(f"{1 - tree_pairs / flat_pairs:.1%} (")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    p = tmp_path / "d.jsonl"
    p.write_text('{"tokens": [1, 2, 3]}\n{"tokens": [1, 2, 4]}\n')
    assert main(["stats", "--data", str(p), "--max-tokens-per-mb", "16"]) == 0
    rows = report_rows(capsys.readouterr().out)
    assert (rows["flat tokens"], rows["tree tokens"], rows["tree_token_ratio (flat/tree)"]) == ("6", "4", "1.500")
