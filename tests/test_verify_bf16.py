"""`megatron-tree verify --dtype bfloat16`: tree bf16 training is as accurate as ordinary bf16 training.

Three runs from the same initial weights and data: per-sample float64 (the reference), the tree
side's microbatches flat-packed in bf16 (every sample its own chain: ordinary packed training,
Megatron-LM ``--bf16`` style) and tree bf16. The tree side's error against the reference must be at
most ``BF16_RATIO`` x the baseline's plus ``BF16_FLOOR``, for the logits, the loss and the gradients
(DSA: the indexer loss and selections too). Every family at CP 1, attention / Mamba / GDN (summary
and heads mode) at CP 2, and a planted accuracy bug the rule rejects. The whole matrix (every model
x CP 1/2/4 x GDN mode) is `tests/verify_bf16_matrix.py`.
"""
from __future__ import annotations

import math

import pytest

from megatron_tree.training.verify import (BF16_FLOOR, BF16_RATIO, VerifyConfig, _combine, format_report,
                                           metrics_of, run_verify_many)

# verify's default batch (6 families, 34 samples): with fewer samples the errors of the smallest
# gradients (GDN's 4-element A_log / dt_bias) are a handful of roundings and their ratio is noise
WS1 = [VerifyConfig(model=m, dtype="bfloat16") for m in ("gpt", "hybrid", "mamba", "qwen3next", "mla", "dsa")]
WS1_FAULT = VerifyConfig(model="dsa", dtype="bfloat16", fault="dsa_bf16_grad_sum")
# CP 2: attention (balanced plan), Mamba-2's head transpose and GDN in summary mode; GDN in heads mode
WS2 = [VerifyConfig(model="hybrid", pattern="MG*-", cp=2, dtype="bfloat16", gdn_cp_mode="summary"),
       VerifyConfig(model="hybrid", pattern="G*-", cp=2, dtype="bfloat16", gdn_cp_mode="heads")]


@pytest.fixture(scope="module")
def ws1():
    return run_verify_many(WS1 + [WS1_FAULT])


@pytest.fixture(scope="module")
def ws2():
    return run_verify_many(WS2)


def _check_clean(cfg, out):
    report = format_report(cfg, out)
    assert out["passed"], report
    for m in metrics_of(cfg):
        assert out[m] <= BF16_RATIO * out[f"{m}_ps"] + BF16_FLOOR, report
    # the bf16 sides really are bf16: per-sample bf16 logits and gradients are off the float64
    # reference by about bf16's rounding (a judge comparing a side with itself would see 0 here)
    assert out["logits_ps"] > 1e-3 and out["grads_ps"] > 1e-3, report
    assert out["tree_rows"] < out["flat_rows"], report


@pytest.mark.parametrize("i", range(len(WS1)), ids=[c.model for c in WS1])
def test_bf16_cp1(ws1, i):
    _check_clean(WS1[i], ws1[i])


@pytest.mark.parametrize("i", range(len(WS2)), ids=["MG*-/summary", "G*-/heads"])
def test_bf16_cp2(ws2, i):
    _check_clean(WS2[i], ws2[i])


def test_bf16_judge_rejects_a_less_accurate_tree_side(ws1):
    """The indexer loss's two passes' gradients rounded to bf16 before they are summed (they nearly
    cancel): exact in float64, several times the packed bf16 baseline's error on the indexer's weights."""
    out = ws1[-1]
    report = format_report(WS1_FAULT, out)
    assert not out["passed"], f"the bf16 judge missed the planted accuracy bug:\n{report}"
    assert out["grads"] > 3 * out["grads_ps"], report
    assert "indexer" in out["grads_at"], report
    assert "grads " in report and " FAIL  (worst: decoder.layers." in report, report


def test_bf16_rule():
    """The rule itself, on made-up per-rank errors: 1.5x plus the floor passes, more fails, a rank is
    judged on its own errors, and a non-finite error on either side fails."""
    cfg = VerifyConfig(dtype="bfloat16")

    def rank(**errs):
        r = {m: 1e-2 for m in ("logits", "loss", "grads")}
        r.update({f"{m}_ps": 1e-2 for m in ("logits", "loss", "grads")})
        r.update(errs, num_samples=1, tree_rows=1, flat_rows=2, loss_value=1.0)
        return r

    assert _combine(cfg, [rank(grads=1.5e-2)])["passed"]
    assert _combine(cfg, [rank(grads=1.5e-2 + 0.9 * BF16_FLOOR)])["passed"]
    assert not _combine(cfg, [rank(grads=1.5e-2 + 1.1 * BF16_FLOOR)])["passed"]
    # the floor: a per-sample error of 0 still allows the floor, not more
    assert _combine(cfg, [rank(loss=0.9 * BF16_FLOOR, loss_ps=0.0)])["passed"]
    assert not _combine(cfg, [rank(loss=1.1 * BF16_FLOOR, loss_ps=0.0)])["passed"]
    # over ranks: the rank nearest (or past) its bound, with both of its errors (rank 0 fails although
    # rank 1's per-sample error, taken alone, would allow rank 0's tree error)
    out = _combine(cfg, [rank(grads=2.9e-2, grads_ps=1e-3), rank(grads=1e-3, grads_ps=2e-2)])
    assert out["grads"] == 2.9e-2 and out["grads_ps"] == 1e-3 and not out["passed"]
    out = _combine(cfg, [rank(grads=1.4e-3, grads_ps=1e-3), rank(grads=1e-3, grads_ps=2e-2)])
    assert out["grads"] == 1.4e-3 and out["grads_ps"] == 1e-3 and out["passed"]
    for bad in (dict(grads=math.inf), dict(grads_ps=math.inf), dict(grads=math.inf, grads_ps=math.inf)):
        out = _combine(cfg, [rank(**bad)])
        assert not out["passed"] and "FAIL" in format_report(cfg, out)
