"""Tree-packed vs per-sample training through Megatron-Core (``megatron-tree verify``), on gloo ranks.

Each group of configs runs in one set of rank processes (one Megatron import per group). The batch
really branches: forks at several depths, loss-masked prompts, a sample that is a prefix of
another, duplicates, EOS, several trees per microbatch, padding. Faults injected into the tree
side must be reported.
"""
from __future__ import annotations

import pytest

from megatron_tree.training.verify import FAULTS, format_report, run_verify_many
from verify_checks import verify_config as VerifyConfig  # tests/verify_checks.py: 4 families
from selection import run_selected  # tests/selection.py
from verify_checks import check_verify  # tests/verify_checks.py

# Every case runs in the main tier; the latest tier (conftest.py) runs the cases wrapped in both(): one per
# model family and parallel flavour, the paths where Megatron-Core's version matters. The others repeat
# those paths with another loss, window, fault or layout.
LATEST: list = []


def both(cfg: VerifyConfig) -> VerifyConfig:
    LATEST.append(cfg)
    return cfg


WS1 = [
    both(VerifyConfig(model="gpt", dtype="float64")),
    VerifyConfig(model="gpt", dtype="float64", loss="grpo", window=5, sinks=True, recompute="selective"),
    both(VerifyConfig(model="hybrid", dtype="float64")),  # M, G, *, -, *, E
    both(VerifyConfig(model="hybrid", pattern="GM*-", dtype="float64", loss="grpo", recompute="full")),
    VerifyConfig(model="hybrid", pattern="GM*-", dtype="float32"),
    VerifyConfig(model="gpt", dtype="float32", window=5, sinks=True),
] + [VerifyConfig(model="gpt", fault=f) for f in FAULTS if f not in ("zero_state", "mla_rope_physical")] + [
    VerifyConfig(model="hybrid", pattern="GM*-", dtype="float64", fault="zero_state"),
    VerifyConfig(model="hybrid", pattern="G-", dtype="float64", fault="zero_state"),
    VerifyConfig(model="hybrid", pattern="M-", dtype="float64", fault="zero_state"),
    # carry (issue 25): budget 16 < the longest sample (19) and every tree, so paths are cut into chains of
    # 3+ microbatches and forks hang off carried rows; the planted carry faults must fail
    VerifyConfig(model="gpt", window=9, sinks=True, budget=16, carry=True),
    both(VerifyConfig(model="hybrid", pattern="MG*-*E", budget=16, carry=True, recompute="selective")),
    VerifyConfig(model="mla", budget=16, carry=True, loss="grpo"),
    VerifyConfig(model="gpt", budget=16, carry=True, recompute="full", fault="carry_stale"),
    VerifyConfig(model="hybrid", pattern="MG*-", budget=16, carry=True, fault="carry_detach"),
    # carry with kept graphs (issue 38): every exporter runs one forward, its backward after its readers'
    both(VerifyConfig(model="hybrid", pattern="MG*-*E", budget=16, carry=True, carry_keep=True)),
    VerifyConfig(model="hybrid", pattern="MG*-", budget=16, carry=True, carry_keep=True, fault="carry_detach"),
    # vision-language records (issue 37): screenshots in shared prompts and completions, identical prompt tokens
    # behind different screenshots; carry at 16 cuts two image runs (each owner encodes its slice's image);
    # merging two screenshots behind the same placeholders must fail
    both(VerifyConfig(model="vlm", dtype="float64")),
    VerifyConfig(model="vlm", budget=16, carry=True, recompute="full"),
    VerifyConfig(model="vlm", fault="images_merged"),
]

WS2 = [
    both(VerifyConfig(model="gpt", tp=2, sp=True, dtype="float64")),
    both(VerifyConfig(model="gpt", pp=2, dtype="float64", recompute="full")),
    VerifyConfig(model="hybrid", pattern="MG*-", dp=2, dtype="float64"),
    both(VerifyConfig(model="hybrid", pattern="MG*E", tp=2, sp=True, dtype="float64", loss="grpo")),
    VerifyConfig(model="hybrid", pattern="MG*-", pp=2, dtype="float64", recompute="selective"),
    VerifyConfig(model="gpt", dp=2, ep=2, dtype="float64"),  # MoE in every layer, experts split over 2 ranks
    both(VerifyConfig(model="hybrid", pattern="GE*M", dp=2, ep=2, dtype="float64", loss="grpo")),
    # tree context parallelism (the per-sample side runs on one CP rank, so it shares no cross-rank code); MoE
    # experts over the CP ranks: tests/test_routing_replay.py ws2
    both(VerifyConfig(model="gpt", cp=2, dtype="float64")),
    VerifyConfig(model="gpt", cp=2, cp_strategy="zigzag", dtype="float64", loss="grpo", window=5, sinks=True,
                 recompute="selective"),
    VerifyConfig(model="gpt", cp=2, fault="sibling_mask"),
    # Mamba-2 under tree CP: the token -> head transpose (2 groups == cp: one group per rank)
    both(VerifyConfig(model="hybrid", pattern="M*-", cp=2, dtype="float64")),
    VerifyConfig(model="hybrid", pattern="M-", cp=2, fault="zero_state"),
    # Gated DeltaNet under tree CP (cp/execution/gdn.py; "auto" picks summary mode here, heads mode at CP4)
    both(VerifyConfig(model="hybrid", pattern="G*-", cp=2, dtype="float64")),
    VerifyConfig(model="hybrid", pattern="G-", cp=2, fault="zero_state"),
    # GDN layout islands (on by default under CP): "GG-G" and "GM" run on the island ownership, rows move
    # only at the two attention boundaries (zigzag: the small batch's balanced plan equals the island plan)
    both(VerifyConfig(model="hybrid", pattern="GG-G*GM", cp=2, cp_strategy="zigzag", dtype="float64")),
    # carry under TP + SP and over two DP ranks (a carry group stays on one rank)
    VerifyConfig(model="hybrid", pattern="MG*-", tp=2, sp=True, budget=16, carry=True),
    VerifyConfig(model="qwen3next", dp=2, budget=16, carry=True, recompute="full"),
    # carry on two 1F1B pipeline stages (Mamba-2 + GDN | attention + MLP), full recomputation re-reading the store:
    # each stage releases state only past the items whose backward 1F1B may still owe
    VerifyConfig(model="hybrid", pattern="MG*-", pp=2, budget=16, carry=True, recompute="full"),
    # carry under tree CP: the plan covers carried rows too, whose stored K / V enter the CP attention on the rank
    # the plan gives them (zero queries); fills gather the exported rows over CP, restores sum the readers'
    # gradients over CP; Mamba-2 and GDN run their head shards over every own row, each rank storing its heads'
    # state (zigzag: both ranks hold rows of every microbatch). The latest tier runs carry under PP and CP through
    # pretrain() (tests/test_launch_lm.py)
    VerifyConfig(model="gpt", cp=2, cp_strategy="zigzag", window=9, sinks=True, budget=16, carry=True,
                 recompute="full"),
    VerifyConfig(model="hybrid", pattern="MG*-", cp=2, cp_strategy="zigzag", budget=16, carry=True,
                 recompute="selective"),
    VerifyConfig(model="hybrid", pattern="MG-*", cp=2, cp_strategy="zigzag", budget=16, carry=True,
                 fault="carry_detach"),
    # kept graphs under CP (a keep's backward sums the readers' gradients over CP at its release) and TP + SP
    VerifyConfig(model="hybrid", pattern="MG*-", cp=2, cp_strategy="zigzag", budget=16, carry=True, carry_keep=True),
    VerifyConfig(model="mla", tp=2, sp=True, budget=16, carry=True, carry_keep=True, loss="grpo"),
    # carry groups cut over DP ranks (issue 38): every microbatch loose, so owners' K / V and sinks' rows cross
    # ranks at syncs and the readers' gradient comes back to the owner's rank before its restore (or release);
    # dropping that returned gradient must fail
    VerifyConfig(model="gpt", dp=2, window=9, sinks=True, budget=16, carry=True, carry_cut="always"),
    VerifyConfig(model="mla", dp=2, budget=16, carry=True, carry_cut="always", carry_keep=True, loss="grpo"),
    VerifyConfig(model="gpt", dp=2, budget=16, carry=True, carry_cut="always", fault="carry_return_dropped"),
    # vision-language records: the encoder on TP ranks (replicated) with SP scattering after the images go in; CP
    # ranks encode the images holding their rows; the encoder on the first pipeline stage; carry cut over DP ranks
    both(VerifyConfig(model="vlm", tp=2, sp=True, dtype="float64")),
    VerifyConfig(model="vlm", cp=2, budget=16, carry=True),
    VerifyConfig(model="vlm", pp=2, budget=16, carry=True),
    VerifyConfig(model="vlm", dp=2, budget=16, carry=True, carry_cut="always"),
]

# 4 ranks on this 2-core machine cost ~4x a 2-rank config: one case per 4-rank flavour (CI minutes). CP4 is the
# mixed stack's (Mamba-2 with 2 groups < cp 4: B/C replicated, gradients summed; GDN on CP4; zigzag); CP x TP2 + SP
# per layer kind (Mamba-2: 4 heads, 1 group per TP rank, split over 2 CP ranks; GDN: CP on this TP rank's heads);
# CP x DP with the contiguous planner and full recomputation replaying the exchanges; CP x PP with GDN layout
# islands closed at the stage boundary ("G-G|*GE") and replayed by full recomputation. GPT at CP4 and CP2 x PP2
# against CP1: tests/test_cp_megatron.py.
# The latest tier runs the GPT CP x TP2 + SP case only (4 ranks cost its minutes most; its 4-rank pretrain() job
# with CP2 x EP2 x DP2 is tests/test_slurm_job.py's; the layer kinds' CP x TP run here on the pinned stack).
WS4 = [
    both(VerifyConfig(model="gpt", cp=2, tp=2, sp=True, dtype="float64")),
    VerifyConfig(model="hybrid", pattern="M*E", cp=2, tp=2, sp=True, dtype="float64"),
    VerifyConfig(model="hybrid", pattern="G*E", cp=2, tp=2, sp=True, dtype="float64"),
    VerifyConfig(model="hybrid", pattern="GM*-", cp=2, dp=2, dtype="float64", recompute="full",
                 cp_strategy="contiguous"),
    VerifyConfig(model="hybrid", pattern="G-G*GE", cp=2, pp=2, cp_strategy="zigzag", dtype="float64",
                 recompute="full"),
    VerifyConfig(model="hybrid", pattern="GM-*G", cp=4, cp_strategy="zigzag", dtype="float64", loss="grpo"),
    # carry under CP2 x PP2 (1F1B): attention on both stages; a restore sums the readers' gradients over CP in its
    # backward (1F1B may run its forward before theirs), the full recomputation re-reads the store
    VerifyConfig(model="gpt", cp=2, pp=2, cp_strategy="zigzag", window=9, sinks=True, budget=16, carry=True,
                 recompute="full"),
    # carry groups cut over four DP ranks: Mamba-2 and GDN states and conv tails, attention K / V and MoE layers
    VerifyConfig(model="hybrid", pattern="MG*E", dp=4, budget=16, carry=True, carry_cut="always"),
]


@pytest.fixture(scope="module")
def ws1(request):
    return run_selected(request, "test_world_size_1", WS1, run_verify_many)


@pytest.fixture(scope="module")
def ws2(request):
    return run_selected(request, "test_world_size_2", WS2, run_verify_many)


@pytest.fixture(scope="module")
def ws4(request):
    return run_selected(request, "test_world_size_4", WS4, run_verify_many)


def _id(c: VerifyConfig) -> str:
    return format_report(c, {"tolerance": 0, "num_samples": 0, "flat_rows": 0, "tree_rows": 0, "loss_value": 0,
                             "passed": True, **{f"{m}{s}": 0 for m in ("logits", "loss", "grads", "params_after_step")
                                                for s in ("", "_ps")}}
                         ).splitlines()[0].split(": ", 1)[1]


def _cases(configs: list) -> list:
    return [pytest.param(i, id=_id(c), marks=[] if any(c is k for k in LATEST) else [pytest.mark.main_tier_only])
            for i, c in enumerate(configs)]


@pytest.mark.parametrize("i", _cases(WS1))
def test_world_size_1(ws1, i):
    check_verify(WS1[i], ws1[i])


@pytest.mark.parametrize("i", _cases(WS2))
def test_world_size_2(ws2, i):
    check_verify(WS2[i], ws2[i])
    if WS2[i].carry_cut == "always":  # carried state really crossed ranks
        assert ws2[i]["carry_syncs"] > 0 and ws2[i]["carry_cut_owners"] > 0, ws2[i]


@pytest.mark.parametrize("i", _cases(WS4))
def test_world_size_4(ws4, i):
    check_verify(WS4[i], ws4[i])
    if WS4[i].carry_cut == "always":
        assert ws4[i]["carry_syncs"] > 0 and ws4[i]["carry_cut_owners"] > 0, ws4[i]


def test_nonfinite_values_fail_and_are_named():
    """A NaN that is not the first item of a comparison, on either side, must fail (Python's ``max``
    drops it) and name where it is; the worst rank's location is what the report names."""
    import math

    import torch

    from megatron_tree.training.verify import _combine, _worst

    ok, nan = torch.ones(3), torch.tensor([1.0, float("nan"), 1.0])
    assert _worst([("a", ok, ok), ("b", ok, ok)]) == (0.0, "a")
    for tree, flat, side in ((nan, ok, "tree"), (ok, nan, "per-sample"), (nan, nan, "tree and per-sample")):
        err, at = _worst([("first", ok, ok), ("decoder.w", tree, flat), ("last", ok, 2 * ok)])
        assert err == math.inf and at == f"decoder.w (non-finite on the {side} side)"
    err, at = _worst([("first", ok, ok), ("inf", torch.tensor([1.0, math.inf, 1.0]), ok)])
    assert err == math.inf and at.startswith("inf (non-finite on the tree side")
    cfg = VerifyConfig()
    rank = {m: 0.0 for m in ("logits", "loss", "grads", "params_after_step")}
    rank.update(num_samples=1, tree_rows=1, flat_rows=1, loss_value=1.0)
    bad = dict(rank, grads=math.inf, grads_at="decoder.w (non-finite on the tree side)")
    out = _combine(cfg, [rank, bad])
    assert not out["passed"] and out["grads"] == math.inf
    report = format_report(cfg, out)
    assert "FAIL  (worst: decoder.w (non-finite on the tree side))" in report and report.endswith(
        "FAILED: tree training differs from per-sample training")


def test_cli_verify_exit_status(capsys):
    """`megatron-tree verify` exits 1 on an injected fault, naming the NaN parameter; 0 on a clean run."""
    from megatron_tree.cli import main

    assert main(["verify", "--families", "2", "--inject-fault", "nan"]) == 1
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.split()}
    # `_plant_nan` spoils the last parameter's gradient (hence the stepped parameter) and one logit
    for m in ("grads", "params_after_step"):
        assert "inf  FAIL  (worst: output_layer.weight (non-finite on the tree side))" in lines[m], out
    assert " FAIL  (worst: sample " in lines["logits"] and "non-finite on the tree side" in lines["logits"], out
    assert lines["loss"].split()[1:3] == ["0.000e+00", "ok"], out
    assert "FAILED" in out
    assert main(["verify", "--families", "2"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("PASSED: tree training equals per-sample training"), out
