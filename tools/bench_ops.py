"""All single-device op benchmarks (issue: tree ops) in one run, one JSON summary.

    .venv/bin/python tools/bench_ops.py [--quick] [--json out.json]

Runs tools/bench_ops_attention.py (tree attention vs per-sample SDPA, peak memory vs N),
tools/bench_ops_gdn.py (tree GDN vs per-sample chunked GDN) and tools/bench_ops_ssd.py (tree SSD
and tree conv vs per-sample), each measured tree vs flat in the same process on the same input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_ops_attention  # noqa: E402
import bench_ops_gdn  # noqa: E402
import bench_ops_ssd  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = {}
    for name, mod in (("attention", bench_ops_attention), ("gated_delta_rule", bench_ops_gdn), ("ssd", bench_ops_ssd)):
        print(f"== {name}", flush=True)
        out[name] = mod.run(quick=args.quick)
        print(json.dumps(out[name], indent=1, default=str)[:3000], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
