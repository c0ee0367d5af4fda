"""Rollout routing replay (R3) on trees (issue 18 point 2): ``megatron-tree verify --routing-replay``.

The tree side packs route-aware (rows shared only where tokens and routes agree) and replays the
routes of the rows each MoE layer holds (`megatron_tree.megatron.routing_replay`); the per-sample
side replays each sample's own routes through stock ``RouterReplay`` (independent code: the sample's
``routed_experts`` plus padding, fed to every stock router before the sample's forward). Routes are
drawn from the token prefix, with a planted disagreement on a shared prompt in every fourth sample,
so the route-aware trie really forks. Float64; Megatron scores routes in fp32 whatever the dtype, and
verify widens that scoring to float64 on both sides (`megatron_tree.megatron.router_precision`), so
replay runs are held to verify's float64 tolerance like every other.
"""
from __future__ import annotations

import numpy as np
import pytest

from megatron_tree.training.verify import VerifyConfig, format_report, run_verify_many, verify_routes, verify_samples
from selection import run_selected  # tests/selection.py
from verify_checks import check_verify  # tests/verify_checks.py

R = dict(routing_replay=True, families=3, budget=64, dtype="float64")
LATEST: list = []


def both(cfg):
    LATEST.append(cfg)
    return cfg


WS1 = [
    both(VerifyConfig(model="gpt", **R)),
    # the MoE layer's routing reruns inside the backward: the routes come from the recompute FIFO
    VerifyConfig(model="gpt", recompute="selective", loss="grpo", **R),
    VerifyConfig(model="gpt", recompute="full", **R),
    both(VerifyConfig(model="hybrid", recompute="selective", **R)),  # M G * - * E
    both(VerifyConfig(model="mamba", **R)),  # MambaModel M * - E
    VerifyConfig(model="gpt", recompute="selective", fault="route_row_shift", **R),
    VerifyConfig(model="mla", **R),  # DeepSeek-style: the first layer dense, MoE after it
    VerifyConfig(model="qwen3next", **R),  # GDN + gated attention, MoE with a shared expert
    VerifyConfig(model="dsa", **R),  # MLA + DeepSeek sparse attention (indexer top-k), MoE after the first layer
    # carry (issue 25) at a 16-row budget: route-aware carry packing (the (token, route) forest cut into
    # chains; each microbatch's routes cover its carried and own rows, the MoE layers replay the own ones),
    # the MoE routing recomputed inside the backward from the FIFO, fills routing without autograd
    VerifyConfig(model="hybrid", recompute="selective", **{**R, "budget": 16, "carry": True}),
    VerifyConfig(model="gpt", fault="route_row_shift", **{**R, "budget": 16, "carry": True}),
]

WS2 = [
    both(VerifyConfig(model="gpt", tp=2, sp=True, recompute="selective", **R)),  # each TP rank routes its SP slice
    both(VerifyConfig(model="gpt", dp=2, ep=2, **R)),  # experts over 2 ranks: routed before dispatch
    # 1F1B: stage 0 runs microbatch 1's forward before microbatch 0's backward recomputes its routing
    VerifyConfig(model="gpt", pp=2, recompute="selective", **R),
    both(VerifyConfig(model="hybrid", pp=2, recompute="full", **R)),
    VerifyConfig(model="gpt", tp=2, sp=True, fault="route_row_shift", **R),
    # tree CP: each rank replays its owned rows (and padding); the per-sample side runs on CP rank 0
    both(VerifyConfig(model="gpt", cp=2, recompute="selective", **R)),
    VerifyConfig(model="gpt", cp=2, ep=2, **R),  # experts over the CP ranks
    # GDN layout islands: the MoE layer runs inside the island "GEG" on the island ownership (the
    # model's island plan differs from zigzag's on these microbatches), so it replays the island rows
    VerifyConfig(model="hybrid", pattern="GEG*", cp=2, cp_strategy="zigzag", **R),
]


@pytest.fixture(scope="module")
def ws1(request):
    return run_selected(request, "test_world_size_1", WS1, run_verify_many)


@pytest.fixture(scope="module")
def ws2(request):
    return run_selected(request, "test_world_size_2", WS2, run_verify_many)


def _id(c: VerifyConfig) -> str:
    return (f"{c.model}{'(' + c.pattern + ')' if c.pattern else ''}-tp{c.tp}-pp{c.pp}-dp{c.dp}-ep{c.ep}-cp{c.cp}"
            f"{'-sp' if c.sp else ''}-{c.recompute}-{c.loss}" + ("-carry" if c.carry else "")
            + (f"-{c.fault}" if c.fault else ""))


def _cases(configs):
    return [pytest.param(i, id=_id(c), marks=[] if any(c is k for k in LATEST) else [pytest.mark.main_tier_only])
            for i, c in enumerate(configs)]


@pytest.mark.parametrize("i", _cases(WS1))
def test_world_size_1(ws1, i):
    check_verify(WS1[i], ws1[i], fault_seen="logits" if WS1[i].fault else None)


@pytest.mark.parametrize("i", _cases(WS2))
def test_world_size_2(ws2, i):
    check_verify(WS2[i], ws2[i], fault_seen="logits" if WS2[i].fault else None)


def test_verify_routes_make_shared_prefixes_disagree():
    """The verify batch's routes fork the trie: route-aware rows exceed token-only rows, and some
    rollouts that share a token prefix were routed differently on it."""
    from megatron_tree.tree.routes import route_sharing_cost

    samples = verify_routes(verify_samples(1234, 128, 3), 4, 2, 4, 1234)
    c = route_sharing_cost(samples)
    assert c["route_forks"] >= 3 and c["token_rows"] < c["route_rows"] < c["flat_rows"]
    for s in samples:  # distinct experts per token and layer, in range
        r = np.sort(s.routed_experts, -1)
        assert (r[..., 1:] != r[..., :-1]).all() and r.min() >= 0 and r.max() < 4


def test_verify_refuses_what_it_cannot_judge():
    with pytest.raises(ValueError, match="route_row_shift plants a bug in routing replay"):
        run_verify_many([VerifyConfig(model="gpt", fault="route_row_shift")])
    with pytest.raises(ValueError, match="--routing-replay runs in float64 / float32"):
        run_verify_many([VerifyConfig(model="gpt", dtype="bfloat16", routing_replay=True)])
    assert "routing_replay" in format_report(WS1[0], {"tolerance": 0, "num_samples": 0, "flat_rows": 0,
                                                      "tree_rows": 0, "loss_value": 0, "passed": True,
                                                      **{m: 0 for m in ("logits", "loss", "grads",
                                                                        "params_after_step")}}).splitlines()[0]


def _missing_routes_body():
    """One rank: a replaying tree model refuses a microbatch without routes (and a model built without
    ``moe_enable_routing_replay`` refuses the install); the CP view's routes are its owned rows."""
    import torch

    from megatron_tree.cpu import megatron_core as cpu
    from megatron_tree.megatron.packed_seq import tree_packed_seq_params
    from megatron_tree.megatron.routing_replay import install_routing_replay, local_routes
    from megatron_tree.training.models import ModelArgs, build_model, make_config
    from megatron_tree.tree import Sample, pack

    cpu.enable()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    margs = ModelArgs(kind="gpt", num_layers=2, num_experts=4)
    out = {}
    try:
        install_routing_replay(build_model(make_config(margs), margs))
    except ValueError as e:
        out["no_flag"] = str(e)
    margs.extra["moe_enable_routing_replay"] = True
    model = build_model(make_config(margs), margs)
    reps = install_routing_replay(model)
    out["ordinals"] = [r.moe_ordinal for r in reps]
    mb = pack([Sample(tokens=[1, 2, 3, 4])], 8)[0]  # token-only: no routes
    psp = tree_packed_seq_params(mb)
    try:
        model(psp.input_ids.unsqueeze(0), psp.position_ids.unsqueeze(0), None, packed_seq_params=psp)
    except ValueError as e:
        out["missing"] = str(e)
    routes = np.arange(4 * 2 * 2).reshape(4, 2, 2) % 4
    routes[:, :, 1] = (routes[:, :, 0] + 1) % 4
    mb = pack([Sample(tokens=[1, 2, 3, 4], routed_experts=routes)], 8, route_aware=True, pad_to_multiple_of=8)[0]
    psp = tree_packed_seq_params(mb)
    model(psp.input_ids.unsqueeze(0), psp.position_ids.unsqueeze(0), None, packed_seq_params=psp)
    out["replayed"] = True
    from megatron_tree.cp import plan_context_parallel
    from megatron_tree.megatron.packed_seq import context_parallel_view

    plan = plan_context_parallel(mb.layout, 2, strategy="zigzag")
    view = context_parallel_view(psp, plan, 1, pad_to_multiple_of=4)
    got = local_routes(view)
    rows = torch.from_numpy(plan.owner_rows(1))
    out["cp_ok"] = bool(torch.equal(got[: len(rows)], mb.routes[rows])) and got.shape[0] == view.num_local_rows
    # inside a GDN island the layers get the island view: its rows (another ownership) and padding
    gplan = plan_context_parallel(mb.layout, 2, strategy="contiguous")
    island = context_parallel_view(psp, plan, 1, pad_to_multiple_of=4, gdn_plan=gplan).island_view()
    g_rows = torch.from_numpy(gplan.owner_rows(1))
    got = local_routes(island)
    out["island_ok"] = (bool(torch.equal(got[: len(g_rows)], mb.routes[g_rows])) and got.shape[0] ==
                        island.num_local_rows and not torch.equal(g_rows, rows))
    return out


def test_missing_routes_are_an_error_never_a_reroute():
    from dist import run_distributed

    out = run_distributed(_missing_routes_body, 1)[0]
    assert "moe_enable_routing_replay=True" in out["no_flag"]
    assert out["ordinals"] == [0, 1]
    assert "carry no routes" in out["missing"] and "never re-routes" in out["missing"]
    assert out["replayed"] and out["cp_ok"] and out["island_ok"]


# ----------------------------------------------------------------------------------- megatron-tree train
def _train_argv(data, *extra):
    return ["--tree-data-path", str(data), "--vocab-size", "128", "--hidden-size", "16", "--num-attention-heads", "2",
            "--ffn-hidden-size", "32", "--num-layers", "2", "--num-experts", "4", "--moe-ffn-hidden-size", "16",
            "--moe-router-topk", "2", "--lr", "2e-2", "--lr-decay-style", "constant", "--weight-decay", "0",
            "--tree-global-batch-samples", "12", "--tree-max-tokens-per-mb", "64", "--tree-pad-to-multiple-of", "8",
            "--quiet", "--seed", "7", "--train-iters", "2", *map(str, extra)]


def _train_body(paths):
    """One rank: ``train --routing-replay`` on routed records (twice, with two different routings of the
    same tokens), and on records missing routes."""
    from megatron_tree.training.trainer import build_train_parser, train

    out = {}
    for name in ("a", "b"):
        res = train(build_train_parser().parse_args(_train_argv(paths[name], "--routing-replay")))
        out[name] = [(h["loss"], h["tree_rows"], h["flat_tokens"]) for h in res["history"]]
    # --tree-carry at a 16-row budget (below the longest record): the same samples, every row once
    res = train(build_train_parser().parse_args(_train_argv(paths["a"], "--routing-replay", "--tree-carry",
                                                            "--tree-max-tokens-per-mb", "16")))
    out["carry"] = [(h["loss"], h["tree_rows"], h["flat_tokens"]) for h in res["history"]]
    for name in ("missing", "layers"):
        try:
            train(build_train_parser().parse_args(_train_argv(paths[name], "--routing-replay")))
        except ValueError as e:
            out[name] = str(e)
    return out


def test_train_routing_replay(tmp_path):
    """``megatron-tree train --routing-replay`` packs route-aware (the logged rows are the (token, route)
    trie's), replays the records' routes (another routing of the same tokens gives another loss), gives
    the same losses with ``--tree-carry`` at a budget below the longest record, and refuses a record
    without routes."""
    from dist import run_distributed
    from megatron_tree.data.io import write_jsonl
    from megatron_tree.tree import Sample, pack

    samples = verify_routes(verify_samples(7, 128, 2), 2, 2, 4, 7)
    other = verify_routes(samples, 2, 2, 4, 8)  # the same tokens routed differently
    paths = {"a": tmp_path / "a.jsonl", "b": tmp_path / "b.jsonl", "missing": tmp_path / "m.jsonl",
             "layers": tmp_path / "l.jsonl"}
    write_jsonl(samples, paths["a"])
    write_jsonl(other, paths["b"])
    write_jsonl(samples[:5] + [Sample(tokens=samples[5].tokens)] + samples[6:], paths["missing"])
    one_layer = Sample(tokens=samples[5].tokens, routed_experts=samples[5].routed_experts[:, :1])
    write_jsonl(samples[:5] + [one_layer] + samples[6:], paths["layers"])  # the model has 2 MoE layers
    out = run_distributed(_train_body, 1, paths, timeout=600)[0]
    (loss_a, rows_a, flat_a), (loss_b, _, _) = out["a"][0], out["b"][0]
    assert np.isfinite([h[0] for h in out["a"]]).all() and loss_a != loss_b
    # every step's rows: the route-aware trie of its window (12 samples), more than token-only sharing
    assert rows_a < flat_a
    # with carry: the same losses (float32 rounding) and records, no more rows (a cut tree computes its shared rows once)
    for (la, ra, fa), (lc, rc, fc) in zip(out["a"], out["carry"]):
        assert lc == pytest.approx(la, rel=1e-5) and rc <= ra and fc == fa, (out["a"], out["carry"])
    print(f"\ntrain --routing-replay, budget 64: {out['a']}\n  --tree-carry, budget 16: {out['carry']}")
    assert "has no routed_experts" in out["missing"] and "re-routed" in out["missing"]
    # what only the built model knows (its MoE layer count) is checked in the rank, named by file and line
    assert out["layers"].startswith(f"{paths['layers']}:6: routed_experts has 1 MoE layers per token but the model "
                                    "has 2"), out["layers"]


def test_train_checks_routes_top_k_and_experts_where_file_and_line_are_known(tmp_path):
    """``train --routing-replay`` reads records against the router's top-k and expert count: an error
    names the file and line (the layer count is the built model's check)."""
    import json

    from megatron_tree.training.trainer import build_train_parser, load_train_samples

    good = [[[0, 1], [2, 3]]] * 3
    lines = [{"tokens": [5, 6, 7], "routed_experts": good},
             {"tokens": [5, 6, 8], "routed_experts": [[[0, 1, 2], [2, 3, 0]]] * 3},  # top-3 for a top-2 router
             {"tokens": [5, 9, 8], "routed_experts": [[[0, 4], [2, 3]]] * 3}]  # expert 4 of 4
    for bad, rule in ((2, "top-3 per token and layer but the model routes top-2"), (3, "expert")):
        path = tmp_path / f"bad{bad}.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in [lines[0], lines[bad - 1]]) + "\n")
        args = build_train_parser().parse_args(_train_argv(path, "--routing-replay"))
        with pytest.raises(ValueError, match=rf"{path}:2\b(?s:.*){rule}"):
            load_train_samples(args)
    args = build_train_parser().parse_args(_train_argv(tmp_path / "bad2.jsonl"))  # no replay: routes unchecked
    assert len(load_train_samples(args)) == 2


def test_cli_names_a_record_without_routes_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    """``megatron-tree train`` / ``score --routing-replay``: a record missing ``routed_experts`` is an
    error naming its file and line, raised while reading, before any rank is spawned (train named it
    ``sample 13`` inside rank 0's traceback); ``--tree-bad-sample skip`` drops and records it."""
    import json

    from megatron_tree.cli import main
    from megatron_tree.data.io import ReadReport
    from megatron_tree.training import launch
    from megatron_tree.training.trainer import build_train_parser, load_train_samples

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(launch, "run_distributed", no_ranks)
    lines = [{"tokens": [1, 2, 3 + i % 4], "routed_experts": [[[0, 1]], [[1, 2]], [[2, 3]]]} for i in range(16)]
    del lines[13]["routed_experts"]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    model = ["--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
             "--num-experts", "4", "--moe-router-topk", "2", "--routing-replay"]
    assert main(["train", "--tree-data-path", str(path), "--train-iters", "1", "--tree-global-batch-samples", "16",
                 *model]) == 2
    err = capsys.readouterr().err
    assert f"error: {path}:14: has no routed_experts" in err and "re-routed" in err, err
    assert main(["score", "--data", str(path), "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "o.parquet"),
                 *model]) == 2
    err = capsys.readouterr().err
    # score reads with the training readers' route rule: the same message, file:line, before any rank
    assert f"error: {path}:14: has no routed_experts" in err and "re-routed" in err, err
    report = ReadReport()
    args = build_train_parser().parse_args(["--tree-data-path", str(path), "--tree-bad-sample", "skip", *model])
    assert len(load_train_samples(args, report)) == 15
    assert [w for w, _ in report.skipped] == [f"{path}:14"] and f"{path}:14" not in report.sources


# ----------------------------------------------------------------------------------- Megatron-LM hooks
def _hooks_body():
    """TP2 + SP: ``--tree-routing-replay`` models from the hooks' model_provider replay what get_batch
    carries (TP rank 1 reads no data: the routes come in TP rank 0's broadcast); the same model fed
    our own tree_forward_step gives the same loss and gradients."""
    import argparse

    import torch

    from megatron_tree.cpu import megatron_core as cpu

    cpu.enable(kernels=True)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tree.megatron.forward_step import tree_forward_step
    from megatron_tree.megatron.routing_replay import TreeRouterReplay
    from megatron_tree.training import megatron_lm as H
    from megatron_tree.training.arguments import add_tree_args
    from megatron_tree.training.models import ModelArgs, make_config
    from megatron_tree.tree import pack

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.set_default_dtype(torch.float64)
    model_parallel_cuda_manual_seed(7)
    torch.manual_seed(7)
    args = add_tree_args(argparse.ArgumentParser()).parse_args(
        ["--tree-packing", "--tree-max-tokens-per-mb", "64", "--tree-routing-replay"])
    for k, v in dict(vocab_size=128, padded_vocab_size=128, transformer_impl="local", normalization="RMSNorm",
                     untie_embeddings_and_output_weights=True, position_embedding_type="rope", num_experts=4,
                     max_position_embeddings=64, micro_batch_size=1, attention_dropout=0.0, num_layers=2).items():
        setattr(args, k, v)
    config = make_config(ModelArgs(num_layers=2, vocab_size=128, num_experts=4), tp=2, sp=True, dtype=torch.float64)
    model = H.model_provider(config=config, args=args)
    out = {"replays": sum(isinstance(m.router.router_replay, TreeRouterReplay) for m in model.modules()
                          if hasattr(m, "router"))}
    samples = verify_routes(verify_samples(3, 128, 2), 2, 2, 4, 3)
    mbs = pack(samples, 64, pad_to_multiple_of=8, route_aware=True)
    rank0 = ps.get_tensor_model_parallel_rank() == 0
    psp = H.get_batch(iter(mbs) if rank0 else None)
    out["routes_equal"] = bool(torch.equal(psp.routes, mbs[0].routes))
    losses, grads = [], []
    for step in ("hooks", "ours"):
        model.zero_grad()
        it = iter(mbs)
        total = 0.0
        for _ in mbs:
            if step == "hooks":
                output, lf = H.forward_step(it if rank0 else None, model, args=args)
            else:
                output, lf = tree_forward_step(it, model)
            loss, n, _ = lf(output)
            loss.backward()
            total += float(loss)
        losses.append(total)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone())
    out["loss"] = losses
    out["grad_diff"] = float((grads[0] - grads[1]).abs().max())
    # --tree-carry with --tree-routing-replay: route-aware carry microbatches at an 8-row budget (every tree is
    # cut; TP rank 1 makes its items from rank 0's broadcast), fill / run / restore through the hooks'
    # forward_step, backward after each item as Megatron's schedule runs them: the whole trees' loss and grads
    from megatron_tree.megatron.carry import carry_items

    from megatron_tree.training.arguments import validate_tree_args

    args.tree_carry = True
    validate_tree_args(args)  # carry with routing replay is allowed
    carry_mbs = pack(samples, 8, pad_to_multiple_of=8, route_aware=True, carry=True)
    items = carry_items(carry_mbs) if rank0 else [None] * len(carry_items(carry_mbs))
    model.zero_grad()
    it, total = iter(items), 0.0
    for _ in items:
        output, lf = H.forward_step(it if rank0 else None, model, args=args)
        loss, n, _ = lf(output)
        loss.backward()
        total += float(loss)
    out["carry_items"] = len(items)
    out["carry_loss"] = (total, losses[1])
    # each TP rank holds its rows' share of a sequence-parallel parameter's gradient (Megatron's
    # finalize_model_grads sums them): carry spreads the rows differently, so compare the sums
    def summed(flat):
        parts, k = [], 0
        for p in model.parameters():
            if p.grad is None:
                continue
            g = flat[k:k + p.numel()].clone()
            k += p.numel()
            if getattr(p, "sequence_parallel", False):
                torch.distributed.all_reduce(g, group=ps.get_tensor_model_parallel_group())
            parts.append(g)
        return torch.cat(parts)

    grad = summed(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    ref = summed(grads[1])
    out["carry_grad_rel"] = float((grad - ref).abs().max() / ref.abs().max())
    return out


def test_hooks_tree_routing_replay():
    from dist import run_distributed

    for out in run_distributed(_hooks_body, 2, timeout=600):
        assert out["replays"] == 2 and out["routes_equal"]
        assert out["loss"][0] == out["loss"][1] and out["grad_diff"] == 0.0, out
        # float64; MoE's router runs in fp32 (verify's routing replay tolerance)
        assert out["carry_items"] > 2 * 2 and out["carry_loss"][0] == pytest.approx(out["carry_loss"][1], rel=1e-9)
        assert out["carry_grad_rel"] < 5e-6, {k: out[k] for k in ("carry_items", "carry_loss", "carry_grad_rel")}


@pytest.mark.main_tier_only
def test_recompute_replays_its_own_forwards_routes():
    """Planted fault: under PP2 1F1B, a selective MoE recomputation that replays the routes last set by a
    forward (microbatch i+1's) instead of its own forward's is caught: by the row-count check when the
    microbatches differ in size, else by the comparison."""
    from megatron_tree.training.launch import DistributedError

    cfg = VerifyConfig(model="gpt", pp=2, recompute="selective", fault="route_recompute_stale", **R)
    try:
        out = run_verify_many([cfg])[0]
    except DistributedError as e:
        assert "routing replay (MoE layer" in str(e) and "routed rows" in str(e)
    else:
        check_verify(cfg, out)


def _own_routes_body(data, routed):
    """One rank: the routes the initial model itself picks for each sample (stock RouterReplay RECORD on
    the model ``train`` builds, one sample at a time), written to ``routed``; then step 1 of ``train``
    without and with ``--routing-replay`` of those routes."""
    import torch

    from megatron_tree.cpu import megatron_core as cpu
    from megatron_tree.data.io import read_jsonl, write_jsonl
    from megatron_tree.training.trainer import _model_args, build_train_parser, check_train_args, train

    cpu.enable()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megatron_tree.megatron.packed_seq import tree_packed_seq_params
    from megatron_tree.training.models import build_model, make_config
    from megatron_tree.tree import pack

    args = build_train_parser().parse_args(_train_argv(data, "--train-iters", "1"))
    samples = read_jsonl(data)
    check_train_args(args, samples)
    ps.initialize_model_parallel()
    margs = _model_args(args)
    margs.extra["moe_enable_routing_replay"] = True
    config = make_config(margs, recompute="none", dtype=torch.float32)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    model = build_model(config, margs)
    routers = [m.router for m in model.modules() if isinstance(m, MoELayer)]
    for r in routers:
        r.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    out = []
    with torch.no_grad():
        for s in samples:  # each sample alone: an unbranched chain of its own
            psp = tree_packed_seq_params(pack([s], 64)[0])
            psp.loss_map = None
            model(psp.input_ids[None], psp.position_ids[None], None, packed_seq_params=psp)
            rec = torch.stack([r.router_replay.get_recorded_indices() for r in routers], 1)
            out.append(type(s)(tokens=s.tokens, loss_mask=s.loss_mask, routed_experts=rec.numpy()))
    ps.destroy_model_parallel()
    write_jsonl(out, routed)
    plain = train(build_train_parser().parse_args(_train_argv(routed, "--train-iters", "1")))["history"][0]
    replay = train(build_train_parser().parse_args(_train_argv(routed, "--train-iters", "1", "--routing-replay")))
    return plain, replay["history"][0]


def test_train_replaying_the_models_own_routes_equals_no_replay(tmp_path):
    """Through the real ``train`` loop: replaying the experts the initial model picks itself gives step
    1's loss and gradient norm of training without replay (replay gathers the same scores the top-k
    returns, so the router's gradient is the same)."""
    from dist import run_distributed
    from megatron_tree.data.io import write_jsonl

    write_jsonl(verify_samples(5, 128, 2), tmp_path / "d.jsonl")
    plain, replay = run_distributed(_own_routes_body, 1, tmp_path / "d.jsonl", tmp_path / "r.jsonl", timeout=600)[0]
    assert plain["num_targets"] == replay["num_targets"]
    assert replay["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert replay["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
