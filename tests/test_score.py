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

Every model family (`FAMILIES`: GPT, our hybrid stack with M G * - E layers, MambaModel, Qwen3-Next with
MoE, MLA, DSA; MTP where the installed Megatron-Core runs it) is trained for two steps by ``train`` in
the same spawn; its step-1 checkpoint is scored in float64 with all records together (tree packing) and
with each record alone (flat packing, one record per microbatch), MoE families also under EP 2: they
must agree to 1e-10, and the mean -log-prob must equal the loss train logged for step 2 (two planted
faults). A Megatron-LM-layout checkpoint whose saved args differ in two numerics arguments is refused
naming both before ranks start; the rotary flags reach the model.
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
    # the vocabulary split over TP ranks: each rank's shard top-k, the global top-k from the candidates
    "tp2_top_k": (["--tensor-model-parallel-size", "2", "--top-k", str(8)], 2),
}
TOP_K = 8


def _has_mamba_mtp() -> bool:
    from megatron_tree.compat.mtp import hybrid_has_mtp

    return hybrid_has_mtp()


def _has_dsa_mtp() -> bool:
    from megatron_tree.compat.dsa import stock_dsa_mtp_runs

    return stock_dsa_mtp_runs()


def _family_cases() -> dict:
    """name -> (model flags, score's extra layout flags): every model family ``megatron-tree train`` builds,
    tiny, with MTP where this Megatron-Core runs it (MambaModel's and DSA's MTP: megatron-core >= 0.19).
    DSA + MTP scores under TP 2 (DP 1): a padding microbatch, which DP 2 adds to even out the ranks,
    is refused by the tree MTP layer's tail-row check (`megatron.mtp.tree_mtp_postprocess`)."""
    fam = ["--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", str(V)]
    moe = ["--num-experts", "4"]
    mamba = ["--model-family", "mamba", "--hybrid-override-pattern", "M*-E"] + moe
    dsa = ["--experimental-attention-variant", "dsa", "--num-layers", "2"]
    mtp1 = ["--mtp-num-layers", "1"]
    cases = {
        "gpt_mtp": (fam + ["--num-layers", "2"] + mtp1, []),
        "hybrid_MG*-E": (fam + ["--hybrid-override-pattern", "MG*-E"] + moe, []),
        "qwen3next_moe_mtp": (fam + ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq",
                                     "2", "--num-layers", "2"] + moe + mtp1, []),
        "mla_mtp": (fam + ["--multi-latent-attention", "--num-layers", "2"] + mtp1, []),
    }
    if _has_mamba_mtp():
        cases["mamba_M*-E_mtp"] = (fam + mamba + mtp1 + ["--mtp-pattern", "M*"], [])
    else:
        cases["mamba_M*-E"] = (fam + mamba, [])
    if _has_dsa_mtp():
        cases["dsa_mtp"] = (fam + dsa + mtp1, ["--tensor-model-parallel-size", "2"])
    else:
        cases["dsa"] = (fam + dsa, [])
    return cases


FAMILIES = _family_cases()
MOE_FAMILIES = sorted(n for n, (flags, _) in FAMILIES.items() if "--num-experts" in flags)
# scoring each record alone: flat packing (no prefix shared) under a budget no two records fit in
# together (every family record is 13..24 tokens), so each microbatch holds exactly one record
ALONE = ["--packing", "flat", "--max-tokens-per-mb", "24"]


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


def _family_records():
    """A GRPO-like group (a 12-token prompt, loss-masked, and five completions), a record without a mask
    and one with no target: 13..24 tokens each (`ALONE` scores them one per microbatch)."""
    rng = np.random.default_rng(11)
    prompt = rng.integers(1, V, 12).tolist()
    recs = []
    for _ in range(5):
        comp = rng.integers(1, V, int(rng.integers(2, 12))).tolist()
        recs.append({"tokens": prompt + comp, "loss_mask": [False] * 12 + [True] * len(comp)})
    recs.append({"tokens": rng.integers(1, V, 17).tolist()})
    recs.append({"tokens": prompt + [3], "loss_mask": [False] * 13})
    assert all(13 <= len(r["tokens"]) <= 24 for r in recs)
    return recs


def _family_runs(names, outdir: str, data: str) -> dict:
    """For each family: ``megatron-tree train`` (`trainer.train`, float32, DP 2) for 2 steps on the family
    records, a checkpoint after each; then `score.score` of the step-1 checkpoint in float64: "tree"
    (all records, prefixes shared), "alone" (`ALONE`), MoE families also "ep2" (tree, EP 2); the
    hybrid also the planted faults "fault_shift" (tree, values written one scored token off) and
    "fault_ckpt2" (tree, the step-2 checkpoint). Returns {name: {"history", run: (parquet, result)}}."""
    from megatron_tree.training import score as sc
    from megatron_tree.training import trainer

    res = {}
    n = len(_family_records())
    for name in names:
        flags, layout = FAMILIES[name]
        ckpt = os.path.join(outdir, "families", name)
        targs = trainer.build_train_parser().parse_args(
            flags + ["--tree-data-path", data, "--tree-global-batch-samples", str(n), "--train-iters", "2",
                     "--lr", "0.05", "--save", ckpt, "--save-interval", "1", "--quiet"])
        out = {"history": trainer.train(targs)["history"]}
        runs = {"tree": (layout, 1), "alone": (layout + ALONE, 1)}
        if name in MOE_FAMILIES:
            runs["ep2"] = (["--expert-model-parallel-size", "2"], 1)
        if name == "hybrid_MG*-E":
            runs.update(fault_shift=(layout, 1), fault_ckpt2=(layout, 2))
        for run, (extra, step) in runs.items():
            sc._FAULT = "occurrence_shift" if run == "fault_shift" else None
            path = os.path.join(outdir, "families", f"{name}.{run}.parquet")
            args = sc.build_score_parser().parse_args(
                flags + ["--load", os.path.join(ckpt, f"iter_{step:07d}"), "--data", data, "--dtype", "float64",
                         "--out", path, "--quiet"] + extra)
            out[run] = (path, sc.score(args))
        sc._FAULT = None
        if name == "hybrid_MG*-E":
            out["shapes"] = _model_shapes(flags)
        res[name] = out
    return res


def _model_shapes(flags: list) -> dict:
    """`score._model_tensor_shapes` of the model ``flags`` build (one rank's view; no PP here)."""
    from megatron.core import parallel_state as ps

    from megatron_tree.training import score as sc
    from megatron_tree.training.models import build_model, make_config
    from megatron_tree.training.trainer import _model_args, init_parallel

    args = sc.check_score_args(sc.build_score_parser().parse_args(
        flags + ["--load", "unused", "--data", "unused", "--out", "unused.parquet", "--max-tokens-per-mb", "64"]))
    init_parallel(args)
    margs = _model_args(args)
    shapes = sc._model_tensor_shapes(build_model(make_config(margs), margs).sharded_state_dict())
    ps.destroy_model_parallel()
    return shapes


#: Megatron-LM's saved ``args`` (core_v0.16.1 names) for the model MODEL builds; `_lm_like_checkpoint`
#: saves them with two numerics arguments changed
LM_ARGS = dict(hidden_size=32, num_attention_heads=4, num_layers=2, group_query_attention=False, num_query_groups=1,
               kv_channels=8, ffn_hidden_size=128, padded_vocab_size=V, normalization="RMSNorm", norm_epsilon=1e-5,
               apply_layernorm_1p=False, swiglu=False, squared_relu=False, untie_embeddings_and_output_weights=True,
               add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False, position_embedding_type="rope",
               rotary_percent=1.0, rotary_base=10000, use_rope_scaling=False, rope_scaling_factor=8.0,
               rotary_interleaved=False, rotary_seq_len_interpolation_factor=None, num_experts=None)


def _lm_like_checkpoint(outdir: str) -> str:
    """A checkpoint laid out as Megatron-LM's torch_dist ones (the model's sharded tensors, its ``args``
    in the common state) whose args differ from MODEL's model in norm_epsilon and rotary_percent."""
    import argparse

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_tree.training import score as sc
    from megatron_tree.training.models import build_model, make_config
    from megatron_tree.training.trainer import _model_args, init_parallel

    path = os.path.join(outdir, "lm_like", "iter_0000001")
    args = sc.check_score_args(sc.build_score_parser().parse_args(
        MODEL + ["--load", path, "--data", "unused", "--out", "unused.parquet", "--max-tokens-per-mb", "64"]))
    init_parallel(args)
    margs = _model_args(args)
    model = build_model(make_config(margs), margs)
    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    lm_args = argparse.Namespace(**dict(LM_ARGS, norm_epsilon=1e-6, rotary_percent=0.5))
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": lm_args, "iteration": 1,
                             "checkpoint_version": 3.0}, path)
    # the rotary flags reach the model (GPTModel's RotaryEmbedding): the inverse frequencies it built
    rope = sc.check_score_args(sc.build_score_parser().parse_args(
        MODEL + ["--load", path, "--data", "unused", "--out", "unused.parquet", "--max-tokens-per-mb", "64",
                 "--rotary-percent", "0.5", "--use-rope-scaling", "--rope-scaling-factor", "16", "--rotary-base",
                 "10000000"]))
    margs = _model_args(rope)
    inv_freq = build_model(make_config(margs), margs).rotary_pos_emb.inv_freq.clone()
    ps.destroy_model_parallel()
    return path, inv_freq


def stock_gpt():
    """Stock Megatron-Core ``GPTModel`` (local block spec, float64) with the parameters ``MODEL`` trains: what the
    oracles load a checkpoint into."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4,
                            ffn_hidden_size=128, params_dtype=torch.float64, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm", add_bias_linear=False,
                            bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
                            apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
    return GPTModel(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm"),
                    vocab_size=V, max_sequence_length=64, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False).to(torch.float64)


def _stock_oracle(ckpt_root: str, records: list) -> dict:
    """{step: [(logprobs [L-1], entropy [L-1], top-k log-probs [L-1, K], top-k ids [L-1, K]) per record]} of
    stock GPTModel per record, float64 (index t-1 predicts token t; the top-k of the full-vocabulary
    log-softmax)."""
    from megatron.core import dist_checkpointing

    stock = stock_gpt()
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
                top = logp[:-1].topk(TOP_K, dim=-1)
                rows.append((logp[torch.arange(len(x) - 1), x[1:]], ent[:-1], top.values, top.indices))
        out[step] = rows
    return out


def _spawn_body(ckpt_root: str, data: str, outdir: str, route_data: str, families: list, family_data: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tree.training import score as sc

    res = {"families": _family_runs(families, outdir, family_data)}
    res["lm_like"], res["inv_freq"] = _lm_like_checkpoint(outdir)
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
def run(tmp_path_factory, request):
    from megatron_tree import cli

    from selection import selected_cases

    families = sorted(set(selected_cases(request, "test_score_loads_every_family_train_checkpoint", FAMILIES,
                                         argname="family"))
                      | set(selected_cases(request, "test_score_under_expert_parallelism", FAMILIES, argname="family")))
    if any(getattr(item, "originalname", None) in ("test_planted_faults_of_the_family_check",
                                                    "test_checkpoint_sub_tensors_are_compared_strictly")
           and item.module is request.module for item in request.session.items):
        families = sorted(set(families) | {"hybrid_MG*-E"})
    d = tmp_path_factory.mktemp("score")
    family_data = str(d / "family_records.jsonl")
    with open(family_data, "w") as f:
        for r in _family_records():
            f.write(json.dumps(r) + "\n")
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
    spawned = run_distributed(_spawn_body, 2, ckpt, data, str(d), route_data, families, family_data, timeout=900)[0]
    with open(metrics) as f:
        history = json.load(f)["history"]
    return dict(dir=d, data=data, ckpt=ckpt, route_data=route_data, records=records, history=history, spawned=spawned,
                family_records=_family_records(),
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
    assert cols == ["record", "logprobs", "entropy"] + (["topk_ids", "topk_logprobs"] if "top_k" in name else [])
    assert [r["record"] for r in rows] == list(range(len(run["records"])))  # one row per record, input order
    oracle = run["spawned"]["oracle"][step]
    for rec, row, (lp, ent, *_) in zip(run["records"], rows, oracle):
        t = torch.as_tensor(_targets(rec, all_tokens))
        assert len(row["logprobs"]) == len(row["entropy"]) == len(t)
        torch.testing.assert_close(torch.tensor(row["logprobs"], dtype=torch.float64), lp[t - 1], **F64)
        torch.testing.assert_close(torch.tensor(row["entropy"], dtype=torch.float64), ent[t - 1], **F64)
    assert rows[2] == {**rows[6], "record": 2}  # the duplicated record: the same lists
    if not all_tokens:
        assert rows[8]["logprobs"] == [] == rows[8]["entropy"]  # no target: empty lists, row kept


def test_top_k_equals_the_full_vocabulary_reference(run):
    """``score --top-k 8`` under TP2 (each rank holds half the vocabulary): per scored token the 8 ids and
    log-probs of stock's full-vocabulary log-softmax, in order (the distillation teacher's input); the
    best of them is at least the target's own log-prob."""
    path, step, _ = run["outs"]["tp2_top_k"]
    _, rows = _read(path)
    oracle = run["spawned"]["oracle"][step]
    checked = 0
    for rec, row, (lp, _, top_lp, top_ids) in zip(run["records"], rows, oracle):
        t = torch.as_tensor(_targets(rec, False))
        assert len(row["topk_ids"]) == len(row["topk_logprobs"]) == len(t)
        if not len(t):
            continue
        ids = torch.tensor(row["topk_ids"], dtype=torch.int64)
        vals = torch.tensor(row["topk_logprobs"], dtype=torch.float64)
        assert ids.shape == (len(t), TOP_K)
        assert torch.equal(ids, top_ids[t - 1]), (ids, top_ids[t - 1])
        torch.testing.assert_close(vals, top_lp[t - 1], **F64)
        assert bool((vals[:, 0] >= lp[t - 1] - 1e-12).all())
        checked += len(t)
    assert checked > 0


def test_planted_fault_one_token_off_fails(run):
    """The comparison above catches values written one scored token off."""
    _, rows = _read(str(run["dir"] / "fault.parquet"))
    oracle = run["spawned"]["oracle"][2]
    errs = [float((torch.tensor(row["entropy"], dtype=torch.float64) - ent).abs().max())
            for row, (_, ent, *_) in zip(rows, oracle)]
    assert max(errs) > 1e-3


def test_tree_sharing_really_happened(run):
    for name in SPAWN_CASES:
        r = run["spawned"][name]
        assert r["tree_rows"] < r["flat_tokens"] and r["records"] == len(run["records"])


def test_train_logs_mean_entropy(run):
    """Step 2 ran with the weights of checkpoint 1: its logged mean entropy over the loss-masked targets
    (float32 model) equals the stock model's (float64) under that checkpoint."""
    oracle = run["spawned"]["oracle"][1]
    ents = torch.cat([ent[torch.as_tensor(_targets(rec, False)) - 1] for rec, (_, ent, *_) in zip(run["records"], oracle)])
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
    GPT checkpoint scored as our hybrid stack of the same layers) runs in tests/test_launch_lm.py."""
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


def test_routing_replay_bad_routes_are_refused_with_file_line_before_any_rank(tmp_path, monkeypatch, capsys):
    """``megatron-tree score --routing-replay`` reads records with the training readers' route rule
    (`tree.routes.read_time_route_spec`): a record without routes, with another top-k than
    ``--moe-router-topk`` or an expert id outside ``--num-experts`` is refused as ``file:line`` before
    any rank starts (no checkpoint is even looked for: --load names nothing)."""
    from megatron_tree import cli
    from megatron_tree.training import launch

    monkeypatch.setattr(launch, "run_distributed", lambda *a, **k: pytest.fail("a rank started"))

    def top1(rec):
        rec["routed_experts"] = [[layer[:1] for layer in tok] for tok in rec["routed_experts"]]

    def expert_4(rec):
        rec["routed_experts"][5][1] = [4, 0]

    cases = {"missing": (lambda rec: rec.pop("routed_experts"), "has no routed_experts, but routing replay needs routes"),
             "top1": (top1, "routed_experts has top-1 per token and layer but the model routes top-2"),
             "expert_4": (expert_4, "routed_experts holds expert id 4 at token 5, but the model has 4 experts")}
    for name, (damage, reason) in cases.items():
        recs = _route_records()
        damage(recs[2])
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        rc = cli.main(["score", *MOE, "--routing-replay", "--nproc", "2", "--load", str(tmp_path / "no_ckpt"),
                       "--data", str(path), "--out", str(tmp_path / "z.parquet")])
        err = capsys.readouterr().err
        assert rc == 2 and f"{path}:3: {reason}" in err, (name, err)


# ---------------------------------------------------------------------------------------------- every model family
def _rows(path):
    _, rows = _read(path)
    return rows


def _max_diff(rows_a, rows_b) -> float:
    """Largest |a - b| over every record's log-probs and entropies (the lists must align)."""
    worst = 0.0
    for a, b in zip(rows_a, rows_b, strict=True):
        for k in ("logprobs", "entropy"):
            assert len(a[k]) == len(b[k]), (a["record"], k)
            if a[k]:
                worst = max(worst, float(np.abs(np.asarray(a[k]) - np.asarray(b[k])).max()))
    return worst


def _assert_equals_alone(run, family: str, which: str) -> float:
    fam = run["spawned"]["families"][family]
    got, alone = _rows(fam[which][0]), _rows(fam["alone"][0])
    records = run["family_records"]
    assert [r["record"] for r in got] == [r["record"] for r in alone] == list(range(len(records)))
    for rec, row in zip(records, alone):
        assert len(row["logprobs"]) == len(_targets(rec, False))
    diff = _max_diff(got, alone)
    assert diff <= 1e-10, (family, which, diff)
    return diff


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_score_loads_every_family_train_checkpoint(run, family):
    """``score --load`` of a ``megatron-tree train`` checkpoint of every model family (GPT, our hybrid stack
    with M G * - E letters, MambaModel, Qwen3-Next with MoE, MLA, DSA; MTP where the stack runs it): the
    checkpoint's sharded sub-tensors (the stock Mamba-2 / GDN mixers split in_proj and conv1d) are the
    model's, so it loads. Scores of all records together (tree packing, prefixes shared) equal each record
    scored alone (flat packing, one record per microbatch: `ALONE`) in float64 to 1e-10; and the loaded
    weights are the trained ones: the mean -log-prob over the step-1 checkpoint's targets equals the loss
    ``train`` logged for step 2 (computed with those weights, float32) to float32 rounding."""
    fam = run["spawned"]["families"][family]
    diff = _assert_equals_alone(run, family, "tree")
    tree, alone = fam["tree"][1], fam["alone"][1]
    records = run["family_records"]
    assert alone["microbatches"] == len(records) == alone["records"]  # one record per microbatch
    assert tree["tree_rows"] < tree["flat_tokens"] == alone["flat_tokens"]  # the tree run shared the prompt
    lp = np.concatenate([r["logprobs"] for r in _rows(fam["tree"][0])])
    step2 = fam["history"][1]
    assert step2["num_targets"] == len(lp)
    assert abs(-lp.mean() - step2["loss"]) <= 2e-6 * step2["loss"], (family, -lp.mean(), step2["loss"])
    print(f"\n{family}: tree vs alone max |diff| {diff:.2e}; mean -logp {-lp.mean():.9f}, train step-2 loss "
          f"{step2['loss']:.9f}")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_score_under_expert_parallelism(run, family):
    """``score --expert-model-parallel-size 2`` (experts split over the two ranks, tree packing) of a MoE
    checkpoint equals each record scored alone without EP (`ALONE`), float64."""
    diff = _assert_equals_alone(run, family, "ep2")
    print(f"\n{family} EP2: max |diff| vs alone {diff:.2e}")


def test_checkpoint_sub_tensors_are_compared_strictly(run):
    """The model's tensors as its sharded state dict writes them (`score._model_tensor_shapes`: the stock
    Mamba-2 / GDN mixers' factories built, so ``in_proj.weight.z``, ``conv1d.weight.query``, never
    ``in_proj.weight``) are exactly what a ``train`` checkpoint of the hybrid holds; a sub-tensor that is
    missing, extra or of another shape is still named."""
    from megatron.core import dist_checkpointing

    from megatron_tree.training.score import CheckpointMismatch, check_checkpoint_tensors

    fam = run["spawned"]["families"]["hybrid_MG*-E"]
    path = str(run["dir"] / "families" / "hybrid_MG*-E" / "iter_0000001")
    shapes = fam["shapes"]
    stored = {k: tuple(v.global_shape) for k, v in dist_checkpointing.load_tensors_metadata(path).items()
              if not k.startswith("optimizer.")}
    assert shapes == stored
    mamba_z = next(k for k in shapes if k.endswith("in_proj.weight.z"))  # layer 0: Mamba-2
    gdn_q = next(k for k in shapes if k.endswith("conv1d.weight.query"))  # layer 1: Gated DeltaNet
    assert not any(k.endswith(("in_proj.weight", "conv1d.weight")) for k in shapes)
    check_checkpoint_tensors(path, shapes)  # accepted
    wrong = dict(shapes)
    del wrong[mamba_z]
    wrong[gdn_q] = (2 * shapes[gdn_q][0],) + shapes[gdn_q][1:]
    extra = gdn_q.replace("conv1d.weight.query", "conv1d.weight.gate")
    wrong[extra] = shapes[gdn_q]
    with pytest.raises(CheckpointMismatch) as e:
        check_checkpoint_tensors(path, wrong)
    msg = str(e.value)
    assert f"not in the checkpoint: {extra}" in msg and f"in the checkpoint, not in the model: {mamba_z}" in msg
    assert f"{gdn_q}: checkpoint {list(shapes[gdn_q])}, model {list(wrong[gdn_q])}" in msg


def test_planted_faults_of_the_family_check(run):
    """The two comparisons above can fail: values written one scored token off miss the records scored
    alone; the step-2 checkpoint (one more update) misses train's step-2 loss."""
    fam = run["spawned"]["families"]["hybrid_MG*-E"]
    with pytest.raises(AssertionError):
        _assert_equals_alone(run, "hybrid_MG*-E", "fault_shift")
    assert _max_diff(_rows(fam["fault_shift"][0]), _rows(fam["alone"][0])) > 1e-3
    lp = np.concatenate([r["logprobs"] for r in _rows(fam["fault_ckpt2"][0])])
    assert abs(-lp.mean() - fam["history"][1]["loss"]) > 1e-3 * fam["history"][1]["loss"]


def test_megatron_lm_args_that_differ_are_named_before_any_rank_starts(run, capsys, monkeypatch):
    """A Megatron-LM-layout checkpoint (torch_dist, ``args`` in the common state) whose norm_epsilon and
    rotary_percent differ from the model the flags build is refused naming both, with the flag that
    matches each, before ranks are spawned; with those flags it passes the check. The real case (the
    checkpoint Megatron-LM's pretrain() saved) runs in tests/test_launch_lm.py."""
    import argparse

    from megatron_tree import cli
    from megatron_tree.training import launch
    from megatron_tree.training import score as sc

    def no_spawn(*a, **k):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(launch, "run_distributed", no_spawn)
    path = run["spawned"]["lm_like"]
    out = str(run["dir"] / "lm_like.parquet")
    rc = cli.main(["score", *MODEL, "--load", path, "--data", run["data"], "--out", out, "--nproc", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and not os.path.exists(out)
    assert "norm_epsilon: checkpoint 1e-06, flags 1e-05 (--norm-epsilon)" in err, err
    assert "rotary_percent: checkpoint 0.5, flags 1.0 (--rotary-percent)" in err, err
    assert err.count("\n  - ") == 2, err  # nothing else named
    args = sc.check_score_args(sc.build_score_parser().parse_args(
        MODEL + ["--load", path, "--data", run["data"], "--out", out, "--norm-epsilon", "1e-6", "--rotary-percent",
                 "0.5"]))
    sc.check_checkpoint_flags(path, args)  # the matching flags: accepted
    # fixed features of our models are named too, and Megatron-LM 0.19's names (config fields) are read
    renamed = {k: v for k, v in LM_ARGS.items() if k not in ("norm_epsilon", "apply_layernorm_1p")}
    ns = argparse.Namespace(**dict(renamed, layernorm_epsilon=1e-5, layernorm_zero_centered_gamma=True,
                                   add_bias_linear=True))
    bad = sc.megatron_lm_arg_differences(ns, args)
    assert [b.split(":")[0] for b in bad] == ["norm_epsilon", "apply_layernorm_1p", "add_bias_linear", "rotary_percent"]
    assert "fixed" in bad[1] and "fixed" in bad[2]


def test_numerics_flags_reach_the_model(run):
    """--norm-epsilon, --rotary-percent, --use-rope-scaling / --rope-scaling-factor, --qk-layernorm and
    --kv-channels (Megatron-LM's names; defaults leave the model as it was) reach the config; the rotary
    ones the model: its rotary inverse frequencies are those of Megatron's RotaryEmbedding built with them
    (half the head dimensions, base 1e7, Llama 3.x scaling by 16); MambaModel / MLA refuse what they cannot build."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    expected = RotaryEmbedding(kv_channels=8, rotary_percent=0.5, rotary_base=10000000, rope_scaling=True,
                               rope_scaling_factor=16.0, use_cpu_initialization=True).inv_freq
    assert len(expected) == 2  # 8 channels, half rotated, pairs
    torch.testing.assert_close(run["spawned"]["inv_freq"].double(), expected.double(), rtol=1e-6, atol=0)
    assert not torch.allclose(expected, RotaryEmbedding(kv_channels=8, rotary_percent=0.5,
                                                        rotary_base=10000000, use_cpu_initialization=True).inv_freq)
    from megatron_tree.training.models import make_config
    from megatron_tree.training.score import build_score_parser
    from megatron_tree.training.trainer import _family_errors, _model_args, fill_model_defaults

    def parsed(*extra, model=MODEL):
        args = build_score_parser().parse_args([*model, "--load", "x", "--data", "y", "--out", "z.parquet", *extra])
        args.tree_hybrid_pattern = None
        args.tree_max_tokens_per_mb = 64
        return fill_model_defaults(args)

    plain = _model_args(parsed())
    cfg = make_config(plain)
    assert (cfg.layernorm_epsilon, cfg.qk_layernorm, cfg.kv_channels) == (1e-5, False, 8)
    assert (plain.rotary_percent, plain.rope_scaling, plain.rope_scaling_factor) == (1.0, False, 8.0)
    m = _model_args(parsed("--norm-epsilon", "1e-6", "--rotary-percent", "0.5", "--use-rope-scaling",
                           "--rope-scaling-factor", "16", "--qk-layernorm", "--kv-channels", "16"))
    cfg = make_config(m)
    assert (cfg.layernorm_epsilon, cfg.qk_layernorm, cfg.kv_channels) == (1e-6, True, 16)
    assert (m.rotary_percent, m.rope_scaling, m.rope_scaling_factor) == (0.5, True, 16.0)
    mamba = ["--model-family", "mamba", "--hybrid-override-pattern", "M*"]
    assert any("--qk-layernorm" in e for e in _family_errors(parsed("--qk-layernorm", model=MODEL[2:] + mamba)))
    mla = _family_errors(parsed("--rotary-percent", "0.5", model=MODEL + ["--multi-latent-attention"]))
    assert any("YaRN" in e for e in mla)
