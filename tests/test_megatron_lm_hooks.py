"""Megatron-LM launch hooks: --tree-* arguments, get_batch broadcast, forward_step, data provider,
example entry points, SLURM scripts and patches. Megatron-LM itself is not installed here: the hooks
take an explicit ``args`` namespace, and the examples run against a stub ``megatron.training``."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
import runpy
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_tree.training.arguments import add_tree_args, validate_tree_args
from megatron_tree.training.launch import run_distributed

ROOT = Path(__file__).resolve().parents[1]

TREE_DEFAULTS = dict(tree_packing=False, tree_max_tokens_per_mb=None, tree_global_batch_samples=None,
                     tree_cp_planner="balanced", tree_loss="sft", tree_clip_eps=0.2, tree_clip_eps_high=None,
                     tree_kl_coef=0.0, tree_bad_sample="error", tree_data_path=None, tree_valid_data_path=None,
                     tree_pad_to_multiple_of=None, tree_lookahead=1, tree_hybrid_pattern=None,
                     tree_flat_packing=False)


def _parse(argv):
    return add_tree_args(argparse.ArgumentParser(allow_abbrev=False)).parse_args(argv)


def _megatron_like(**over):
    """A namespace with the Megatron-LM attributes validate_tree_args looks at, all valid."""
    a = _parse(["--tree-packing", "--tree-max-tokens-per-mb", "64"])
    base = dict(micro_batch_size=1, seq_length=64, tensor_model_parallel_size=1, sequence_parallel=False,
                attention_dropout=0.0, calculate_per_token_loss=True, sft=False, dataloader_type="external",
                rampup_batch_size=None, train_samples=None, mtp_num_layers=None, context_parallel_size=1,
                num_experts=None, moe_token_dispatcher_type="allgather", num_layers=4,
                position_embedding_type="rope", max_position_embeddings=64)
    base.update(over)
    for k, v in base.items():
        setattr(a, k, v)
    return a


# ---------------------------------------------------------------------------------------------- arguments
def test_add_tree_args_defaults_on_a_bare_parser():
    parser = argparse.ArgumentParser()
    assert add_tree_args(parser) is parser
    a = parser.parse_args([])
    assert {k: getattr(a, k) for k in TREE_DEFAULTS} == TREE_DEFAULTS
    assert [g.title for g in parser._action_groups].count("tree") == 1


def test_add_tree_args_parses_every_flag():
    a = _parse(["--tree-packing", "--tree-max-tokens-per-mb", "4096", "--tree-global-batch-samples", "96",
                "--tree-cp-planner", "zigzag", "--tree-loss", "grpo", "--tree-clip-eps", "0.1",
                "--tree-clip-eps-high", "0.28", "--tree-kl-coef", "0.05", "--tree-bad-sample", "skip",
                "--tree-data-path", "a.jsonl", "b.parquet", "--tree-valid-data-path", "v.jsonl",
                "--tree-pad-to-multiple-of", "16", "--tree-lookahead", "3", "--tree-hybrid-pattern", "MG*-|*E"])
    assert a.tree_packing is True and a.tree_max_tokens_per_mb == 4096 and a.tree_global_batch_samples == 96
    assert (a.tree_cp_planner, a.tree_loss, a.tree_bad_sample) == ("zigzag", "grpo", "skip")
    assert (a.tree_clip_eps, a.tree_clip_eps_high, a.tree_kl_coef) == (0.1, 0.28, 0.05)
    assert a.tree_data_path == ["a.jsonl", "b.parquet"] and a.tree_valid_data_path == ["v.jsonl"]
    assert (a.tree_pad_to_multiple_of, a.tree_lookahead, a.tree_hybrid_pattern) == (16, 3, "MG*-|*E")


@pytest.mark.parametrize("argv", [["--tree-loss", "kto"], ["--tree-cp-planner", "ring"], ["--tree-bad-sample", "warn"],
                                  ["--tree-max-tokens-per-mb", "0"], ["--tree-lookahead", "-1"],
                                  ["--tree-pad-to-multiple-of", "-8"]])
def test_add_tree_args_rejects_bad_values(argv, capsys):
    with pytest.raises(SystemExit):
        _parse(argv)


def test_validate_fills_derived_defaults_and_is_a_noop_without_tree_packing():
    a = _megatron_like()
    assert validate_tree_args(a) is a and (a.tree_max_tokens_per_mb, a.tree_pad_to_multiple_of) == (64, 8)
    a = _megatron_like(tensor_model_parallel_size=3, sequence_parallel=True, seq_length=48, max_position_embeddings=48)
    a.tree_max_tokens_per_mb = None
    validate_tree_args(a)
    assert (a.tree_max_tokens_per_mb, a.tree_pad_to_multiple_of) == (48, 24)  # budget from --seq-length, lcm(8, TP)
    validate_tree_args(_megatron_like(context_parallel_size=4))  # tree CP covers attention / MLP / MoE models
    off = _megatron_like(micro_batch_size=4, attention_dropout=0.1)
    off.tree_packing = False
    assert validate_tree_args(off) is off and off.tree_pad_to_multiple_of is None


@pytest.mark.parametrize("over, needle", [
    (dict(micro_batch_size=2), "--micro-batch-size must be 1"),
    (dict(attention_dropout=0.1), "--attention-dropout must be 0"),
    (dict(tensor_model_parallel_size=4, sequence_parallel=True, tree_pad_to_multiple_of=6),
     "must be a multiple of the tensor-parallel size (4)"),
    (dict(tree_pad_to_multiple_of=24), "must be a multiple of --tree-pad-to-multiple-of (24)"),
    (dict(tree_max_tokens_per_mb=None, seq_length=None), "set --tree-max-tokens-per-mb"),
    (dict(calculate_per_token_loss=False), "--calculate-per-token-loss is required"),
    (dict(sft=True), "--sft"),
    (dict(dataloader_type="single"), "--dataloader-type must be external"),
    (dict(rampup_batch_size=[1, 1, 10]), "--rampup-batch-size"),
    (dict(train_samples=1000), "--train-iters"),
    (dict(mtp_num_layers=1, pipeline_model_parallel_layout="Et*2|mL"), "places every MTP layer on the last"),
    (dict(mtp_num_layers=1, tree_hybrid_pattern="M*-", num_layers=3), "verified for GPT, MLA, DSA and Qwen3-Next"),
    (dict(num_experts=8), "--moe-token-dispatcher-type alltoall"),
    (dict(tree_loss="grpo", tree_clip_eps=0.0), "--tree-clip-eps must be > 0"),
    (dict(tree_loss="ppo", tree_clip_eps_high=-0.1), "--tree-clip-eps-high must be > 0"),
    (dict(tree_kl_coef=-1.0), "--tree-kl-coef must be >= 0"),
    (dict(tree_data_path=["x.jsonl"]), "--tree-global-batch-samples is required"),
    (dict(tree_hybrid_pattern="MGX"), "--tree-hybrid-pattern"),
    (dict(tree_hybrid_pattern="MG*"), "--num-layers (4) must equal the number of letters of --tree-hybrid-pattern"),
    (dict(tree_hybrid_pattern="M*-E", num_layers=4), "set --num-experts"),
    (dict(position_embedding_type="mrope"), "--position-embedding-type"),
    (dict(position_embedding_type="learned_absolute", max_position_embeddings=32), "--max-position-embeddings (32)"),
])
def test_validate_tree_args_errors(over, needle):
    a = _megatron_like(**{k: v for k, v in over.items() if not k.startswith("tree_")})
    for k, v in over.items():
        if k.startswith("tree_"):
            setattr(a, k, v)
    with pytest.raises(ValueError) as e:
        validate_tree_args(a)
    assert needle in str(e.value)


def test_validate_accepts_mtp_with_tree_packing():
    validate_tree_args(_megatron_like(mtp_num_layers=2, mtp_loss_scaling_factor=0.3))
    validate_tree_args(_megatron_like(mtp_num_layers=1, experimental_attention_variant="gated_delta_net"))
    from megatron_tree.compat.dsa import stock_dsa_mtp_runs

    dsa = _megatron_like(mtp_num_layers=1, experimental_attention_variant="dsa")
    if stock_dsa_mtp_runs():  # the tree packs each sample's MTP tail rows (megatron_tree.megatron.mtp)
        validate_tree_args(dsa)
    else:
        with pytest.raises(ValueError, match="needs megatron-core >= 0.19"):
            validate_tree_args(dsa)


def test_validate_reports_every_problem_at_once():
    with pytest.raises(ValueError) as e:
        validate_tree_args(_megatron_like(micro_batch_size=2, attention_dropout=0.1, calculate_per_token_loss=False))
    assert str(e.value).count("\n  - ") == 3


# ---------------------------------------------------------------------------------------------- wire format
def _samples(seed=0, vocab=100, rl=True):
    """GRPO-like families that branch at several depths, plus a prefix sample and a duplicate."""
    from megatron_tree.tree import Sample

    rng = np.random.default_rng(seed)
    out = []
    for g in range(4):
        prompt = rng.integers(1, vocab, int(rng.integers(3, 7))).tolist()
        comps = [rng.integers(1, vocab, int(rng.integers(1, 6))).tolist() for _ in range(3)]
        comps.append(comps[0][:1] + rng.integers(1, vocab, 2).tolist())  # fork inside a completion
        comps.append(list(comps[1]))  # duplicate
        for c in comps:
            toks = prompt + c
            # near an untrained model's log-probs (-log V), so ratios fall on both sides of the clip range
            kw = dict(advantage=float(rng.normal()), old_logprobs=rng.normal(-np.log(vocab), 0.5, len(toks)),
                      ref_logprobs=rng.normal(-np.log(vocab), 0.5, len(toks))) if rl else {}
            out.append(Sample(tokens=toks, loss_mask=[0] * len(prompt) + [1] * len(c), group=g, **kw))
    out.append(Sample(tokens=out[0].tokens[:4].tolist(), **({"advantage": 0.5, "old_logprobs": np.full(4, -2.0),
                                                             "ref_logprobs": np.full(4, -2.1)} if rl else {})))
    return out


def _fields(layout, loss_map):
    out = {f"layout.{f}": getattr(layout, f).clone() for f in
           ("input_ids", "position_ids", "segment_offsets", "segment_parent", "subtree_end", "visible_until", "path_prev")}
    out["layout.num_padding"] = layout.num_padding
    for f in dataclasses.fields(loss_map):
        v = getattr(loss_map, f.name)
        out[f"loss_map.{f.name}"] = None if v is None else v.clone()
    return out


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        if a[k] is None or isinstance(a[k], int):
            assert a[k] == b[k], k
        else:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _microbatches(seed=0):
    from megatron_tree.tree import padding_microbatch
    from megatron_tree.tree import pack

    mbs = pack(_samples(seed), 48, pad_to_multiple_of=8)
    assert len(mbs) >= 2 and any(mb.layout.num_padding for mb in mbs)
    pad = padding_microbatch(48, num_rows=8, float_fields=("advantages", "old_logprobs", "ref_logprobs"))
    assert len(pad.loss_map) == 0
    return mbs + [pad]


def test_encode_decode_roundtrip_keeps_every_field_exactly():
    from megatron_tree.training.megatron_lm import decode_tree_batch, encode_tree_batch
    from megatron_tree.tree import pack

    for mb in _microbatches(0) + pack(_samples(1, rl=False), 64):
        header, payload = encode_tree_batch(mb.layout, mb.loss_map)
        assert header.dtype == payload.dtype == torch.int64
        layout, lm = decode_tree_batch(header, payload)
        _assert_same(_fields(layout, lm), _fields(mb.layout, mb.loss_map))
        layout.validate()
    # a float32 field travels as float64 and comes back as float32, bit for bit
    mb = _microbatches(0)[0]
    lm32 = dataclasses.replace(mb.loss_map, advantages=mb.loss_map.advantages.float())
    h, p = encode_tree_batch(mb.layout, lm32)
    assert torch.equal(decode_tree_batch(h, p)[1].advantages, lm32.advantages)
    with pytest.raises(ValueError, match="payload"):
        decode_tree_batch(h, p[:-1])


# ---------------------------------------------------------------------------------------------- get_batch over TP
class _Failing:
    def __iter__(self):
        return self

    def __next__(self):
        raise ValueError("bad sample on purpose")


def _tp_broadcast_body(seeds):
    import torch.distributed as dist

    from megatron_tree.cpu import megatron_core as cpu

    cpu.enable()
    from megatron.core import parallel_state as ps

    from megatron_tree.training.megatron_lm import get_batch

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    rank, tp_rank, dp_rank = dist.get_rank(), ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    # only TP rank 0 of each replica holds data, and each replica holds different data
    it = iter(_microbatches(seeds[dp_rank])) if tp_rank == 0 else None
    got = []
    while True:
        try:
            psp = get_batch(it)
        except StopIteration:
            break
        got.append(dict(_fields(psp.layout, psp.loss_map), row_samples=psp.row_samples,
                        row_inv_length=psp.row_inv_length))
        assert psp.max_seqlen_q == psp.layout.num_rows and psp.qkv_format == "sbhd"
    # an error on the source reaches the peers instead of leaving them in the broadcast
    err = None
    try:
        get_batch(_Failing() if tp_rank == 0 else None)
    except Exception as e:  # noqa: BLE001 - the test inspects which exception each rank saw
        err = f"{type(e).__name__}: {e}"
    return dict(rank=rank, dp_rank=dp_rank, src=ps.get_tensor_model_parallel_src_rank(), got=got, err=err)


def test_get_batch_broadcasts_tree_metadata_over_tp():
    seeds = (3, 4)
    results = run_distributed(_tp_broadcast_body, 4, seeds, timeout=120)  # TP 2 x DP 2
    assert [r["src"] for r in results] == [0, 0, 2, 2]
    for r in results:
        want = [dict(_fields(mb.layout, mb.loss_map), **dict(zip(("row_samples", "row_inv_length"),
                                                                 mb.row_sample_stats())))
                for mb in _microbatches(seeds[r["dp_rank"]])]
        assert len(r["got"]) == len(want)
        for g, w in zip(r["got"], want):
            _assert_same(g, w)
    assert results[0]["got"][0]["layout.num_padding"] is not None
    assert not torch.equal(results[0]["got"][0]["layout.input_ids"], results[2]["got"][0]["layout.input_ids"])
    assert results[0]["err"] == results[2]["err"] == "ValueError: bad sample on purpose"
    assert results[1]["err"].startswith("RuntimeError: rank 0 ") and results[3]["err"].startswith("RuntimeError: rank 2 ")


def _carry_tp_body():
    import torch.distributed as dist

    from megatron_tree.cpu import megatron_core as cpu

    cpu.enable()
    from megatron.core import parallel_state as ps

    from megatron_tree.megatron.carry import carry_items
    from megatron_tree.training import megatron_lm as hooks
    from megatron_tree.tree import pack

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    steps = [[list(range(1, 20)), list(range(1, 12)) + [60, 61, 62, 63], [70, 71, 72]],
             [list(range(30, 47)), list(range(30, 40)) + [90, 91]]]
    # TP rank 0 holds the stream of carry items, step after step (what MicrobatchStream(carry=True) yields)
    # the second step keeps its exporters' graphs (--tree-carry-memory): the peer makes keep / release items too
    items = [item for tokens, keep in zip(steps, (None, True)) for item in carry_items(pack(tokens, 8, carry=True),
                                                                                       keep=keep)]
    it = iter(items) if ps.get_tensor_model_parallel_rank() == 0 else None
    got, stores = [], []
    for _ in range(len(items)):
        item = hooks._next_carry_item(it)
        got.append((item.position, item.phase, None if item.mb.carry is None else item.mb.carry.index,
                    tuple(item.mb.sample_ids), item.mb.layout.input_ids.tolist(), item.mb.owned_rows))
        if item.store not in stores:
            stores.append(item.store)
    return dict(rank=dist.get_rank(), got=got, stores=len(stores), lifetimes=[len(st._lifetimes) for st in stores],
                left=len(hooks._peer_items))


def test_carry_items_reach_the_tensor_parallel_peer():
    """``--tree-carry`` through the hooks under TP 2: Megatron-LM builds the data on TP rank 0 only; the
    peer gets each step's microbatches and its kept exporters once and makes the same items (order, phase, rows,
    samples; a step with kept graphs too), with a store of its own per step, its lifetimes set."""
    r0, r1 = run_distributed(_carry_tp_body, 2, timeout=120)
    assert r0["got"] == r1["got"] and len(r0["got"]) > 8
    assert {phase for _, phase, *_ in r0["got"]} == {"fill", "run", "restore", "keep", "release"}
    assert r0["stores"] == r1["stores"] == 2 and r1["lifetimes"] == r0["lifetimes"] and min(r0["lifetimes"]) > 0
    assert r1["left"] == 0


# ---------------------------------------------------------------------------------------------- forward_step
def _lm_args(*extra):
    a = _parse(["--tree-packing", "--tree-max-tokens-per-mb", "48", *extra])
    for k, v in dict(vocab_size=100, padded_vocab_size=100, transformer_impl="local", normalization="RMSNorm",
                     untie_embeddings_and_output_weights=True, position_embedding_type="rope",
                     max_position_embeddings=48, micro_batch_size=1, attention_dropout=0.0, num_layers=3).items():
        setattr(a, k, v)
    return a


def _flat_logprobs(stock, sample, V):
    """[L-1, V] float64 log-softmax of the stock (non-tree) GPTModel on one sample alone."""
    toks = torch.as_tensor(sample.tokens, dtype=torch.long)
    L = len(toks)
    logits = stock(toks[None], torch.arange(L)[None], None)  # stock causal attention, physical positions
    return torch.log_softmax(logits[0].double(), -1)[: L - 1]


def _forward_body():
    from megatron_tree.cpu import megatron_core as cpu

    cpu.enable(kernels=True)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tree.training import megatron_lm as H
    from megatron_tree.megatron.forward_step import tree_forward_step
    from megatron_tree.training.models import ModelArgs, make_config
    from megatron_tree.tree import pack

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.set_default_dtype(torch.float64)  # Megatron's torch norms take the default dtype
    model_parallel_cuda_manual_seed(7)
    torch.manual_seed(7)
    V = 100
    config = make_config(ModelArgs(num_layers=3, vocab_size=V), dtype=torch.float64)
    config.variable_seq_lengths = False  # model_provider must switch it on
    sft_args = _lm_args("--tree-loss", "sft")
    model = H.model_provider(config=config, args=sft_args)
    out = {"variable_seq_lengths": config.variable_seq_lengths, "model": type(model).__name__}
    stock = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=V, max_sequence_length=48,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    missing, unexpected = stock.load_state_dict(model.state_dict(), strict=False)
    assert not [k for k in missing + unexpected if not k.endswith("_extra_state")], (missing, unexpected)

    samples = _samples(5)
    mbs = pack(samples, 48, pad_to_multiple_of=8)
    assert len(mbs) >= 2

    # --- sft: value and parameter gradients against the per-sample oracle on the stock model
    model.zero_grad()
    tree_loss, tree_tokens = 0.0, 0
    it = iter(mbs)
    for _ in mbs:
        output, lf = H.forward_step(it, model, args=sft_args)
        loss, n, report = lf(output)
        loss.backward()
        tree_loss += float(loss)
        tree_tokens += int(n)
        assert torch.allclose(report["lm loss"], torch.stack([loss.detach(), n.to(loss.dtype)]).to(report["lm loss"].dtype))
    tree_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    flat_loss, flat_tokens = 0.0, 0
    stock.zero_grad()
    for s in samples:
        lp = _flat_logprobs(stock, s, V)
        t = np.nonzero(s.target_mask())[0]
        nll = -lp[torch.as_tensor(t - 1), torch.as_tensor(s.tokens[t], dtype=torch.long)].sum()
        nll.backward()
        flat_loss += float(nll)
        flat_tokens += len(t)
    sp = dict(stock.named_parameters())
    out["sft"] = (tree_loss, flat_loss, tree_tokens, flat_tokens,
                  max(float((tree_grads[k] - sp[k].grad).abs().max() / sp[k].grad.abs().max().clamp_min(1e-30))
                      for k in tree_grads))
    # same microbatch through training.tree_forward_step (the path verify uses)
    o1, l1 = H.forward_step(iter(mbs[:1]), model, args=sft_args)
    o2, l2 = tree_forward_step(iter(mbs[:1]), model, loss_type="sft")
    out["same_as_training"] = float(l1(o1)[0]) == float(l2(o2)[0])

    # --- grpo with asymmetric clipping and a KL term: value against a hand-written per-sample oracle
    eps, eps_hi, beta = 0.1, 0.3, 0.05
    g_args = _lm_args("--tree-loss", "grpo", "--tree-clip-eps", str(eps), "--tree-clip-eps-high", str(eps_hi),
                      "--tree-kl-coef", str(beta))
    with torch.no_grad():
        it = iter(mbs)
        tree_g = sum(float(lf(o)[0]) for o, lf in (H.forward_step(it, model, args=g_args) for _ in mbs))
        flat_g, below, above = 0.0, 0, 0
        for s in samples:
            lp = _flat_logprobs(stock, s, V)
            t = np.nonzero(s.target_mask())[0]
            logp = lp[torch.as_tensor(t - 1), torch.as_tensor(s.tokens[t], dtype=torch.long)]
            old = torch.as_tensor(s.old_logprobs[t])
            ref = torch.as_tensor(s.ref_logprobs[t])
            A = float(s.advantage)
            r = torch.exp(logp - old)
            below, above = below + int((r < 1 - eps).sum()), above + int((r > 1 + eps_hi).sum())
            surrogate = -torch.minimum(r * A, torch.clamp(r, 1 - eps, 1 + eps_hi) * A)
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            flat_g += float((surrogate + beta * kl).sum())
    out["grpo"] = (tree_g, flat_g, below, above)

    # --- hybrid pattern through model_provider: the layer kinds follow the letters
    hy_args = _lm_args("--tree-hybrid-pattern", "MG*-")
    hy_args.num_layers = 4
    hy_cfg = make_config(ModelArgs(kind="hybrid", pattern="MG*-", vocab_size=V), dtype=torch.float64)
    hy = H.model_provider(config=hy_cfg, args=hy_args)
    out["hybrid_layers"] = [type(layer.self_attention).__name__ for layer in hy.decoder.layers]
    o, lf = H.forward_step(iter(mbs[:1]), hy, args=hy_args)
    o2, lf2 = tree_forward_step(iter(mbs[:1]), hy, loss_type="sft")
    out["hybrid_loss"] = (float(lf(o)[0]), float(lf2(o2)[0]))
    try:
        H.forward_step(iter(mbs), model, args=_parse([]))
    except ValueError as e:
        out["no_tree_packing"] = str(e)

    # --- float32 sanity: same comparison of the sft loss in single precision
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(7)
    cfg32 = make_config(ModelArgs(num_layers=3, vocab_size=V), dtype=torch.float32)
    m32 = H.model_provider(config=cfg32, args=sft_args)
    s32 = GPTModel(cfg32, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=V, max_sequence_length=48,
                   position_embedding_type="rope", share_embeddings_and_output_weights=False)
    s32.load_state_dict(m32.state_dict(), strict=False)
    with torch.no_grad():
        it = iter(mbs)
        t32 = sum(float(lf(o)[0]) for o, lf in (H.forward_step(it, m32, args=sft_args) for _ in mbs))
        f32 = 0.0
        for s in samples:
            lp = _flat_logprobs(s32, s, V)
            t = np.nonzero(s.target_mask())[0]
            f32 -= float(lp[torch.as_tensor(t - 1), torch.as_tensor(s.tokens[t], dtype=torch.long)].sum())
    out["sft_float32"] = (t32, f32)
    return out


@pytest.fixture(scope="module")
def forward_results():
    return run_distributed(_forward_body, 1, timeout=150)[0]


def test_forward_step_loss_and_grads_equal_per_sample_training(forward_results):
    r = forward_results
    assert r["model"] == "TreeGPTModel" and r["variable_seq_lengths"] is True
    tree_loss, flat_loss, tree_tokens, flat_tokens, grad_err = r["sft"]
    assert tree_tokens == flat_tokens > 0
    assert tree_loss == pytest.approx(flat_loss, rel=1e-10)
    assert grad_err < 1e-9
    assert r["same_as_training"]
    t32, f32 = r["sft_float32"]
    assert t32 == pytest.approx(f32, rel=1e-5)


def test_forward_step_policy_loss_uses_tree_loss_settings(forward_results):
    tree_g, flat_g, below, above = forward_results["grpo"]
    assert below > 0 and above > 0  # both clip bounds are active, so both flags are exercised
    assert tree_g == pytest.approx(flat_g, rel=1e-10, abs=1e-10)


def test_model_provider_builds_hybrid_stacks_and_requires_tree_packing(forward_results):
    r = forward_results
    assert r["hybrid_layers"] == ["TreeMambaMixer", "TreeGatedDeltaNet", "SelfAttention", "IdentityOp"]
    assert np.isfinite(r["hybrid_loss"][0]) and r["hybrid_loss"][0] == r["hybrid_loss"][1]
    assert "--tree-packing" in r["no_tree_packing"]


# ---------------------------------------------------------------------------------------------- data provider
def _write_jsonl(path, samples):
    with open(path, "w") as f:
        for s in samples:
            f.write(json.dumps({"tokens": s.tokens.tolist(), "loss_mask": s.target_mask().astype(int).tolist(),
                                "group": s.group}) + "\n")


def _provider_args(path, **over):
    a = _lm_args("--tree-data-path", str(path), "--tree-global-batch-samples", "7", "--tree-lookahead", "1")
    a.global_batch_size, a.seed, a.iteration = 3, 11, 0
    for k, v in over.items():
        setattr(a, k, v)
    return a


def _take(stream, n):
    return [tuple(next(stream).sample_ids) for _ in range(n)]


def test_datasets_provider_fixed_microbatches_per_step_and_exact_resume(tmp_path):
    from megatron_tree.training.megatron_lm import train_valid_test_datasets_provider

    samples = _samples(2, rl=False)
    _write_jsonl(tmp_path / "train.jsonl", samples)
    _write_jsonl(tmp_path / "valid.jsonl", samples[:5])
    args = _provider_args(tmp_path / "train.jsonl", tree_valid_data_path=[str(tmp_path / "valid.jsonl")])
    train, valid, test = train_valid_test_datasets_provider([0, 0, 0], args=args)
    assert test is None and valid is not None
    n, G = len(samples), 7
    steps_per_epoch = -(-n // G)
    per_step = 3  # --global-batch-size 3 / DP 1 microbatches, whatever a step packs into
    seen = []
    for step in range(steps_per_epoch + 2):
        mbs = [next(train) for _ in range(per_step)]
        assert train.step.global_step == step and len({id(m) for m in mbs}) <= per_step
        ids = [i for m in mbs for i in m.sample_ids]
        assert len(ids) == len(set(ids)) == min(G, n - (step % steps_per_epoch) * G)
        assert all(m.num_rows <= 48 and m.num_rows % 8 == 0 for m in mbs)
        seen += ids if step < steps_per_epoch else []
    assert sorted(seen) == list(range(n))  # exactly once per epoch, across epochs it cycles
    fresh = train_valid_test_datasets_provider([0, 0, 0], args=_provider_args(tmp_path / "train.jsonl"))[0]
    resumed_args = _provider_args(tmp_path / "train.jsonl", iteration=steps_per_epoch + 1)
    resumed = train_valid_test_datasets_provider([0, 0, 0], args=resumed_args)[0]
    _take(fresh, per_step * (steps_per_epoch + 1))
    assert _take(resumed, per_step * 2) == _take(fresh, per_step * 2)
    assert resumed.step.global_step == steps_per_epoch + 2
    assert sorted(i for ids in _take(valid, per_step) for i in ids) == [0, 1, 2, 3, 4]
    for s in (train, valid, fresh, resumed):
        s.close()


def test_datasets_provider_explains_too_few_microbatch_slots(tmp_path):
    from megatron_tree.training.megatron_lm import train_valid_test_datasets_provider

    _write_jsonl(tmp_path / "t.jsonl", _samples(2, rl=False))
    args = _provider_args(tmp_path / "t.jsonl", global_batch_size=1, tree_global_batch_samples=30)
    args.tree_lookahead = 0
    train = train_valid_test_datasets_provider([0, 0, 0], args=args)[0]
    with pytest.raises(ValueError, match="--global-batch-size / data-parallel size"):
        next(train)
    with pytest.raises(ValueError, match="--tree-data-path"):
        train_valid_test_datasets_provider([0, 0, 0], args=_lm_args())


def test_datasets_provider_checks_token_ids_against_the_user_vocabulary(tmp_path):
    """--vocab-size 256 pads the embedding to 384 rows; a token id 263 is still out of vocabulary: the
    error names the sample's file:line and 256, not the padded 384."""
    from megatron_tree.training.megatron_lm import train_valid_test_datasets_provider

    path = tmp_path / "v.jsonl"
    samples = _samples(3, vocab=256, rl=False)
    _write_jsonl(path, samples)
    lines = path.read_text().splitlines(keepends=True)
    lines[2] = json.dumps({"tokens": [5, 17, 263, 40], "loss_mask": [0, 1, 1, 1]}) + "\n"  # line 3
    lines[5] = json.dumps({"tokens": [5, 255, 3], "loss_mask": [0, 1, 1]}) + "\n"  # 255: the last id, fine
    path.write_text("".join(lines))
    args = _provider_args(path, vocab_size=256, padded_vocab_size=384)
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: token id 263 >= vocab size 256")):
        train_valid_test_datasets_provider([0, 0, 0], args=args)
    # skip: exactly the out-of-vocabulary line is dropped and named; the id 255 line trains
    args = _provider_args(path, vocab_size=256, padded_vocab_size=384, tree_bad_sample="skip")
    train = train_valid_test_datasets_provider([0, 0, 0], args=args)[0]
    assert len(train.pipeline.samples) == len(samples) - 1
    assert [w for w, _ in train.pipeline.read_report.skipped] == [f"{path}:3"]
    train.close()


def test_user_vocab_size_is_the_given_one_then_the_tokenizers_never_the_padded_one(monkeypatch):
    from megatron_tree.training.megatron_lm import user_vocab_size

    fake = types.ModuleType("megatron.training")

    def no_tokenizer():
        raise AssertionError("tokenizer is not initialized.")  # what Megatron-LM's get_tokenizer does

    fake.get_tokenizer = no_tokenizer
    monkeypatch.setitem(sys.modules, "megatron.training", fake)
    assert user_vocab_size(types.SimpleNamespace(vocab_size=256, padded_vocab_size=384)) == 256
    assert user_vocab_size(types.SimpleNamespace(vocab_size=None, padded_vocab_size=384)) is None
    # --vocab-size wins over the NullTokenizer's size (257: its EOD id 256 is no data token)
    fake.get_tokenizer = lambda: types.SimpleNamespace(vocab_size=257)
    assert user_vocab_size(types.SimpleNamespace(vocab_size=256, padded_vocab_size=384)) == 256
    fake.get_tokenizer = lambda: types.SimpleNamespace(vocab_size=50257)  # e.g. GPT-2's, no --vocab-size
    assert user_vocab_size(types.SimpleNamespace(vocab_size=None, padded_vocab_size=50304)) == 50257


def test_datasets_provider_reports_skipped_samples_on_rank_0(tmp_path, capsys):
    from megatron_tree.training.megatron_lm import train_valid_test_datasets_provider

    path = tmp_path / "s.jsonl"
    samples = _samples(4, rl=False)
    _write_jsonl(path, samples)
    lines = path.read_text().splitlines(keepends=True)
    lines.insert(1, '{"tokens": [1, 2,, 3]}\n')  # line 2: invalid JSON at column 18
    lines.insert(4, '{"tokens": []}\n')  # line 5: empty
    path.write_text("".join(lines))
    args = _provider_args(path, tree_bad_sample="skip")
    capsys.readouterr()
    train = train_valid_test_datasets_provider([0, 0, 0], args=args)[0]
    out = capsys.readouterr().out
    assert train.pipeline.skipped == 2 and len(train.pipeline.samples) == len(samples)
    assert "> tree train data: skipped 2 bad samples (--tree-bad-sample skip):" in out, out
    assert f"  {path}:2:18: invalid JSON: Expecting value\n" in out, out
    assert f"  {path}:5: empty sample (no tokens)" in out, out
    train.close()
    # nothing skipped: nothing printed about it
    _write_jsonl(path, samples)
    train = train_valid_test_datasets_provider([0, 0, 0], args=_provider_args(path, tree_bad_sample="skip"))[0]
    assert train.pipeline.skipped == 0 and "skipped" not in capsys.readouterr().out
    train.close()


# ---------------------------------------------------------------------------------------------- examples
@pytest.mark.parametrize("script", ["pretrain_tree_gpt.py", "pretrain_tree_hybrid.py"])
def test_example_calls_pretrain_with_the_tree_hooks(script, monkeypatch):
    from megatron.core.enums import ModelType

    from megatron_tree.training import megatron_lm as H

    calls = []
    stub = types.ModuleType("megatron.training")
    stub.pretrain = lambda *a, **k: calls.append((a, k))
    stub.get_args = lambda: argparse.Namespace(tree_hybrid_pattern=None)
    monkeypatch.setitem(sys.modules, "megatron.training", stub)
    runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
    (a, k), = calls
    assert a[0] is H.train_valid_test_datasets_provider and a[2] == ModelType.encoder_or_decoder
    assert a[3] is H.forward_step and k["extra_args_provider"] is add_tree_args
    assert k["args_defaults"]["dataloader_type"] == "external"
    if script == "pretrain_tree_gpt.py":
        assert a[1] is H.model_provider
    else:
        with pytest.raises(ValueError, match="--tree-hybrid-pattern"):
            a[1]()
    # the documented command line parses with our flags, and names a torchrun launch
    doc = ast.get_docstring(ast.parse((ROOT / "examples" / script).read_text()))
    assert "torchrun" in doc
    tree_flags = set(re.findall(r"--tree-[a-z-]+", doc))
    known = {o for act in add_tree_args(argparse.ArgumentParser())._actions for o in act.option_strings}
    assert tree_flags and tree_flags <= known and "--tree-packing" in tree_flags


# ---------------------------------------------------------------------------------------------- SLURM
SBATCH = sorted((ROOT / "examples" / "slurm").glob("*.sbatch"))


def test_sbatch_scripts_exist_and_pass_bash_n():
    assert {p.name for p in SBATCH} >= {"train_tree_gpt.sbatch", "train_tree_hybrid.sbatch"}
    bash = shutil.which("bash")
    for p in SBATCH:
        r = subprocess.run([bash, "-n", str(p)], capture_output=True, text=True)
        assert r.returncode == 0, f"{p.name}: {r.stderr}"
        text = p.read_text()
        assert text.startswith("#!/bin/bash") and "#SBATCH --nodes" in text
        for needle in ("scontrol show hostnames", "srun", "torchrun", "MASTER_ADDR", "latest_checkpointed_iteration.txt",
                       "--tree-packing", "--calculate-per-token-loss", "--save"):
            assert needle in text, f"{p.name} lacks {needle}"
    # a broken script is caught (the check can fail)
    r = subprocess.run([bash, "-n"], input="if true; then\n echo x\n", capture_output=True, text=True)
    assert r.returncode != 0


# ---------------------------------------------------------------------------------------------- patches
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def check_unified_diff(text: str) -> list[str]:
    """Paths a well-formed unified diff patches; raises ValueError naming the first malformed line.

    Each file section is ``--- a/PATH`` then ``+++ b/PATH`` (same path) then hunks whose line
    counts match their headers (' ', '-', '+' lines; '\\ No newline' markers allowed)."""
    lines = text.splitlines()
    paths, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("--- "):
            i += 1  # free text (the "why" header, git's diff/index lines)
            continue
        old = lines[i][4:].split("\t")[0]
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise ValueError(f"line {i + 2}: '+++ ' must follow '--- '")
        new = lines[i + 1][4:].split("\t")[0]
        if not (old.startswith("a/") and new.startswith("b/") and old[2:] == new[2:]):
            raise ValueError(f"line {i + 1}: expected '--- a/PATH' and '+++ b/PATH' for one PATH, got {old!r} {new!r}")
        paths.append(new[2:])
        i += 2
        hunks = 0
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK.match(lines[i])
            if not m:
                raise ValueError(f"line {i + 1}: malformed hunk header {lines[i]!r}")
            n_old = int(m.group(2) if m.group(2) is not None else 1)
            n_new = int(m.group(4) if m.group(4) is not None else 1)
            i += 1
            while n_old > 0 or n_new > 0:
                if i >= len(lines):
                    raise ValueError("diff ends inside a hunk")
                tag = lines[i][:1]
                if tag == " " or lines[i] == "":
                    n_old, n_new = n_old - 1, n_new - 1
                elif tag == "-":
                    n_old -= 1
                elif tag == "+":
                    n_new -= 1
                elif tag != "\\":
                    raise ValueError(f"line {i + 1}: unexpected line inside a hunk: {lines[i]!r}")
                if n_old < 0 or n_new < 0:
                    raise ValueError(f"line {i + 1}: hunk longer than its header says")
                i += 1
            hunks += 1
        if not hunks:
            raise ValueError(f"{paths[-1]}: no hunks")
    if not paths:
        raise ValueError("no '--- a/PATH' / '+++ b/PATH' file header")
    return paths


_GOOD = """Why: example.
--- a/megatron/training/x.py
+++ b/megatron/training/x.py
@@ -1,3 +1,4 @@
 a
-b
+c
+d
 e
"""


def test_patch_checker_accepts_good_and_rejects_bad_diffs():
    assert check_unified_diff(_GOOD) == ["megatron/training/x.py"]
    for bad in (_GOOD.replace("+d\n", ""),  # hunk shorter than its header
                _GOOD.replace("+++ b/megatron/training/x.py", "+++ b/other.py"),
                _GOOD.replace("@@ -1,3 +1,4 @@", "@@ -1,3 +1,4"),
                "just prose\n"):
        with pytest.raises(ValueError):
            check_unified_diff(bad)


def test_patches_are_well_formed_and_listed_in_the_readme():
    pdir = ROOT / "patches"
    readme = (pdir / "README.md").read_text()
    assert "core_v0.16.1" in readme
    patches = sorted(p for p in pdir.iterdir() if p.suffix in (".patch", ".diff"))
    for p in patches:
        text = p.read_text()
        first = text.splitlines()[0]
        assert first.lower().startswith("why:") and len(first) > 10, f"{p.name}: first line must say why"
        paths = check_unified_diff(text)
        assert all(q.startswith(("megatron/", "pretrain_", "gpt_builders", "model_provider")) for q in paths), paths
        assert p.name in readme, f"{p.name} is not listed in patches/README.md"
    listed = set(re.findall(r"\b[\w.-]+\.(?:patch|diff)\b", readme))
    assert listed == {p.name for p in patches}, "patches/README.md lists patch files that do not exist"
    if not patches:  # then the README must say why none is needed
        assert "no patch" in readme.lower()


# ---------------------------------------------------------------------------------------------- context parallel
def _cp_forward_body(strategy):
    """The hooks' forward_step at CP2 (each rank its owned rows of the --tree-cp-planner plan) vs CP1."""
    from megatron_tree.cpu import megatron_core as cpu

    cpu.enable(kernels=True)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tree.training import megatron_lm as H
    from megatron_tree.training.models import ModelArgs, make_config
    from megatron_tree.tree import pack

    mbs = pack(_samples(5), 48, pad_to_multiple_of=8)
    out = {}
    for cp in (2, 1):
        ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=cp)
        torch.set_default_dtype(torch.float64)
        model_parallel_cuda_manual_seed(7)
        torch.manual_seed(7)
        config = make_config(ModelArgs(num_layers=2, vocab_size=100), cp=cp, dtype=torch.float64)
        args = _lm_args("--tree-loss", "sft", "--tree-cp-planner", strategy)
        args.context_parallel_size = cp
        model = H.model_provider(config=config, args=args)
        loss_sum, tokens = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.int64)
        it = iter(mbs)
        for _ in mbs:
            output, lf = H.forward_step(it, model, args=args)
            loss, n, _ = lf(output)
            loss.backward()
            loss_sum, tokens = loss_sum + loss.detach(), tokens + n
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        if cp > 1:  # what Megatron's DP x CP gradient reduction does
            group = ps.get_context_parallel_group()
            for g in grads.values():
                torch.distributed.all_reduce(g, group=group)
            torch.distributed.all_reduce(loss_sum, group=group)
            torch.distributed.all_reduce(tokens, group=group)
        out[cp] = (float(loss_sum), int(tokens), grads)
        ps.destroy_model_parallel()
        torch.set_default_dtype(torch.float32)
    (l2, n2, g2), (l1, n1, g1) = out[2], out[1]
    err = max(float((g2[k] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for k, g in g1.items())
    return l2, l1, n2, n1, err


@pytest.mark.parametrize("strategy", ["balanced", "zigzag"])
def test_forward_step_under_context_parallelism_equals_cp1(strategy):
    for l2, l1, n2, n1, err in run_distributed(_cp_forward_body, 2, strategy, timeout=200):
        assert n2 == n1 > 0 and l2 == pytest.approx(l1, rel=1e-12) and err < 1e-10
