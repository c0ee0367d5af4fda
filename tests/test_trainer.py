"""`megatron-tree train`: loss falls, tree == flat training, checkpoint + resume is exact, clear errors.

Every distributed check spawns 2 gloo ranks once and calls `train` several times inside them
(spawning and importing Megatron costs seconds each time). Sizes are tiny: the machine has 2 cores.
"""
from __future__ import annotations

import glob
import math
import os
import re

import numpy as np
import pytest

from megatron_tree.training.launch import run_distributed
from megatron_tree.training.trainer import build_train_parser, check_train_args, latest_checkpoint, main

HYBRID = "MG*E"  # Mamba-2, GDN, attention, MoE (2 experts)


def _write_data(path, n_families=8, seed=0, vocab=128):
    """GRPO-like families: prompt 24 + 3 completions of 4..7 tokens (prompt masked out of the loss)."""
    from megatron_tree.data.io import write_jsonl
    from megatron_tree.tree import Sample

    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_families):
        prompt = rng.integers(1, vocab, 24)
        for _ in range(3):
            comp = rng.integers(1, vocab, int(rng.integers(4, 8)))
            toks = np.concatenate([prompt, comp])
            out.append(Sample(tokens=toks, loss_mask=np.r_[np.zeros(24, bool), np.ones(len(comp), bool)],
                              advantage=float(rng.normal()), old_logprobs=-np.log(vocab) + rng.normal(0, .1, len(toks)),
                              group=g))
    write_jsonl(out, path)
    return out


def _args(data, *extra):
    argv = ["--tree-data-path", str(data), "--vocab-size", "128", "--hidden-size", "32", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--ffn-hidden-size", "64", "--lr", "2e-2", "--lr-decay-style", "constant",
            "--weight-decay", "0", "--tree-global-batch-samples", "12", "--tree-max-tokens-per-mb", "64",
            "--tree-pad-to-multiple-of", "8", "--quiet", "--seed", "7", *map(str, extra)]
    return build_train_parser().parse_args(argv)


# --------------------------------------------------------------------------------------------- rank bodies
def _resume_body(data, ckpt, tb):
    """DP2 hybrid: uninterrupted 6 steps; 3 steps + save; resume from the checkpoint for 3 more."""
    from megatron_tree.training.trainer import train

    common = ("--hybrid-override-pattern", HYBRID, "--num-experts", "2", "--moe-ffn-hidden-size", "16",
              "--train-iters", "6", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1")
    full = train(_args(data, *common, "--load", os.path.join(ckpt, "absent"), "--tensorboard-dir", tb))
    first = train(_args(data, *common, "--save", ckpt, "--exit-interval", "3"))
    rest = train(_args(data, *common, "--load", ckpt, "--save", ckpt, "--save-interval", "2"))
    return full, first, rest


def _tree_flat_body(data):
    """TP2 GPT: the same steps with tree packing and with flat packing (every sample its own chain)."""
    from megatron_tree.training.trainer import train

    common = ("--tensor-model-parallel-size", "2", "--num-layers", "2", "--train-iters", "5")
    tree = train(_args(data, *common))
    flat = train(_args(data, *common, "--packing", "flat", "--exit-interval", "2"))
    return tree, flat


def _carry_body(data):
    """Hybrid (Mamba-2, GDN, attention): --tree-carry at a 16-row budget (every sample is longer, so
    every path is cut and carried) against the same run with a budget that holds every tree whole, on
    DP2 (kept graphs: each exporter forwards once), then on two 1F1B pipeline stages (Mamba-2 + GDN on the
    first, attention + MLP on the second: each stage its own carry store, the fills' hidden states sent on);
    and under tree CP2 (zigzag: both ranks hold rows of every microbatch); then DP2 with --tree-carry-memory 0
    (fills and restores)."""
    from megatron_tree.training.trainer import train

    out = []
    for extra in (("--hybrid-override-pattern", "MG*-"), ("--hybrid-override-pattern", "MG*-",
                                                          "--pipeline-model-parallel-size", "2"),
                  ("--hybrid-override-pattern", "MG*-", "--context-parallel-size", "2", "--tree-cp-planner",
                   "zigzag")):
        common = ("--train-iters", "3", *extra)
        out += [train(_args(data, *common, "--tree-carry", "--tree-max-tokens-per-mb", "16")), train(_args(data, *common))]
    # without kept graphs (--tree-carry-memory 0): every exporter fills, then restores
    out.append(train(_args(data, "--train-iters", "3", "--hybrid-override-pattern", "MG*-", "--tree-carry",
                           "--tree-max-tokens-per-mb", "16", "--tree-carry-memory", "0")))
    # carry groups cut over the two DP ranks (every microbatch loose): carried state and its gradient cross ranks
    out.append(train(_args(data, "--train-iters", "3", "--hybrid-override-pattern", "MG*-", "--tree-carry",
                           "--tree-max-tokens-per-mb", "16", "--tree-carry-cut", "always")))
    return out


# --------------------------------------------------------------------------------------------- tests
def _check_dp_shares(histories, samples):
    """``histories``: one run's per-step history on each DP rank. Every step, the samples the ranks
    ran are disjoint and make up the step's window, and the targets whose loss they computed sum to
    the window's targets in the data (each sample trained exactly once, each target counted once)."""
    for steps in zip(*histories):
        window = steps[0]["sample_ids"]
        assert all(m["sample_ids"] == window and m["step"] == steps[0]["step"] for m in steps)
        shares = [m["rank_sample_ids"] for m in steps]
        assert all(shares), f"step {steps[0]['step']}: a DP rank trained no sample: {shares}"
        assert sorted(i for sh in shares for i in sh) == sorted(window), f"step {steps[0]['step']}: {shares}"
        data_targets = sum(int(samples[i].target_mask().sum()) for i in window)
        assert sum(m["rank_num_targets"] for m in steps) == data_targets == steps[0]["num_targets"]


def test_dp2_hybrid_loss_falls_and_resume_is_exact(tmp_path):
    data, ckpt, tb = tmp_path / "d.jsonl", str(tmp_path / "ckpt"), str(tmp_path / "tb")
    samples = _write_data(data)
    per_rank = run_distributed(_resume_body, 2, data, ckpt, tb, timeout=600)
    full, first, rest = per_rank[0]
    for run in range(3):  # uninterrupted, interrupted, resumed
        _check_dp_shares([r[run]["history"] for r in per_rank], samples)
    fh, ah, bh = full["history"], first["history"], rest["history"]
    assert [m["step"] for m in fh] == [1, 2, 3, 4, 5, 6]
    assert full["resumed_from"] is None and full["dp_size"] == 2
    assert all(math.isfinite(m["loss"]) and m["num_targets"] > 0 for m in fh)
    # memorising 24 samples (2 steps per epoch): the loss must fall well below its start
    assert fh[-1]["loss"] < fh[0]["loss"] - 0.3, [m["loss"] for m in fh]
    # every window holds 12 samples; an epoch (2 windows) covers the 24 samples exactly once
    for e in range(3):
        ids = fh[2 * e]["sample_ids"] + fh[2 * e + 1]["sample_ids"]
        assert sorted(ids) == list(range(len(samples)))
    # the interrupted run repeats the first half bit for bit (determinism), then stops and saves
    assert [m["step"] for m in ah] == [1, 2, 3]
    assert [m["loss"] for m in ah] == [m["loss"] for m in fh[:3]]
    assert first["saved"] == [os.path.join(ckpt, "iter_0000003")]
    # the resumed run trains exactly steps 4..6: same samples, same losses, same lr, same grad norms
    assert rest["resumed_from"] == 3
    assert [m["step"] for m in bh] == [4, 5, 6]
    assert [m["sample_ids"] for m in bh] == [m["sample_ids"] for m in fh[3:]]
    for a, b in zip(bh, fh[3:]):  # bit for bit: the checkpoint restores every bit that steps depend on
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"])
    assert rest["saved"] == [os.path.join(ckpt, "iter_0000004"), os.path.join(ckpt, "iter_0000006")]
    assert latest_checkpoint(ckpt) == 6
    assert latest_checkpoint(str(tmp_path / "nowhere")) is None
    assert glob.glob(os.path.join(tb, "events.out.tfevents.*")), "no TensorBoard event file"
    for m in fh:
        assert m["tree_token_ratio"] > 1.5  # 3 completions share a 24-token prompt
        assert m["planner_imbalance"] >= 1.0 and 0.0 <= m["data_wait_frac"] <= 1.0
        assert m["useful_tokens_per_s"] == pytest.approx(m["rows_per_s"] * m["flat_tokens"] / m["tree_rows"])


def test_tp2_gpt_tree_training_equals_flat_training(tmp_path):
    data = tmp_path / "d.jsonl"
    _write_data(data, seed=3)
    tree, flat = run_distributed(_tree_flat_body, 2, data, timeout=600)[0]
    th, fh = tree["history"], flat["history"]
    assert len(th) == 5 and len(fh) == 2
    assert th[-1]["loss"] < th[0]["loss"]
    assert all(m["tree_token_ratio"] == 1.0 for m in fh) and all(m["tree_token_ratio"] > 1.5 for m in th)
    for a, b in zip(th, fh):  # same samples, same weights: per-sample training, exactly (float32 rounding)
        assert a["sample_ids"] == b["sample_ids"] and a["num_targets"] == b["num_targets"]
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-4)


def _tb_scalars(directory, tag):
    """``[(step, value)]`` of one scalar in the TensorBoard event files under ``directory`` (TFRecord
    framing: length u64, its crc u32, the Event proto, its crc u32)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out = []
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            while header := f.read(12):
                (n,) = struct.unpack("<Q", header[:8])
                ev = Event.FromString(f.read(n))
                f.read(4)
                out += [(ev.step, v.simple_value) for v in ev.summary.value if v.tag == tag]
    return out


def test_train_cli_reports_skipped_samples(tmp_path, capfd):
    """``--tree-bad-sample skip``: rank 0 names the dropped lines at start; the step log and TensorBoard
    (``data/skipped_samples``) carry the count."""
    from megatron_tree.cli import main as cli_main

    data, tb = tmp_path / "d.jsonl", str(tmp_path / "tb")
    _write_data(data, n_families=4)
    lines = data.read_text().splitlines(keepends=True)
    lines.insert(2, "{not json\n")  # line 3
    lines.insert(6, '{"tokens": []}\n')  # line 7
    data.write_text("".join(lines))
    argv = ["train", "--tree-data-path", str(data), "--tree-bad-sample", "skip", "--nproc", "1", "--num-layers", "1",
            "--vocab-size", "128", "--hidden-size", "16", "--num-attention-heads", "2", "--ffn-hidden-size", "32",
            "--train-iters", "2", "--tree-global-batch-samples", "6", "--tree-max-tokens-per-mb", "64",
            "--tensorboard-dir", tb]
    assert cli_main(argv) == 0
    out, err = capfd.readouterr()
    start = err[err.index("megatron-tree train: skipped 2 bad samples"):].splitlines()
    # each listed as file:line (a column may follow for invalid JSON) with its reason
    assert re.fullmatch(r"  \S*d\.jsonl:3(:\d+)?: .*invalid JSON.*", start[1]), err
    assert re.fullmatch(r"  \S*d\.jsonl:7: .*empty sample.*", start[2]), err
    steps = [ln for ln in out.splitlines() if "] 1/2 |" in ln or "] 2/2 |" in ln]
    assert len(steps) == 2 and all("| skipped samples 2 |" in ln for ln in steps), out
    assert _tb_scalars(tb, "data/skipped_samples") == [(1, 2.0), (2, 2.0)]


def test_bad_records_stop_train_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    """A non-finite RL value at a target (JSONL or Parquet), a byte that is not UTF-8: ``megatron-tree
    train`` names the file and line (row) while reading, before any rank is spawned."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from megatron_tree.cli import main as cli_main
    from megatron_tree.training import launch

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(launch, "run_distributed", no_ranks)
    good = json.dumps({"tokens": [1, 2, 3], "loss_mask": [0, 1, 1], "advantage": [0.0, 1.0, 1.0],
                       "old_logprobs": [None, -1.0, -2.0]}) + "\n"
    cases = {  # file, its content, the message
        "nan.jsonl": (good * 4 + good.replace("-2.0", "NaN"),
                      ":5: old_logprobs has a non-finite value at a target position (token 2: nan)"),
        "inf.jsonl": (good * 2 + good.replace("[0.0, 1.0, 1.0]", "[0.0, 1e999, 1.0]"),
                      ":3: advantage has a non-finite value at a target position (token 1: inf)"),
        "utf8.jsonl": (good.encode() * 3 + b'{"tokens": [1, 2], "note": "\xff"}\n',
                       ":4:29: invalid UTF-8: byte 0xff"),
        "w.parquet": ({"tokens": [[1, 2, 3], [1, 2, 4]], "weight": [[1.0, 1.0, 1.0], [1.0, float("inf"), 1.0]]},
                      ":row 1: weight has a non-finite value at a target position (token 1: inf)"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        if name.endswith(".parquet"):
            pq.write_table(pa.table(content), path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        argv = ["train", "--tree-data-path", str(path), "--train-iters", "1", "--tree-global-batch-samples", "2",
                "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2"]
        assert cli_main(argv) == 2, name
        err = capsys.readouterr().err
        assert f"megatron-tree: error: {path}{message}" in err, err


@pytest.mark.parametrize("argv, message", [
    (["--train-iters", "2"], "no training data"),
    (["--synthetic-preset", "fixed_5k_16x100"], "--train-iters"),
    (["--synthetic-preset", "fixed_5k_16x100", "--train-iters", "2", "--tensor-model-parallel-size", "2"],
     "must be a multiple of tensor x pipeline"),
    (["--synthetic-preset", "fixed_5k_16x100", "--train-iters", "2", "--hybrid-override-pattern", "MG*",
      "--num-layers", "4"], "--num-layers (4) must equal"),
    (["--synthetic-preset", "fixed_5k_16x100", "--train-iters", "2", "--hybrid-override-pattern", "ME"],
     "set --num-experts"),
    (["--synthetic-preset", "fixed_5k_16x100", "--train-iters", "2", "--tree-max-tokens-per-mb", "100"],
     "multiple of --tree-pad-to-multiple-of"),
    pytest.param(["--synthetic-preset", "fixed_5k_16x100", "--train-iters", "2", "--bf16"], "--bf16 needs CUDA",
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only rule")),
])
def test_main_argument_errors_are_clear(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "megatron-tree train: error:" in err and message in err, err


def test_check_args_defaults(tmp_path):
    data = tmp_path / "d.jsonl"
    samples = _write_data(data)
    args = build_train_parser().parse_args(["--tree-data-path", str(data), "--train-iters", "1",
                                            "--tree-global-batch-samples", "4"])
    check_train_args(args, samples)
    # budget: the largest tree (24 + 3 tails) rounded up to the padding multiple
    assert args.tree_max_tokens_per_mb % 8 == 0 and args.tree_max_tokens_per_mb >= 24 + 3 * 4
    assert args.num_layers == 4 and args.tree_packing
    with pytest.raises(ValueError, match="tree-global-batch-samples is required"):
        check_train_args(build_train_parser().parse_args(["--tree-data-path", str(data), "--train-iters", "1"]), samples)


def test_dp2_hybrid_carry_at_a_small_budget_equals_whole_trees(tmp_path):
    data = tmp_path / "d.jsonl"
    samples = _write_data(data, seed=5)
    per_rank = run_distributed(_carry_body, 2, data, timeout=600)
    for run in range(2):
        _check_dp_shares([r[run]["history"] for r in per_rank], samples)
    dp_carry, dp_whole, pp_carry, pp_whole, cp_carry, cp_whole, dp_filled, dp_cut = per_rank[0]
    _check_dp_shares([r[7]["history"] for r in per_rank], samples)
    assert all(m["carry_syncs"] > 0 for m in dp_cut["history"]) and not any(m["carry_syncs"] for m in dp_carry["history"])
    # both pipeline stages report the last stage's losses
    assert [m["loss"] for m in per_rank[0][2]["history"]] == [m["loss"] for m in per_rank[1][2]["history"]]
    # the default memory keeps every exporter's graph (one forward per row) where the schedule allows: DP and CP,
    # not 1F1B; --tree-carry-memory 0 forwards every exporter twice
    for run, kept in ((dp_carry, True), (cp_carry, True), (pp_carry, False), (dp_filled, False)):
        for m in run["history"]:
            assert (m["rank_carry_kept"] > 0 and m["rank_carry_extra_rows"] == 0) if kept else \
                (m["rank_carry_kept"] == 0 and m["rank_carry_extra_rows"] > 0), m
    for carry, whole in ((dp_carry, dp_whole), (pp_carry, pp_whole), (cp_carry, cp_whole), (dp_filled, dp_whole),
                         (dp_cut, dp_whole)):
        ch, wh = carry["history"], whole["history"]
        assert len(ch) == len(wh) == 3
        for a, b in zip(ch, wh):  # the same samples and targets; the same numbers up to float32 rounding
            assert a["sample_ids"] == b["sample_ids"] and a["num_targets"] == b["num_targets"]
            assert a["tree_rows"] == b["tree_rows"]  # carry computes every row once, as the whole trees do
            assert a["loss"] == pytest.approx(b["loss"], rel=2e-5)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-4)
    # one DP replica under PP and under CP: every step trains its whole window
    assert all(m["rank_sample_ids"] == m["sample_ids"] for m in pp_carry["history"] + cp_carry["history"])
    # under CP the step metrics (and the step's log line, which reads them) hold the planner's predicted
    # imbalance with carry too: carry plans each item as it runs, and the metric reads those plans
    assert all(m["cp_predicted_imbalance"] >= 1.0 for m in cp_carry["history"] + cp_whole["history"])


def _gspo_body(data):
    """DP2 GPT, `train --tree-loss gspo --loss-agg seq-mean-token-mean`: tree packing, flat packing (every
    sample its own chain: per-sample GSPO), and tree packing with --tree-carry at 16 rows (every sample cut)."""
    from megatron_tree.training.trainer import train

    common = ("--num-layers", "2", "--train-iters", "3", "--tree-loss", "gspo", "--tree-clip-eps", "0.2",
              "--loss-agg", "seq-mean-token-mean")
    return (train(_args(data, *common)), train(_args(data, *common, "--packing", "flat")),
            train(_args(data, *common, "--tree-carry", "--tree-max-tokens-per-mb", "16")))


def test_dp2_gspo_with_seq_mean_token_mean_equals_flat_training(tmp_path):
    """GSPO in the trainer: each sample's sequence ratio from a forward-only stats pass over DP ranks, then the
    graded pass, with the loss aggregation's per-sample weights: tree packing and carry equal flat packing
    (per-sample training) step by step, and the loss moves."""
    data = tmp_path / "d.jsonl"
    _write_data(data, seed=5)
    tree, flat, carry = run_distributed(_gspo_body, 2, data, timeout=600)[0]
    th, fh, ch = tree["history"], flat["history"], carry["history"]
    assert len(th) == len(fh) == len(ch) == 3
    assert th[0]["loss"] != th[-1]["loss"]
    for a, b, c in zip(th, fh, ch):
        assert a["sample_ids"] == b["sample_ids"] == c["sample_ids"]
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-5) and c["loss"] == pytest.approx(b["loss"], rel=2e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-4)
        assert c["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-4)


def _write_pairs(path, n_prompts=6, seed=3, vocab=128):
    """Preference data: per prompt (16 tokens) two pairs, each a chosen and a rejected completion of 3..6 tokens
    with reference log-probs; pair ids and the chosen flag as JSONL keys beside the sample's fields."""
    from megatron_tree.data.io import write_jsonl
    from megatron_tree.tree import Sample

    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_prompts):
        prompt = rng.integers(1, vocab, 16)
        for p in range(2):
            for chosen in (True, False):
                comp = rng.integers(1, vocab, int(rng.integers(3, 7)))
                toks = np.concatenate([prompt, comp])
                out.append(Sample(tokens=toks, loss_mask=np.r_[np.zeros(16, bool), np.ones(len(comp), bool)],
                                  ref_logprobs=-np.log(vocab) + rng.normal(0, .3, len(toks)),
                                  meta={"pair_id": 2 * g + p, "chosen": chosen}))
    write_jsonl(out, path)
    return out


def _dpo_body(data):
    """DP2 GPT, `train --tree-loss dpo` / `simpo`: tree packing, flat packing (every sample its own chain), and
    tree packing with --tree-carry at 16 rows (completions and their pairs cut over microbatches and ranks)."""
    from megatron_tree.training.trainer import train

    out = {}
    for loss in ("dpo", "simpo"):
        common = ("--num-layers", "2", "--train-iters", "3", "--tree-loss", loss, "--tree-dpo-beta", "0.5")
        out[loss] = (train(_args(data, *common)), train(_args(data, *common, "--packing", "flat")),
                     train(_args(data, *common, "--tree-carry", "--tree-max-tokens-per-mb", "16")))
    return out


def test_dp2_preference_pairs_train_as_flat_packing(tmp_path):
    """DPO and SimPO in the trainer: each sample's summed log-prob from a forward-only stats pass over DP ranks,
    each pair's factors, then the graded pass: tree packing and carry equal flat packing (per-sample training)
    step by step, every step holds whole pairs, and the loss moves. (The gradients themselves equal stock
    per rollout in tests/test_rl_objectives.py, trainer/dpo.)"""
    data = tmp_path / "pairs.jsonl"
    samples = _write_pairs(data)
    res = run_distributed(_dpo_body, 2, data, timeout=900)[0]
    for loss, (tree, flat, carry) in res.items():
        th, fh, ch = tree["history"], flat["history"], carry["history"]
        assert len(th) == len(fh) == len(ch) == 3
        assert th[0]["loss"] != th[-1]["loss"], loss
        for a, b, c in zip(th, fh, ch):
            assert a["sample_ids"] == b["sample_ids"] == c["sample_ids"]
            pairs = [samples[i].meta["pair_id"] for i in a["sample_ids"]]
            assert all(pairs.count(p) == 2 for p in pairs), pairs
            assert a["loss"] == pytest.approx(b["loss"], rel=2e-5) and c["loss"] == pytest.approx(b["loss"], rel=2e-5)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-4)
            assert c["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-4)
        print(f"\n{loss}: step losses {[round(m['loss'], 5) for m in th]} (tree), "
              f"{[round(m['loss'], 5) for m in fh]} (flat), {[round(m['loss'], 5) for m in ch]} (carry at 16 rows)")


def _write_value_data(path, vocab=128, k=4):
    """`_write_data`'s families with the fields of a value model and a distillation step as JSONL keys: per token a
    return and an old value, a random teacher's top-k ids and log-probs; and a ranked group's score per record."""
    from megatron_tree.data.io import write_jsonl

    samples = _write_data(path, seed=9)
    rng = np.random.default_rng(11)
    for i, s in enumerate(samples):
        L = len(s)
        lp = np.log(rng.dirichlet(np.ones(vocab), L))
        top = np.argsort(-lp, axis=1)[:, :k]
        s.meta = {"returns": rng.normal(0, 1, L).tolist(), "old_values": rng.normal(0, .3, L).tolist(),
                  "teacher_topk_ids": top.tolist(), "teacher_topk_logprobs": np.take_along_axis(lp, top, 1).tolist(),
                  "score": float(i % 3)}
    write_jsonl(samples, path)
    return samples


def _value_body(values, pairs):
    """DP2 GPT: `train --tree-loss value` (clipped), `rm` over preference pairs and over ranked groups, `distill`,
    each with tree packing, flat packing and tree packing with --tree-carry at 16 rows (records cut over microbatches
    and ranks); the value model saved, then resumed from its checkpoint."""
    import tempfile

    from megatron_tree.training.trainer import train

    out = {}
    for key, data, extra in (("value", values, ("--tree-loss", "value", "--tree-value-clip", "0.2")),
                             # (a reward model's rewards are one row per record: a gentler rate keeps float32 rounding
                             # of tree vs flat from growing over Adam's steps)
                             ("rm pairs", pairs, ("--tree-loss", "rm", "--lr", "2e-3")),
                             ("rm groups", values, ("--tree-loss", "rm", "--lr", "2e-3")),
                             ("distill", values, ("--tree-loss", "distill", "--tree-distill-kl", "reverse"))):
        common = ("--num-layers", "2", "--train-iters", "3", *extra)
        out[key] = (train(_args(data, *common)), train(_args(data, *common, "--packing", "flat")),
                    train(_args(data, *common, "--tree-carry", "--tree-max-tokens-per-mb", "16")))
    with tempfile.TemporaryDirectory() as ckpt:  # (the same path on both ranks: rank 0's name, broadcast)
        import torch.distributed as dist

        box = [ckpt]
        dist.broadcast_object_list(box, src=0)
        common = ("--num-layers", "2", "--train-iters", "3", "--tree-loss", "value", "--tree-value-clip", "0.2")
        train(_args(values, *common, "--save", box[0], "--exit-interval", "2"))
        out["value resumed"] = train(_args(values, *common, "--load", box[0]))
        dist.barrier()
    return out


def test_dp2_value_reward_and_distillation_models_train_as_flat_packing(tmp_path):
    """Value models, reward models (pairs and ranked groups) and distillation in the trainer: tree packing and carry
    equal flat packing (per-sample training) step by step, the loss moves, a value model's checkpoint (its scalar
    head included) resumes exactly. (Their gradients equal stock per rollout in tests/test_rl_value.py and
    tests/test_rl_distill.py, trainer/*.)"""
    values, pairs = tmp_path / "values.jsonl", tmp_path / "pairs.jsonl"
    samples = _write_value_data(values)
    _write_pairs(pairs)
    res = run_distributed(_value_body, 2, values, pairs, timeout=900)[0]
    for key in ("value", "rm pairs", "rm groups", "distill"):
        th, fh, ch = (r["history"] for r in res[key])
        assert len(th) == len(fh) == len(ch) == 3
        assert th[0]["loss"] != th[-1]["loss"], key
        for a, b, c in zip(th, fh, ch):
            assert a["sample_ids"] == b["sample_ids"] == c["sample_ids"]
            assert a["loss"] == pytest.approx(b["loss"], rel=2e-5) and c["loss"] == pytest.approx(b["loss"], rel=2e-5)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-4), key
            assert c["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-4), key
            if key.startswith("rm"):  # one target per record: its reward position
                assert a["num_targets"] == len(a["sample_ids"])
            if key == "rm groups":  # whole ranked groups in every step
                groups = [samples[i].group for i in a["sample_ids"]]
                assert all(groups.count(g) == 3 for g in groups), groups
        print(f"\n{key}: step losses {[round(m['loss'], 5) for m in th]} (tree), "
              f"{[round(m['loss'], 5) for m in ch]} (carry at 16 rows)")
    resumed = res["value resumed"]
    assert resumed["resumed_from"] == 2
    assert resumed["history"][-1]["loss"] == pytest.approx(res["value"][0]["history"][-1]["loss"], rel=1e-9)


def test_value_reward_and_distillation_records_are_checked_by_file_and_line():
    """value / distill / rm read their fields from every record's JSONL keys: a missing one, a wrong length, a
    teacher id outside the vocabulary, a ranked group whose records all score the same are named by file:line."""
    from megatron_tree.tree import Sample
    from megatron_tree.training.objectives import check_loss_fields

    src = ["v.jsonl:1", "v.jsonl:2"]
    good = {"returns": [0.0, 1.0, 2.0], "teacher_topk_ids": [[1, 2]] * 3, "teacher_topk_logprobs": [[-1.0, -2.0]] * 3}
    recs = [Sample(tokens=[1, 2, 3], meta=dict(good)), Sample(tokens=[1, 2, 4], meta=dict(good))]
    check_loss_fields("value", recs, src)
    check_loss_fields("distill", recs, src, vocab_size=8)
    cases = [("value", {"returns": [0.0, 1.0]}, {}, r"v.jsonl:2: returns needs one value per token \(3\)"),
             ("value", {}, dict(value_clip=0.2), "v.jsonl:1: has no old_values, which --tree-loss value --tree-value-clip"),
             ("distill", {"teacher_topk_ids": [[1, 9]] * 3}, dict(vocab_size=8), "v.jsonl:2: teacher_topk_ids holds id 9"),
             ("distill", {"teacher_topk_logprobs": [[-1.0]] * 3}, {}, r"v.jsonl:2: teacher_topk_ids / teacher_topk_logprobs must be"),
             ("distill", {"teacher_topk_logprobs": None}, {}, "v.jsonl:2: has no teacher_topk_logprobs")]
    for loss, change, kw, message in cases:
        meta = {k: v for k, v in dict(good, **change).items() if v is not None}
        with pytest.raises(ValueError, match=message):
            check_loss_fields(loss, [recs[0], Sample(tokens=[1, 2, 4], meta=meta)], src, **kw)
    ranked = [Sample(tokens=[1, 2], group=0, meta={"score": 1.0}), Sample(tokens=[1, 3], group=0, meta={"score": 1.0})]
    with pytest.raises(ValueError, match="group '0': v.jsonl:1, v.jsonl:2 all score 1.0"):
        check_loss_fields("rm", ranked, src)
    with pytest.raises(ValueError, match="v.jsonl:1: --tree-loss rm needs preference pairs"):
        check_loss_fields("rm", [Sample(tokens=[1, 2])], src)
    with pytest.raises(ValueError, match="--save-hf writes a causal LM"):
        check_train_args(build_train_parser().parse_args(["--tree-data-path", "x.jsonl", "--train-iters", "1",
                                                          "--tree-loss", "value", "--save-hf", "o"]))


def test_preference_records_are_checked_by_file_and_line():
    """dpo / ipo / simpo read pair_id, chosen (and ref_logprobs for dpo / ipo) from every record: a missing or
    mistyped field, a pair without exactly one chosen and one rejected record, a record without a target or
    with a weight are named by file:line before any rank starts; an odd global batch is refused."""
    from megatron_tree.tree import Sample
    from megatron_tree.training.objectives import check_loss_fields

    def rec(pid, chosen, **kw):
        return Sample(tokens=[1, 2, 3], ref_logprobs=[0.0, -1.0, -1.0], meta={"pair_id": pid, "chosen": chosen}, **kw)

    src = [f"p.jsonl:{i + 1}" for i in range(4)]
    check_loss_fields("dpo", [rec(0, True), rec(0, False), rec(1, False), rec(1, True)], src)
    cases = [([rec(0, True), rec(0, True)], "pair 0: p.jsonl:1, p.jsonl:2 (chosen: [True, True])"),
             ([rec(0, True), rec(0, False), rec(1, True)], "pair 1: p.jsonl:3"),
             ([rec(0, True), rec("a", False)], "p.jsonl:2: pair_id must be an integer"),
             ([rec(0, True), rec(0, 1)], "p.jsonl:2: chosen must be true or false"),
             ([rec(0, True), Sample(tokens=[1, 2], meta={"pair_id": 0, "chosen": False})],
              "p.jsonl:2: has no ref_logprobs, which --tree-loss dpo needs"),
             ([rec(0, True), rec(0, False, weight=2.0)], "p.jsonl:2: a weight does not apply"),
             ([rec(0, True), rec(0, False, loss_mask=[False, False, False])], "p.jsonl:2: has no target")]
    for samples, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            check_loss_fields("dpo", samples, src)
    check_loss_fields("simpo", [rec(0, True), Sample(tokens=[1, 2], meta={"pair_id": 0, "chosen": False})], src)
    args = build_train_parser().parse_args(["--synthetic-preset", "fixed_5k_16x100", "--train-iters", "1",
                                            "--tree-loss", "dpo", "--tree-global-batch-samples", "5"])
    with pytest.raises(ValueError, match="--tree-global-batch-samples 5 is odd"):
        check_train_args(args)


def test_policy_losses_name_the_first_record_without_their_fields():
    """grpo / ppo / gspo read an advantage (gspo also old log-probs) from every record: a record without one is
    named by file:line before any rank starts, not found inside a rank's loss."""
    from megatron_tree.tree import Sample
    from megatron_tree.training.objectives import check_loss_fields

    good = Sample(tokens=[1, 2, 3], advantage=1.0, old_logprobs=[0.0, -1.0, -1.0])
    no_old = Sample(tokens=[1, 2, 4], advantage=1.0)
    check_loss_fields("grpo", [good, no_old], ["a.jsonl:1", "a.jsonl:2"])
    with pytest.raises(ValueError, match="a.jsonl:2: has no old_logprobs, which --tree-loss gspo needs"):
        check_loss_fields("gspo", [good, no_old], ["a.jsonl:1", "a.jsonl:2"])
    with pytest.raises(ValueError, match="sample 0: has no advantage, which --tree-loss ppo needs"):
        check_loss_fields("ppo", [Sample(tokens=[1, 2])])
