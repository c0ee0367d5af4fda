"""``megatron-tree score --values``: a value / reward model's checkpoint scored against **stock** Megatron-Core.

A tiny GPT value model is trained for two steps with ``megatron-tree train --tree-loss value`` (records with
per-token returns, the scalar head `megatron.value_head` in its checkpoint), then scored through the CLI under DP 2
and PP 2 (the head on the last stage). Oracle: stock ``GPTModel`` (local spec, float64) loaded from the same
checkpoint and run on each record alone, its final hidden states (the decoder's output) read through
``h . w + b`` (the head's two tensors loaded from the checkpoint): ``values`` at every target's source row,
``reward`` at the record's last row. Records: test_score's GRPO-like group, a duplicate, a record with no mask and
one with no target (its reward still there). A planted fault (a reward read one row early) is caught. A language
model's checkpoint scored with ``--values``, or a value model's without it, is refused naming the head's tensors.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

try:
    from dist import init_megatron, run_distributed
except ImportError:  # run from the repository root as tests.*
    from tests.dist import init_megatron, run_distributed

from test_score import MODEL, _records, _targets, stock_gpt

F64 = dict(rtol=1e-10, atol=1e-10)


def _stock_values(ckpt: str, records: list) -> list:
    """[(values at every position's row [L], ...)] per record: stock GPTModel's decoder output through the head."""
    from megatron.core import dist_checkpointing

    from megatron_tree.megatron.value_head import TreeValueHead

    init_megatron(tp=1)
    stock = stock_gpt()
    head = TreeValueHead(stock.config).to(torch.float64)  # (a container for the checkpoint's two tensors)
    path = os.path.join(ckpt, "iter_0000002")
    loaded = dist_checkpointing.load({"model": stock.sharded_state_dict(),
                                      "head": head.sharded_state_dict(prefix="value_head.")}, path)
    stock.load_state_dict(loaded["model"])
    w, b = loaded["head"]["value_head.weight"], loaded["head"]["value_head.bias"]
    seen = {}
    stock.decoder.register_forward_hook(lambda mod, args, out: seen.__setitem__("h", out))
    out = []
    with torch.no_grad():
        for rec in records:
            x = torch.tensor(rec["tokens"])
            stock(x[None], torch.arange(len(x))[None], None)
            out.append((seen["h"][:, 0].double() @ w.double() + b.double()[0]).numpy())
    return out


def _score(*extra):
    from megatron_tree import cli

    return cli.main(["score", *MODEL, "--dtype", "float64", "--quiet", *map(str, extra)])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megatron_tree import cli

    d = tmp_path_factory.mktemp("score_values")
    records = _records()
    rng = np.random.default_rng(4)
    data = str(d / "records.jsonl")
    with open(data, "w") as f:
        for r in records:
            f.write(json.dumps(dict(r, returns=rng.normal(0, 1, len(r["tokens"])).tolist())) + "\n")
    ckpt = str(d / "ckpt")
    assert cli.main(["train", *MODEL, "--tree-data-path", data, "--tree-global-batch-samples", str(len(records)),
                     "--train-iters", "2", "--lr", "0.05", "--tree-loss", "value", "--save", ckpt, "--quiet"]) == 0
    outs = {}
    for name, extra in (("dp2", ["--nproc", "2"]), ("pp2", ["--nproc", "2", "--pipeline-model-parallel-size", "2"])):
        outs[name] = str(d / f"{name}.parquet")
        assert _score("--values", "--load", ckpt, "--data", data, "--out", outs[name], *extra) == 0
    oracle = run_distributed(_stock_values, 1, ckpt, records, timeout=300)[0]
    return dict(dir=d, data=data, ckpt=ckpt, records=records, outs=outs, oracle=oracle)


def _rows(path):
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    return t.column_names, t.to_pylist()


def _check(records, rows, oracle, *, fault: bool = False):
    """Max abs error of every row's values (targets' source rows) and reward (the last row) against stock."""
    err = 0.0
    for rec, row, v in zip(records, rows, oracle):
        t = _targets(rec, False)
        assert len(row["values"]) == len(t)
        want_reward = v[len(rec["tokens"]) - (2 if fault else 1)]
        err = max(err, float(np.abs(np.asarray(row["values"]) - v[t - 1]).max(initial=0.0)),
                  abs(row["reward"] - want_reward))
    return err


@pytest.mark.parametrize("name", ["dp2", "pp2"])
def test_values_and_rewards_equal_stock_per_record(run, name):
    cols, rows = _rows(run["outs"][name])
    assert cols == ["record", "values", "reward"]
    assert [r["record"] for r in rows] == list(range(len(run["records"])))
    err = _check(run["records"], rows, run["oracle"])
    print(f"\nscore --values {name}: max abs error vs stock per record {err:.1e}")
    assert err < 1e-10
    assert rows[8]["values"] == [] and np.isfinite(rows[8]["reward"])  # no target: still a reward
    assert rows[2] == {**rows[6], "record": 2}  # the duplicated record


def test_a_reward_read_one_row_early_is_caught(run):
    _, rows = _rows(run["outs"]["dp2"])
    assert _check(run["records"], rows, run["oracle"], fault=True) > 1e-3


def test_checkpoint_and_values_flag_must_agree(run, tmp_path, capsys):
    """A value model scored without --values, a language model with it: the head's tensors are named."""
    from megatron_tree import cli

    assert _score("--load", run["ckpt"], "--data", run["data"], "--out", str(tmp_path / "a.parquet")) == 2
    assert "value_head.*: a value / reward model's checkpoint (train --tree-loss value|rm): pass --values" in \
        capsys.readouterr().err
    lm = str(tmp_path / "lm")
    assert cli.main(["train", *MODEL, "--tree-data-path", run["data"], "--tree-global-batch-samples", "9",
                     "--train-iters", "1", "--save", lm, "--quiet"]) == 0
    assert _score("--values", "--load", lm, "--data", run["data"], "--out", str(tmp_path / "b.parquet")) == 2
    assert "no value_head.*: a language model's checkpoint" in capsys.readouterr().err
    assert _score("--values", "--top-k", "4", "--load", lm, "--data", run["data"], "--out",
                  str(tmp_path / "c.parquet")) == 2
    assert "--top-k reads the LM head" in capsys.readouterr().err
