"""Activation bytes kept for backward per schedule item (issue 25 point 4): predicted vs measured.

The meter (`megatron.saved_bytes.SavedBytes`) counts what autograd's saved-tensor hooks see, once per
storage, parameters excluded: device independent. It is checked first against a hand count. Then per
model family a profile is fitted on one probe workload (`training.activations.calibration_workload`,
whole trees and carry chains) and must predict every run / restore item of another workload (other
samples, lengths, budgets and carry cuts) within 10% of what the meter counts; a fill keeps nothing.
"""
from __future__ import annotations

import json

import pytest
import torch

from dist import run_distributed

#: families and recompute modes: every layer kind (* G M - E) and the three recompute settings
CASES = [dict(kind="hybrid", pattern="MG*E", recompute="none"),
         dict(kind="mamba", pattern="M*-E", recompute="selective"),
         dict(kind="gpt", recompute="full")]


def test_meter_counts_each_saved_storage_once_without_parameters_or_backward_recomputation():
    from torch.utils.checkpoint import checkpoint

    from megatron_tree.megatron.saved_bytes import SavedBytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU())
    x = torch.randn(8, 16, requires_grad=True)
    meter = SavedBytes(model)
    with meter:
        y = model(x)
        z = (y[:, :4] * y[:, :4]).sum()  # a view of y: its storage is counted once
    # Linear saves its input x (8 x 16 fp32), ReLU its output y (8 x 32), the product the view of y
    assert meter.total == 8 * 16 * 4 + 8 * 32 * 4, meter.by_kind
    assert set(meter.by_kind) == {"model"}
    meter.reset()
    with meter:  # a checkpointed block (Megatron's is reentrant too) keeps its input only; the recomputation
        w = checkpoint(model, x, use_reentrant=True).sum()  # inside the backward is not counted
        w.backward()
        z.backward()
    assert meter.total == 8 * 16 * 4 and x.grad is not None, meter.by_kind


def _body(cases, profile_path):
    from megatron.core import parallel_state as ps

    from dist import init_megatron
    from megatron_tree.training.activations import calibrate_activations, calibration_workload
    from megatron_tree.training.models import ModelArgs, build_model, make_config, wrap_ddp

    out = []
    for i, case in enumerate(cases):
        init_megatron(seed=7, kernels=True)
        margs = ModelArgs(kind=case["kind"], num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=128, vocab_size=256)
        if "pattern" in case:
            margs.pattern = case["pattern"]
        config = make_config(margs, dtype=torch.float32, recompute=case["recompute"])
        model = wrap_ddp(build_model(config, margs), config)
        profile, fitted = calibrate_activations(model, calibration_workload(0, vocab_size=200), loss_type="sft")
        _, held = calibrate_activations(model, calibration_workload(1, vocab_size=200), loss_type="sft")
        if i == 0:
            profile.about = dict(case)
            profile.to_json(profile_path)
        items = [(phase, f["n"], f["c"], sum(by.values()), profile.predict_features(f) if phase != "fill" else 0)
                 for phase, f, by in held]
        out.append(dict(pattern=profile.pattern, items=items, fitted=len(fitted)))
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    path = tmp_path_factory.mktemp("act") / "profile.json"
    return run_distributed(_body, 1, CASES, str(path), timeout=900)[0], path


@pytest.mark.parametrize("k", range(len(CASES)))
def test_profile_predicts_held_out_items_within_ten_percent(measured, k):
    res = measured[0][k]
    items = res["items"]
    phases = {p for p, *_ in items}
    assert phases == {"fill", "run", "restore"}, phases  # the held-out step carries (and has whole trees)
    assert any(c > 0 for p, _, c, _, _ in items if p != "fill")  # carry readers among them
    for phase, n, c, got, pred in items:
        if phase == "fill":  # a fill runs without autograd
            assert got == 0 and pred == 0, (phase, n, c, got)
        else:
            assert got > 0 and abs(pred - got) <= 0.10 * got, (CASES[k], phase, n, c, got, pred)
    worst = max(abs(pred - got) / got for phase, _, _, got, pred in items if phase != "fill")
    print(f"\n{CASES[k]} ({res['pattern']}): {len(items)} held-out items, worst prediction error {worst:.2%}")


def test_plan_carry_prints_the_activations_of_every_item(measured, capsys):
    from megatron_tree.cli import main

    path = measured[1]
    assert json.loads(path.read_text())["pattern"] == "MG*E"
    rc = main(["plan", "--preset", "agent_multiturn", "--scale", "0.1", "--carry", "--max-tokens-per-mb", "128",
               "--pattern", "MG*E", "--activation-profile", str(path)])
    out = capsys.readouterr().out
    assert rc == 0 and "act MiB" in out and "store + activations peak" in out, out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["0"] and len(line.split()) == 13]
    assert rows and all((r[3] == "fill") == (float(r[12]) == 0.0) for r in rows), rows
    assert main(["plan", "--preset", "agent_multiturn", "--carry", "--max-tokens-per-mb", "128",
                 "--activation-profile", str(path) + ".missing"]) == 2
