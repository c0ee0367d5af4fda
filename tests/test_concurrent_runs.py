"""Runs that share a machine never collide on a port (no port is chosen before it is bound).

Eight single-process ``megatron-tree score`` runs and four 2-rank ``megatron-tree train --nproc 2`` runs
start at once, each as its own command, as an RL loop's scoring calls and other users' jobs do on one
node. Before, each picked a "free" port with a probe socket and bound it later (the launcher's store,
a lone ``score``'s ``MASTER_PORT``), so one in N failed with EADDRINUSE; now a world of one forms on an
in-process store and the launcher binds its store on port 0 before its ranks start. Every run must
succeed and compute what the same run computes alone: the eight scores (of the checkpoint a first,
lone training saved) are the same log-probs, the four trainings the lone training's losses.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--vocab-size", "64"]
SCORES, TRAINS = 8, 4


def _records(path):
    rng = np.random.default_rng(3)
    with open(path, "w") as f:
        for g in range(3):
            prompt = rng.integers(1, 64, 6).tolist()
            for _ in range(3):
                f.write(json.dumps({"tokens": prompt + rng.integers(1, 64, 4).tolist()}) + "\n")
    return str(path)


def test_eight_scores_and_four_two_rank_trainings_at_once(tmp_path):
    data = _records(tmp_path / "records.jsonl")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "megatron_tree"]

    def train(i, *extra):
        return subprocess.Popen(
            cmd + ["train", *MODEL, "--nproc", "2", "--tree-data-path", data, "--tree-global-batch-samples", "9",
                   "--train-iters", "2", "--lr", "0.01", "--seed", "5", "--quiet",
                   "--metrics-json", str(tmp_path / f"t{i}.json"), *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    ckpt = str(tmp_path / "ckpt")
    alone = train("alone", "--save", ckpt, "--save-interval", "2")
    out, _ = alone.communicate(timeout=900)
    assert alone.returncode == 0, out[-3000:]
    procs = []
    for i in range(SCORES):
        procs.append(("score", i, subprocess.Popen(
            cmd + ["score", *MODEL, "--load", ckpt, "--data", data, "--out", str(tmp_path / f"s{i}.parquet"),
                   "--dtype", "float64",
                   "--quiet"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for i in range(TRAINS):
        procs.append(("train", i, train(i)))
    failed = []
    for kind, i, p in procs:
        out, _ = p.communicate(timeout=900)
        if p.returncode != 0:
            failed.append(f"{kind} {i} (rc {p.returncode}):\n{out[-3000:]}")
    assert not failed, "\n".join(failed)

    import pyarrow.parquet as pq

    scores = [pq.read_table(tmp_path / f"s{i}.parquet").to_pylist() for i in range(SCORES)]
    assert len(scores[0]) == 9 and all(len(r["logprobs"]) == 9 for r in scores[0])
    assert all(s == scores[0] for s in scores[1:])
    losses = []
    for i in ["alone", *range(TRAINS)]:
        with open(tmp_path / f"t{i}.json") as f:
            losses.append([h["loss"] for h in json.load(f)["history"]])
    assert len(losses[0]) == 2 and all(np.isfinite(losses[0]))
    assert all(l == losses[0] for l in losses[1:])
