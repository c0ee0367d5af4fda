"""Scoring throughput, tree vs flat packing (``megatron-tree score``), measured in one run on CPU.

A small GPT is trained for one step with ``megatron-tree train`` (its checkpoint is what both sides
load), then, in one set of ``--nproc`` gloo ranks, ``training.score.score`` scores the same records
with ``--packing tree`` (prefixes shared across all records) and ``--packing flat`` (every record its
own chain, same budget), alternating, ``--repeats`` times each. Reported per preset: records, flat
tokens, tree rows, microbatches, the forward seconds (best of the repeats: the host is shared and
noisy; slowest rank; reading, packing and
writing excluded) and records/s of both sides, and their ratio. Both sides' outputs are checked to
agree (float32 rounding) so the figure compares equal work.

    .venv/bin/python tools/bench_score.py                                  # both presets below
    .venv/bin/python tools/bench_score.py --presets agent_multiturn --repeats 3 --nproc 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_tree.data.synthetic import make_preset  # noqa: E402

DEFAULT_PRESETS = {"varied_5k_16x100": 0.2, "agent_multiturn": 1.0}  # preset -> length scale


def _write_jsonl(path: str, samples) -> None:
    with open(path, "w") as f:
        for s in samples:
            f.write(json.dumps({"tokens": s.tokens.tolist(), "loss_mask": s.target_mask().tolist()}) + "\n")


def _body(model_flags, ckpt, data, outdir, repeats):
    import pyarrow.parquet as pq

    from megatron_tree.training import score as sc

    res = {}
    for r in range(repeats):
        for packing in ("tree", "flat"):
            out = os.path.join(outdir, f"{packing}.parquet")
            args = sc.build_score_parser().parse_args(model_flags + ["--load", ckpt, "--data", data, "--out", out,
                                                                     "--packing", packing, "--quiet"])
            res.setdefault(packing, []).append(sc.score(args))
    tree = pq.read_table(os.path.join(outdir, "tree.parquet")).to_pydict()
    flat = pq.read_table(os.path.join(outdir, "flat.parquet")).to_pydict()
    diff = max((float(np.max(np.abs(np.subtract(a, b)))) for a, b in zip(tree["logprobs"], flat["logprobs"]) if a),
               default=0.0)
    return res, diff


def main(argv=None) -> int:
    from megatron_tree import cli
    from megatron_tree.training.launch import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default=",".join(DEFAULT_PRESETS), help="comma-separated preset names")
    ap.add_argument("--scale", type=float, default=None, help="length scale for every preset (default per preset)")
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--max-tokens-per-mb", type=int, default=2048)
    ap.add_argument("--nproc", type=int, default=1, help="DP ranks of the scoring runs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    model = ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size), "--vocab-size", str(a.vocab_size),
             "--max-tokens-per-mb", str(a.max_tokens_per_mb)]
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in a.presets.split(","):
            scale = a.scale if a.scale is not None else DEFAULT_PRESETS.get(preset, 1.0)
            samples = make_preset(preset, seed=0, vocab=a.vocab_size, scale=scale)
            d = os.path.join(tmp, preset)
            os.makedirs(d)
            data = os.path.join(d, "records.jsonl")
            _write_jsonl(data, samples)
            ckpt = os.path.join(d, "ckpt")
            train_model = [f if f != "--max-tokens-per-mb" else "--tree-max-tokens-per-mb" for f in model]
            rc = cli.main(["train", *train_model, "--tree-data-path", data, "--tree-global-batch-samples",
                           str(len(samples)), "--train-iters", "1", "--save", ckpt, "--quiet"])
            if rc:
                return rc
            res, diff = run_distributed(_body, a.nproc, model, ckpt, data, d, a.repeats, timeout=3600)[0]
            t = {k: float(np.min([r["seconds"] for r in v])) for k, v in res.items()}
            r0 = res["tree"][0]
            fig = dict(preset=preset, scale=scale, records=r0["records"], flat_tokens=r0["flat_tokens"],
                       tree_rows=r0["tree_rows"], tree_microbatches=r0["microbatches"],
                       flat_microbatches=res["flat"][0]["microbatches"], tree_s=t["tree"], flat_s=t["flat"],
                       tree_records_per_s=r0["records"] / t["tree"], flat_records_per_s=r0["records"] / t["flat"],
                       speedup=t["flat"] / t["tree"], max_logprob_diff=diff, nproc=a.nproc,
                       seconds_each={k: [r["seconds"] for r in v] for k, v in res.items()})
            figures[preset] = fig
            print(f"{preset} (scale {scale}): {fig['records']} records, {fig['flat_tokens']:,} tokens -> "
                  f"{fig['tree_rows']:,} tree rows ({fig['flat_tokens'] / fig['tree_rows']:.2f}x); microbatches tree "
                  f"{fig['tree_microbatches']} / flat {fig['flat_microbatches']}; forward tree {fig['tree_s']:.3f}s "
                  f"({fig['tree_records_per_s']:,.1f} records/s) vs flat {fig['flat_s']:.3f}s "
                  f"({fig['flat_records_per_s']:,.1f} records/s): tree/flat throughput {fig['speedup']:.2f}x "
                  f"(max |logprob diff| {diff:.1e})", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
