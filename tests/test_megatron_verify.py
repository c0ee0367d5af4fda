"""Tree-packed vs per-sample training through Megatron-Core (``megatron-tree verify``), on gloo ranks.

Each group of configs runs in one set of rank processes (one Megatron import per group). The batch
really branches: forks at several depths, loss-masked prompts, a sample that is a prefix of
another, duplicates, EOS, several trees per microbatch, padding. Faults injected into the tree
side must be reported.
"""
from __future__ import annotations

import pytest

from megatron_tree.training.verify import FAULTS, VerifyConfig, format_report, run_verify_many

WS1 = [
    VerifyConfig(model="gpt", dtype="float64"),
    VerifyConfig(model="gpt", dtype="float64", loss="grpo", window=5, sinks=True, recompute="selective"),
    VerifyConfig(model="hybrid", dtype="float64"),  # M, G, *, -, *, E
    VerifyConfig(model="hybrid", pattern="GM*-", dtype="float64", loss="grpo", recompute="full"),
    VerifyConfig(model="hybrid", pattern="GM*-", dtype="float32"),
    VerifyConfig(model="gpt", dtype="float32", window=5, sinks=True),
    VerifyConfig(model="hybrid", pattern="GM*-", dtype="bfloat16"),  # smoke check at bf16 tolerance
] + [VerifyConfig(model="gpt", fault=f) for f in FAULTS if f != "zero_state"] + [
    VerifyConfig(model="hybrid", pattern="GM*-", dtype="float64", fault="zero_state"),
    VerifyConfig(model="hybrid", pattern="G-", dtype="float64", fault="zero_state"),
    VerifyConfig(model="hybrid", pattern="M-", dtype="float64", fault="zero_state"),
]

WS2 = [
    VerifyConfig(model="gpt", tp=2, sp=True, dtype="float64"),
    VerifyConfig(model="gpt", pp=2, dtype="float64", recompute="full"),
    VerifyConfig(model="hybrid", pattern="MG*-", dp=2, dtype="float64"),
    VerifyConfig(model="hybrid", pattern="MG*E", tp=2, sp=True, dtype="float64", loss="grpo"),
    VerifyConfig(model="hybrid", pattern="MG*-", pp=2, dtype="float64", recompute="selective"),
    VerifyConfig(model="gpt", dp=2, ep=2, dtype="float64"),  # MoE in every layer, experts split over 2 ranks
    VerifyConfig(model="hybrid", pattern="GE*M", dp=2, ep=2, dtype="float64", loss="grpo"),
]


@pytest.fixture(scope="module")
def ws1():
    return run_verify_many(WS1)


@pytest.fixture(scope="module")
def ws2():
    return run_verify_many(WS2)


def _id(c: VerifyConfig) -> str:
    return format_report(c, {"tolerance": 0, "num_samples": 0, "flat_rows": 0, "tree_rows": 0, "loss_value": 0,
                             "passed": True, **{m: 0 for m in ("logits", "loss", "grads", "params_after_step")}}
                         ).splitlines()[0].split(": ", 1)[1]


@pytest.mark.parametrize("i", range(len(WS1)), ids=[_id(c) for c in WS1])
def test_world_size_1(ws1, i):
    cfg, out = WS1[i], ws1[i]
    report = format_report(cfg, out)
    if cfg.fault is None:
        assert out["passed"], report
        assert out["tree_rows"] < out["flat_rows"]  # the batch really shares prefixes
    else:
        assert not out["passed"], f"verify missed the injected fault:\n{report}"


@pytest.mark.parametrize("i", range(len(WS2)), ids=[_id(c) for c in WS2])
def test_world_size_2(ws2, i):
    out = ws2[i]
    assert out["passed"], format_report(WS2[i], out)
