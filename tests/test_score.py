"""``megatron-tree score`` against the **stock** Megatron-Core ``GPTModel`` run on each record alone.

A tiny GPT is trained for two steps with ``megatron-tree train`` (checkpoints after steps 1 and 2).
Records: a GRPO-like group (one prompt, six completions, prompt tokens loss-masked), a duplicate of
one completion, a record with no mask (every token after the first a target) and one with no target
at all. Scoring runs through the CLI on 2 gloo ranks (DP 2, a budget larger than training's), and
through `training.score.score` in one more 2-rank spawn under TP 2 with ``--all-tokens`` (loading
an ``iter_XXXXXXX`` directory), tree CP 2 and PP 2. Oracle: Megatron-Core's own ``GPTModel`` (local
block spec, float64) loaded from the same checkpoint and run per record; log_softmax and the entropy
``-(softmax * log_softmax).sum()`` with plain torch. Every output row (input order, record index,
lists aligned with the targets) must equal it in float64. ``train``'s logged mean entropy of step 2
(float32) must equal the stock mean entropy under the step-1 checkpoint (the weights step 2 ran with).
Planted fault: the values written one scored token off must fail the comparison. Errors, before any
rank starts: a record longer than ``--max-tokens-per-mb`` (named by
``file:line``), model flags that differ from the checkpoint's.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

try:
    from dist import run_distributed
except ImportError:  # run from the repository root as tests.*
    from tests.dist import run_distributed

V = 128
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", str(V)]
MOE = MODEL + ["--num-experts", "4", "--moe-ffn-hidden-size", "16"]  # every layer MoE, top-2
F64 = dict(rtol=1e-10, atol=1e-10)
# name -> extra score flags and the checkpoint step they load (run in one 2-rank spawn)
SPAWN_CASES = {
    "tp2_all_tokens": (["--tensor-model-parallel-size", "2", "--all-tokens"], 1),
    "cp2": (["--context-parallel-size", "2"], 2),
    "pp2": (["--pipeline-model-parallel-size", "2", "--max-tokens-per-mb", "32"], 2),
}


def _records():
    rng = np.random.default_rng(3)
    prompt = rng.integers(1, V, 12).tolist()
    recs = []
    for _ in range(6):
        comp = rng.integers(1, V, int(rng.integers(3, 10))).tolist()
        recs.append({"tokens": prompt + comp, "loss_mask": [False] * len(prompt) + [True] * len(comp)})
    recs.append(json.loads(json.dumps(recs[2])))  # a duplicated record
    recs.append({"tokens": rng.integers(1, V, 9).tolist()})  # no mask: every token after the first
    recs.append({"tokens": [5, 6, 7], "loss_mask": [False, False, False]})  # nothing to score
    return recs


def _targets(rec, all_tokens: bool) -> np.ndarray:
    n = len(rec["tokens"])
    if all_tokens or "loss_mask" not in rec:
        return np.arange(1, n)
    return np.flatnonzero(rec["loss_mask"])


def _route_records():
    """Records with routed_experts ([tokens][2 MoE layers][top-2 of 4]): a shared prompt whose routes
    agree for records 0-2, differ at one prompt token for record 3; record 4 repeats record 1."""
    rng = np.random.default_rng(5)

    def routes(n):
        return np.stack([np.stack([rng.permutation(4)[:2] for _ in range(2)]) for _ in range(n)])

    prompt, proutes = rng.integers(1, V, 10).tolist(), routes(10)
    recs = []
    for k in range(4):
        comp = rng.integers(1, V, 4 + k).tolist()
        r = np.concatenate([proutes, routes(len(comp))])
        if k == 3:
            r = r.copy()
            r[6, 1] = (r[6, 1] + 1) % 4  # one prompt token routed elsewhere in one layer
        recs.append({"tokens": prompt + comp, "loss_mask": [False] * 10 + [True] * len(comp),
                     "routed_experts": r.tolist()})
    recs.append(json.loads(json.dumps(recs[1])))
    return recs


def _replay_cases(data: str, outdir: str) -> dict:
    """A MoE checkpoint (O(1) random weights, saved with dist_checkpointing), then score with routing
    replay (tree and flat packing) and without."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_tree.training import score as sc
    from megatron_tree.training.models import build_model, make_config
    from megatron_tree.training.trainer import _model_args, init_parallel
    from per_sample import randomize

    ckpt = os.path.join(outdir, "moe_ckpt")
    base = MOE + ["--load", ckpt, "--data", data, "--dtype", "float64", "--quiet"]
    args = sc.check_score_args(sc.build_score_parser().parse_args(base + ["--out", "unused.parquet"]))
    init_parallel(args)
    margs = _model_args(args)
    model = build_model(make_config(margs, dtype=torch.float64), margs)
    randomize(model, seed=3)
    if dist.get_rank() == 0:
        os.makedirs(ckpt)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict()}, ckpt)
    ps.destroy_model_parallel()
    res = {}
    for name, extra in (("replay_tree", ["--routing-replay"]), ("replay_flat", ["--routing-replay", "--packing", "flat"]),
                        ("no_replay", [])):
        out = os.path.join(outdir, f"{name}.parquet")
        res[name] = (out, sc.score(sc.build_score_parser().parse_args(base + ["--out", out] + extra)))
    return res


def _stock_oracle(ckpt_root: str, records: list) -> dict:
    """{step: [(logprobs [L-1], entropy [L-1]) per record]} of stock GPTModel per record, float64
    (index t-1 predicts token t)."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4,
                            ffn_hidden_size=128, params_dtype=torch.float64, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm", add_bias_linear=False,
                            bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
                            apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
    stock = GPTModel(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm"),
                     vocab_size=V, max_sequence_length=64, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False).to(torch.float64)
    out = {}
    for step in (1, 2):
        loaded = dist_checkpointing.load({"model": stock.sharded_state_dict()},
                                         os.path.join(ckpt_root, f"iter_{step:07d}"))
        stock.load_state_dict(loaded["model"])
        rows = []
        with torch.no_grad():
            for rec in records:
                x = torch.tensor(rec["tokens"])
                logits = stock(x[None], torch.arange(len(x))[None], None)[0].double()
                logp = torch.log_softmax(logits, -1)
                ent = -(torch.softmax(logits, -1) * logp).sum(-1)
                rows.append((logp[torch.arange(len(x) - 1), x[1:]], ent[:-1]))
        out[step] = rows
    return out


def _spawn_body(ckpt_root: str, data: str, outdir: str, route_data: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tree.training import score as sc

    res = {}
    for name, (extra, step) in list(SPAWN_CASES.items()) + [("fault", (["--all-tokens"], 2))]:
        sc._FAULT = "occurrence_shift" if name == "fault" else None
        args = sc.build_score_parser().parse_args(
            MODEL + ["--load", os.path.join(ckpt_root, f"iter_{step:07d}"), "--data", data, "--dtype", "float64",
                     "--out", os.path.join(outdir, f"{name}.parquet"), "--quiet"] + extra)
        res[name] = sc.score(args)
    sc._FAULT = None
    torch.set_default_dtype(torch.float64)
    res["replay"] = _replay_cases(route_data, outdir)
    ps.initialize_model_parallel()  # dist_checkpointing.load is collective: both ranks run the oracle
    model_parallel_cuda_manual_seed(1)
    with open(data) as f:
        records = [json.loads(line) for line in f]
    res["oracle"] = _stock_oracle(ckpt_root, records)
    ps.destroy_model_parallel()
    return res if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megatron_tree import cli

    d = tmp_path_factory.mktemp("score")
    data = str(d / "records.jsonl")
    records = _records()
    with open(data, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    ckpt, metrics = str(d / "ckpt"), str(d / "metrics.json")
    rc = cli.main(["train", *MODEL, "--tree-data-path", data, "--tree-global-batch-samples", str(len(records)),
                   "--train-iters", "2", "--lr", "0.05", "--save", ckpt, "--save-interval", "1", "--quiet",
                   "--metrics-json", metrics])
    assert rc == 0
    out_dp2 = str(d / "dp2.parquet")
    rc = cli.main(["score", *MODEL, "--load", ckpt, "--data", data, "--out", out_dp2, "--nproc", "2",
                   "--dtype", "float64", "--max-tokens-per-mb", "256", "--quiet"])
    assert rc == 0
    route_data = str(d / "routed.jsonl")
    with open(route_data, "w") as f:
        for r in _route_records():
            f.write(json.dumps(r) + "\n")
    spawned = run_distributed(_spawn_body, 2, ckpt, data, str(d), route_data, timeout=400)[0]
    with open(metrics) as f:
        history = json.load(f)["history"]
    return dict(dir=d, data=data, ckpt=ckpt, route_data=route_data, records=records, history=history, spawned=spawned,
                outs={"dp2": (out_dp2, 2, False), **{n: (str(d / f"{n}.parquet"), step, "--all-tokens" in extra)
                                                     for n, (extra, step) in SPAWN_CASES.items()}})


def _read(path):
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    return t.column_names, t.to_pylist()


@pytest.mark.parametrize("name", ["dp2", *SPAWN_CASES])
def test_score_equals_stock_per_record(run, name):
    path, step, all_tokens = run["outs"][name]
    cols, rows = _read(path)
    assert cols == ["record", "logprobs", "entropy"]
    assert [r["record"] for r in rows] == list(range(len(run["records"])))  # one row per record, input order
    oracle = run["spawned"]["oracle"][step]
    for rec, row, (lp, ent) in zip(run["records"], rows, oracle):
        t = torch.as_tensor(_targets(rec, all_tokens))
        assert len(row["logprobs"]) == len(row["entropy"]) == len(t)
        torch.testing.assert_close(torch.tensor(row["logprobs"], dtype=torch.float64), lp[t - 1], **F64)
        torch.testing.assert_close(torch.tensor(row["entropy"], dtype=torch.float64), ent[t - 1], **F64)
    assert rows[2] == {**rows[6], "record": 2}  # the duplicated record: the same lists
    if not all_tokens:
        assert rows[8]["logprobs"] == [] == rows[8]["entropy"]  # no target: empty lists, row kept


def test_planted_fault_one_token_off_fails(run):
    """The comparison above catches values written one scored token off."""
    _, rows = _read(str(run["dir"] / "fault.parquet"))
    oracle = run["spawned"]["oracle"][2]
    errs = [float((torch.tensor(row["entropy"], dtype=torch.float64) - ent).abs().max())
            for row, (_, ent) in zip(rows, oracle)]
    assert max(errs) > 1e-3


def test_tree_sharing_really_happened(run):
    for name in SPAWN_CASES:
        r = run["spawned"][name]
        assert r["tree_rows"] < r["flat_tokens"] and r["records"] == len(run["records"])


def test_train_logs_mean_entropy(run):
    """Step 2 ran with the weights of checkpoint 1: its logged mean entropy over the loss-masked targets
    (float32 model) equals the stock model's (float64) under that checkpoint."""
    oracle = run["spawned"]["oracle"][1]
    ents = torch.cat([ent[torch.as_tensor(_targets(rec, False)) - 1] for rec, (_, ent) in zip(run["records"], oracle)])
    h = run["history"][1]
    assert h["num_targets"] == len(ents)
    assert abs(h["entropy"] - float(ents.mean())) < 1e-5 * float(ents.mean())


def test_record_longer_than_budget_is_an_error(run, capsys):
    from megatron_tree import cli

    rc = cli.main(["score", *MODEL, "--load", run["ckpt"], "--data", run["data"], "--out", str(run["dir"] / "x.parquet"),
                   "--max-tokens-per-mb", "16"])
    err = capsys.readouterr().err
    assert rc == 2
    n = len(run["records"][0]["tokens"])
    assert n > 16 and f"{run['data']}:1: record 0 has {n} tokens, more than --max-tokens-per-mb 16" in err
    assert "never truncates" in err and not os.path.exists(run["dir"] / "x.parquet")


def test_model_flags_must_match_the_checkpoint(run, capsys):
    from megatron_tree import cli

    flags = [f if f != "32" else "48" for f in MODEL]
    rc = cli.main(["score", *flags, "--load", run["ckpt"], "--data", run["data"], "--out", str(run["dir"] / "y.parquet")])
    err = capsys.readouterr().err
    assert rc == 2 and "--hidden-size: checkpoint 32, here 48" in err


def test_swiglu_and_rotary_base_flags_reach_the_config():
    """Megatron-LM's --swiglu (gated linear unit with SiLU) and --rotary-base, in train's and score's model
    flags; their defaults leave the model as it was (GeLU, base 10000)."""
    import torch.nn.functional as F

    from megatron_tree.training.models import make_config
    from megatron_tree.training.score import build_score_parser
    from megatron_tree.training.trainer import _model_args, fill_model_defaults

    def margs(*extra):
        args = build_score_parser().parse_args([*MODEL, "--load", "x", "--data", "y", "--out", "z.parquet", *extra])
        args.tree_hybrid_pattern = None
        args.tree_max_tokens_per_mb = 64
        return _model_args(fill_model_defaults(args))

    plain, glu = margs(), margs("--swiglu", "--rotary-base", "500000")
    assert plain.rotary_base == 10000 and glu.rotary_base == 500000
    assert not make_config(plain).gated_linear_unit
    cfg = make_config(glu)
    assert cfg.gated_linear_unit and cfg.activation_func is F.silu


def test_checkpoint_tensors_must_be_the_models(run):
    """A checkpoint holding other tensors than the model's (a bias, a missing output layer, another
    shape) is refused naming each; optimizer state is not the model's. The real case (a Megatron-LM
    checkpoint scored without --swiglu) runs in tests/test_launch_lm.py."""
    from megatron.core import dist_checkpointing

    from megatron_tree.training.score import CheckpointMismatch, check_checkpoint_tensors, resolve_checkpoint

    path = resolve_checkpoint(run["ckpt"])
    stored = {k: tuple(v.global_shape) for k, v in dist_checkpointing.load_tensors_metadata(path).items()}
    model = {k: v for k, v in stored.items() if not k.startswith("optimizer.")}
    assert "output_layer.weight" in model and len(model) < len(stored)
    check_checkpoint_tensors(path, model)  # exactly the model's tensors: accepted
    wrong = dict(model)
    del wrong["output_layer.weight"]  # the checkpoint has a tensor the model lacks (e.g. untied vs tied)
    fc1 = next(k for k in model if k.endswith("linear_fc1.weight"))
    wrong[fc1] = (model[fc1][0] * 2,) + model[fc1][1:]
    wrong["decoder.layers.0.mlp.linear_fc2.bias"] = (32,)  # the model has a bias the checkpoint lacks
    with pytest.raises(CheckpointMismatch) as e:
        check_checkpoint_tensors(path, wrong)
    msg = str(e.value)
    assert "not in the checkpoint: decoder.layers.0.mlp.linear_fc2.bias" in msg
    assert "in the checkpoint, not in the model: output_layer.weight" in msg
    assert f"{fc1}: checkpoint {list(model[fc1])}, model {list(wrong[fc1])}" in msg and "--swiglu" in msg


def test_resolve_checkpoint_finds_train_and_megatron_lm_layouts(tmp_path):
    from megatron_tree.training.score import resolve_checkpoint

    ours, lm, one = tmp_path / "ours", tmp_path / "lm", tmp_path / "lm" / "iter_0000007"
    for d in (ours / "iter_0000003", one):
        d.mkdir(parents=True)
        (d / "metadata.json").write_text("{}")
    (ours / "latest").write_text("3\n")
    (lm / "latest_checkpointed_iteration.txt").write_text("7")
    assert resolve_checkpoint(str(ours)) == str(ours / "iter_0000003")
    assert resolve_checkpoint(str(lm)) == str(one)
    assert resolve_checkpoint(str(one)) == str(one)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no checkpoint there"):
        resolve_checkpoint(str(tmp_path / "empty"))
    (lm / "latest_checkpointed_iteration.txt").write_text("9")
    with pytest.raises(ValueError, match="names '9', but .*iter_0000009 is missing"):
        resolve_checkpoint(str(lm))
    (lm / "iter_0000009" / "mp_rank_00").mkdir(parents=True)  # --ckpt-format torch
    with pytest.raises(ValueError, match="not a distributed checkpoint"):
        resolve_checkpoint(str(lm))


def test_routing_replay_scores(run):
    """Tree packing with replay (rows shared only where tokens and routes agree) equals every record
    scored alone with its own routes (flat packing, the same replay), float64; replay is in effect
    (other values than the model's own routing); the routes cost rows against token-only sharing."""
    rep = run["spawned"]["replay"]
    (tree_path, tree), (flat_path, flat), (free_path, free) = rep["replay_tree"], rep["replay_flat"], rep["no_replay"]
    _, t_rows = _read(tree_path)
    _, f_rows = _read(flat_path)
    _, n_rows = _read(free_path)
    assert [r["record"] for r in t_rows] == list(range(5))
    moved = 0.0
    for a, b, c in zip(t_rows, f_rows, n_rows):
        for k in ("logprobs", "entropy"):
            torch.testing.assert_close(torch.tensor(a[k]), torch.tensor(b[k]), rtol=1e-9, atol=1e-9)
            moved = max(moved, float((torch.tensor(a[k]) - torch.tensor(c[k])).abs().max()))
    assert moved > 1e-3
    assert t_rows[1] == {**t_rows[4], "record": 1}
    assert free["tree_rows"] < tree["tree_rows"] < flat["tree_rows"] == flat["flat_tokens"]


def test_routing_replay_record_without_routes_is_an_error(run, capsys):
    from megatron_tree import cli

    path = run["dir"] / "unrouted.jsonl"
    lines = open(run["route_data"]).read().splitlines()
    rec = json.loads(lines[2])
    del rec["routed_experts"]
    path.write_text("\n".join(lines[:2] + [json.dumps(rec)] + lines[3:]) + "\n")
    rc = cli.main(["score", *MOE, "--routing-replay", "--load", run["ckpt"], "--data", str(path),
                   "--out", str(run["dir"] / "z.parquet")])
    err = capsys.readouterr().err
    assert rc == 2 and f"{path}:3: record 2 has no routed_experts" in err
