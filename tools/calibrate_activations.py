"""Measure what a model keeps for backward per microbatch and write its activation profile.

    python tools/calibrate_activations.py --model hybrid --pattern 'MG*-*E' --out act.json
    megatron-tree plan --preset agent_multiturn --carry --max-tokens-per-mb 4096 --pattern 'MG*-*E' \
        --activation-profile act.json

Builds the model on one rank (CPU gloo; the GPU and its kernels when run on a GPU host), runs the
probe workload (`training.activations.calibration_workload`: whole trees and carry chains) one
schedule item at a time under saved-tensor hooks (`megatron.saved_bytes`), fits the per-kind
coefficients (`cp.planning.activations`), then predicts a second, held-out workload and prints the
largest relative error over its items. A profile holds per-layer coefficients per layer kind, so a
copy of a large model with one layer of each kind at its real widths is enough to calibrate it.
"""
from __future__ import annotations

import argparse
import json
import sys


def _body(cfg: dict):
    import torch

    from megatron_tree.cp.planning.activations import KIND_FEATURES
    from megatron_tree.training.activations import calibrate_activations, calibration_workload
    from megatron_tree.training.megatron_init import init_megatron
    from megatron_tree.training.models import ModelArgs, build_model, make_config, wrap_ddp

    ps = init_megatron(seed=cfg["seed"], kernels=True)
    dtype = getattr(torch, cfg["dtype"])
    margs = ModelArgs(kind=cfg["model"], num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"],
                      num_attention_heads=cfg["num_attention_heads"], num_query_groups=cfg["num_query_groups"],
                      ffn_hidden_size=cfg["ffn_hidden_size"], vocab_size=cfg["vocab_size"],
                      num_experts=cfg["num_experts"])
    if cfg["pattern"]:
        margs.pattern = cfg["pattern"]
    config = make_config(margs, dtype=dtype, recompute=cfg["recompute"])
    model = wrap_ddp(build_model(config, margs), config)
    about = {k: cfg[k] for k in ("model", "pattern", "hidden_size", "dtype", "recompute")}
    vocab = cfg["vocab_size"] - 1
    profile, measured = calibrate_activations(model, calibration_workload(cfg["seed"], vocab_size=vocab,
                                                                          scale=cfg["scale"]),
                                              about=about, loss_type="sft")
    _, held = calibrate_activations(model, calibration_workload(cfg["seed"] + 1, vocab_size=vocab, scale=cfg["scale"]),
                                    loss_type="sft")
    worst = []
    for phase, f, by_kind in held:
        if phase == "fill":
            continue
        got = sum(by_kind.values())
        pred = profile.predict_features(f)
        worst.append((abs(pred - got) / got, phase, f["n"], f["c"], got, pred))
    ps.destroy_model_parallel()
    assert set(profile.coef) <= set(KIND_FEATURES)
    return profile, len(measured), max(worst)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="hybrid", choices=["gpt", "hybrid", "mamba", "qwen3next", "mla"])
    ap.add_argument("--pattern", default=None, help="hybrid / mamba layer letters (default: the model's)")
    ap.add_argument("--num-layers", type=int, default=2, help="gpt / mla / qwen3next layers (default 2)")
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--num-query-groups", type=int, default=2)
    ap.add_argument("--ffn-hidden-size", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=256)
    ap.add_argument("--num-experts", type=int, default=None)
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--scale", type=int, default=1, help="multiply the probe lengths and budgets (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="the profile JSON to write")
    args = ap.parse_args(argv)
    from megatron_tree.training.launch import run_distributed

    cfg = {k: getattr(args, k) for k in ("model", "pattern", "num_layers", "hidden_size", "num_attention_heads",
                                          "num_query_groups", "ffn_hidden_size", "vocab_size", "num_experts",
                                          "recompute", "dtype", "scale", "seed")}
    profile, n, (err, phase, rows, carried, got, pred) = run_distributed(_body, 1, cfg, timeout=3600)[0]
    profile.to_json(args.out)
    print(f"activation profile of {args.model} ({profile.pattern}, {args.dtype}, recompute {args.recompute}) from "
          f"{n} schedule items -> {args.out}")
    print(json.dumps(profile.coef, indent=1, sort_keys=True))
    print(f"held-out workload: largest error {err:.1%} ({phase}, {rows} rows, {carried} carried: measured {got:,} B, "
          f"predicted {pred:,.0f} B)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
