"""Tree DeepSeek Sparse Attention modules (`megatron_tree.megatron.dsa`) against stock Megatron-Core DSA.

Oracle: Megatron-Core's own ``GPTModel`` with stock ``MLASelfAttention`` and stock ``DSAttention`` /
``DSAIndexer`` (``training.dsa_oracle.stock_oracle_class()``: the stock class, its forward unchanged) run on each
sample alone, under ``training.dsa_oracle.float64_oracle`` (stock's float32 upcasts kept at float64; ``topk``
ties in ascending position order, our tie rule on one sample) with the torch Hadamard stand-in
(``training.dsa_oracle.enable``). Checked in float64 on a forest where many branches share a long prompt (so
their queries select the same prefix keys), whose first rows see fewer than ``topk`` keys, with a
layer whose index scores are all exactly 0 (every candidate ties: the rule alone picks), dense and
sparse indexer loss, and IndexShare: per-occurrence log-probs, the canonical selections of every
row and layer, the indexer loss and every parameter gradient (the indexer learns only from its
loss). Stock checkpoints load into the tree model and back. Then ``megatron-tree verify --model dsa``
(tree-packed vs per-sample stock training, one optimizer step) with IndexShare, sparse loss, full
recomputation, TP2, PP2 and tree CP2, and its two planted faults, which must fail.
"""
from __future__ import annotations

import traceback

import pytest
import torch

try:
    from dist import init_megatron, run_distributed
except ImportError:  # run from the repository root as tests.*
    from tests.dist import init_megatron, run_distributed

from megatron_tree.training.verify import VerifyConfig, run_verify_many
from per_sample import coef, randomize  # tests/per_sample.py
from verify_checks import check_verify  # tests/verify_checks.py

V = 64
F64 = dict(rtol=1e-10, atol=1e-12)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
SAMPLES = [PROMPT + [11, 12, 13], PROMPT + [14, 15], PROMPT + [16, 17, 18, 19], PROMPT + [11, 20],
           PROMPT[:4] + [30, 31], [40, 41, 42], PROMPT + [11, 12, 13]]  # forks at depths 10, 11, 4; a duplicate
# name -> config fields over models.DSA_DEFAULTS (topk 4, dense loss, coefficient 0.5)
CASES = {
    "dense_loss": dict(),
    "sparse_loss_index_share": dict(dsa_indexer_use_sparse_loss=True, dsa_indexer_topk_freq=2,
                                    dsa_indexer_skip_topk_offset=0),
}


# ------------------------------------------------------------------------------------ CPU units
def test_hadamard_stand_in():
    from megatron_tree.ops.hadamard import hadamard_rotate

    d = 8
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:  # Sylvester construction, independent of the butterfly code
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = torch.randn(3, 2, d, dtype=torch.float64)
    torch.testing.assert_close(hadamard_rotate(x), x @ h.T * d ** -0.5, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(hadamard_rotate(hadamard_rotate(x)), x, rtol=1e-14, atol=1e-14)  # orthonormal
    assert hadamard_rotate(x.float()).dtype == torch.float32
    with pytest.raises(ValueError, match="power of two"):
        hadamard_rotate(torch.randn(2, 6))


def test_stable_topk_is_our_tie_rule_and_scoped():
    from megatron_tree.training.dsa_oracle import stable_topk

    x = torch.tensor([[0.0, 2.0, 0.0, 2.0, 1.0, 0.0]])
    before = torch.Tensor.topk
    with stable_topk():
        v, i = x.topk(4, dim=-1)
    assert i.tolist() == [[1, 3, 4, 0]] and v.tolist() == [[2.0, 2.0, 1.0, 0.0]]  # score desc, position asc
    assert torch.Tensor.topk is before  # restored on exit


def test_index_share_rule():
    from megatron_tree.compat.dsa import is_skip_topk_layer, source_topk_layer

    assert [is_skip_topk_layer(n, 0, 2) for n in range(1, 6)] == [False, True, False, True, False]
    assert [source_topk_layer(n, 0, 2) for n in range(1, 6)] == [1, 1, 3, 3, 5]
    assert [is_skip_topk_layer(n, 2, 3) for n in range(1, 7)] == [False, False, True, True, False, True]
    assert not any(is_skip_topk_layer(n, 0, 1) for n in range(1, 5))


# ------------------------------------------------------------------------------------ stock interop
def _stock_spec(core_cls):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexer,
        DSAIndexerSubmodules,
        DSAttentionSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_tree.megatron.dsa import DuplicatedLinear

    from megatron.core.models.backends import LocalSpecProvider

    spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")
    norm = LocalSpecProvider().layer_norm(rms_norm=False, for_qk=True)  # the indexer's k_norm (LayerNorm)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=core_cls, submodules=DSAttentionSubmodules(indexer=ModuleSpec(module=DSAIndexer, submodules=DSAIndexerSubmodules(
            linear_wq_b=DuplicatedLinear, linear_wk=DuplicatedLinear, k_norm=norm, linear_weights_proj=DuplicatedLinear))))
    return spec


def _case(name, mb):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.experimental_attention_variant import dsa as stock_dsa

    from megatron_tree.training import dsa_oracle as cdsa
    from megatron_tree.megatron.dsa import TreeDSAttention, TreeDSAIndexer, capture_selected
    from megatron_tree.megatron.model import TreeGPTModel
    from megatron_tree.megatron.packed_seq import tree_packed_seq_params
    from megatron_tree.megatron.specs import get_tree_gpt_layer_spec
    from megatron_tree.training.models import ModelArgs, make_config

    cfg = make_config(ModelArgs(kind="dsa", num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                                vocab_size=V, extra=dict(CASES[name])), dtype=torch.float64)
    stock = GPTModel(cfg, _stock_spec(cdsa.stock_oracle_class()), V, 64, position_embedding_type="rope")
    tree = TreeGPTModel(cfg, get_tree_gpt_layer_spec(experimental_attention_variant="dsa", normalization="RMSNorm",
                                                     use_transformer_engine=False), V, 64, position_embedding_type="rope")
    randomize(stock, seed=sum(map(ord, name)))
    with torch.no_grad():  # layer 1's index queries are 0: every score is exactly 0, all candidates tie
        stock.decoder.layers[0].self_attention.core_attention.indexer.linear_wq_b.weight.zero_()
    cores = [layer.self_attention.core_attention for layer in tree.decoder.layers]
    res = {"cores": [type(c).__name__ for c in cores],
           "indexers": [type(c.indexer).__name__ if c.indexer is not None else None for c in cores]}
    # checkpoints: stock -> tree, tree -> a plain stock DSAttention model
    sd = stock.state_dict()
    res["stock_to_tree"] = tree.load_state_dict(sd, strict=True)
    # the plain stock class; with IndexShare on megatron-core 0.16 (which has none) the oracle's 0.19 layout
    share = CASES[name].get("dsa_indexer_topk_freq", 1) > 1
    plain_core = (cdsa.stock_oracle_class() if share and "dsa_indexer_topk_freq" not in type(cfg).__dataclass_fields__
                  else stock_dsa.DSAttention)
    plain = GPTModel(cfg, _stock_spec(plain_core), V, 64, position_embedding_type="rope")
    res["tree_to_stock"] = plain.load_state_dict(tree.state_dict(), strict=True)
    res["sharded_keys_equal"] = sorted(plain.sharded_state_dict()) == sorted(tree.sharded_state_dict())
    res["plain_equal"] = all(torch.equal(v, sd[k]) for k, v in plain.state_dict().items() if isinstance(v, torch.Tensor))

    # per sample, stock (training mode: the indexer loss is attached, its gradient flows in backward)
    stock.train()
    tree.train()
    ref, ref_sel = {}, {}
    stock_dsa.DSAIndexerLossLoggingHelper.tracker.clear()
    for i, toks in enumerate(SAMPLES):
        x = torch.as_tensor(toks)
        with cdsa.capture_stock_selected() as sel:
            logits = stock(x[None], torch.arange(len(x))[None], None)
        lp = torch.log_softmax(logits[0], -1)
        loss = sum(coef(i, t) * lp[t - 1, toks[t]] for t in range(1, len(toks)))
        loss.backward()
        for t in range(1, len(toks)):
            ref[(i, t)] = lp[t - 1, toks[t]].detach()
        ref_sel[i] = {layer: ids for _, layer, ids in sel}
    res["stock_indexer_loss"] = stock_dsa.DSAIndexerLossLoggingHelper.tracker["values"].clone()

    stock_dsa.DSAIndexerLossLoggingHelper.tracker.clear()
    psp = tree_packed_seq_params(mb)
    with capture_selected() as sel:
        lp = tree(psp.input_ids[None], psp.position_ids[None], None, packed_seq_params=psp)
    keys = list(zip(psp.loss_map.sample_index.tolist(), psp.loss_map.positions.tolist()))
    sum(coef(i, t) * lp[e] for e, (i, t) in enumerate(keys)).backward()
    res["tree_indexer_loss"] = stock_dsa.DSAIndexerLossLoggingHelper.tracker["values"].clone()
    res["lp"] = (torch.stack([lp[e] for e in range(len(keys))]).detach(), torch.stack([ref[k] for k in keys]))
    sg = dict(stock.named_parameters())
    res["grads"] = {n: (p.grad.clone(), sg[n].grad.clone()) for n, p in tree.named_parameters()}
    # selections: tree canonical rows -> positions on each sample's path, against stock's positions
    tree_sel = {layer: ids for _, layer, _, ids in sel}
    mism, total = 0, 0
    for i in mb.sample_ids:
        rows = mb.sample_rows(i).long()
        inv = torch.full((mb.layout.num_rows,), -2, dtype=torch.long)
        inv[rows] = torch.arange(len(rows))
        for layer, ids in tree_sel.items():
            got = torch.where(ids[rows] >= 0, inv[ids[rows].clamp_min(0)], ids[rows])
            want = ref_sel[i][layer]
            want = torch.cat([want, want.new_full((want.shape[0], got.shape[1] - want.shape[1]), -1)], 1)
            mism += int((got != want).any(1).sum())
            total += len(rows)
    res["selected_mismatch"], res["selected_total"] = mism, total
    # tie layer: row r selects positions 0..min(r, 3) (score 0 everywhere: smaller position first)
    layer1 = tree_sel[1]
    first = mb.sample_rows(0).long()
    inv = torch.full((mb.layout.num_rows,), -2, dtype=torch.long)
    inv[first] = torch.arange(len(first))
    pos = torch.where(layer1[first] >= 0, inv[layer1[first].clamp_min(0)], layer1[first])
    res["tie_layer_rows"] = pos[:6].tolist()
    res["few_keys_row0"] = pos[0].tolist()
    # sensitivity: the planted tie fault changes the tie layer's selections
    for c in cores:
        c.fault = "dsa_tie_order"
    with torch.no_grad(), capture_selected() as sel2:
        tree(psp.input_ids[None], psp.position_ids[None], None, packed_seq_params=tree_packed_seq_params(mb))
    res["tie_fault_changes"] = not torch.equal(dict((layer, ids) for _, layer, _, ids in sel2)[1], layer1)
    for c in cores:
        c.fault = None
    # IndexShare across a pipeline stage boundary: a skip layer without its source's selections
    skip = [c for c in cores if c.skip_topk]
    if skip:
        try:
            q = torch.zeros(mb.layout.num_rows, 1, 4, 12, dtype=torch.float64)
            skip[0](q, q, q[..., :6], packed_seq_params=tree_packed_seq_params(mb))
            res["pp_boundary_error"] = None
        except RuntimeError as e:
            res["pp_boundary_error"] = str(e)
    res["skip_layers"] = [c.layer_number for c in skip]
    res["classes"] = (isinstance(cores[0], TreeDSAttention), isinstance(cores[0].indexer, TreeDSAIndexer))
    return res


def _interop_body():
    init_megatron(tp=1, kernels=True)
    torch.set_default_dtype(torch.float64)
    from megatron_tree.training import dsa_oracle as cdsa
    from megatron_tree.tree import pack

    cdsa.enable()
    mbs = pack(SAMPLES, 128, pad_to_multiple_of=8)
    out = {"num_mbs": len(mbs), "rows": mbs[0].layout.num_rows, "flat": sum(map(len, SAMPLES))}
    for name in CASES:
        try:
            out[name] = _case(name, mbs[0])
        except Exception:  # noqa: BLE001 - reported by the test of that case
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def interop():
    return run_distributed(_interop_body, 1, timeout=300)[0]


def _result(interop, name):
    r = interop[name]
    if "error" in r:
        pytest.fail(f"case {name} raised:\n{r['error']}")
    return r


def test_forest_shares_the_prompt(interop):
    assert interop["num_mbs"] == 1 and interop["rows"] < interop["flat"]


@pytest.mark.parametrize("name", list(CASES))
def test_structure_and_checkpoints(interop, name):
    r = _result(interop, name)
    assert r["cores"] == ["TreeDSAttention"] * 4 and r["classes"] == (True, True)
    assert not r["stock_to_tree"].missing_keys and not r["stock_to_tree"].unexpected_keys
    assert not r["tree_to_stock"].missing_keys and not r["tree_to_stock"].unexpected_keys
    assert r["sharded_keys_equal"] and r["plain_equal"]
    if CASES[name].get("dsa_indexer_topk_freq", 1) > 1:
        assert r["indexers"] == ["TreeDSAIndexer", None, "TreeDSAIndexer", None] and r["skip_layers"] == [2, 4]
        assert "pipeline stage boundary" in r["pp_boundary_error"]


@pytest.mark.parametrize("name", list(CASES))
def test_tree_equals_stock_per_sample(interop, name):
    r = _result(interop, name)
    torch.testing.assert_close(*r["lp"], **F64)
    assert r["selected_total"] > 0 and r["selected_mismatch"] == 0
    torch.testing.assert_close(r["tree_indexer_loss"], r["stock_indexer_loss"], **F64)
    assert (r["stock_indexer_loss"][[0, 2]] > 0).all()
    for n, (g_tree, g_stock) in r["grads"].items():
        if not ("layers.0." in n and "indexer" in n):  # layer 1: zero index queries, all scores 0
            assert g_stock.abs().max() > 0, n  # every parameter takes part (the indexer through its loss)
        torch.testing.assert_close(g_tree, g_stock, **F64, msg=lambda m: f"grad of {n}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_ties_and_short_rows(interop, name):
    """Layer 1 scores are all exactly 0: row r selects positions 0.. in ascending order; the first row
    sees one key (the other slots are empty); the planted larger-id tie order changes the picks."""
    r = _result(interop, name)
    assert r["few_keys_row0"] == [0, -1, -1, -1]
    assert r["tie_layer_rows"][5] == [0, 1, 2, 3] and r["tie_layer_rows"][2] == [0, 1, 2, -1]
    assert r["tie_fault_changes"]


# ------------------------------------------------------------------------------- megatron-tree verify
WS1 = [
    VerifyConfig(model="dsa", families=4),
    VerifyConfig(model="dsa", families=4, dsa_sparse_loss=True, dsa_topk_freq=2, recompute="full", loss="grpo"),
    VerifyConfig(model="dsa", families=4, fault="dsa_tie_order"),
    # carry (issue 25) at a 16-row budget: K / V and indexer keys carried, each reader's top-k over its carried
    # rows and its own, the indexer loss weighted by each sample's whole length (a path in one microbatch may
    # be a prefix of it: the planted one-weight-per-row fault must still fail there)
    VerifyConfig(model="dsa", families=4, fault="dsa_loss_weight", budget=16, carry=True),
    VerifyConfig(model="dsa", families=4, dsa_sparse_loss=True, dsa_topk_freq=2, recompute="full", loss="grpo",
                 budget=16, carry=True),
]
WS2 = [
    VerifyConfig(model="dsa", families=4, tp=2),
    VerifyConfig(model="dsa", families=4, pp=2, dsa_topk_freq=2),
    VerifyConfig(model="dsa", families=4, cp=2, dsa_sparse_loss=True, dsa_topk_freq=2),
    # carry under tree CP: carried rows' K / V and indexer keys enter the CP DSA on the rank the plan gives them
    # (zero queries and loss weights), IndexShare reuses the plan rows' selections
    VerifyConfig(model="dsa", families=4, cp=2, cp_strategy="zigzag", dsa_sparse_loss=True, dsa_topk_freq=2,
                 budget=16, carry=True),
]


@pytest.fixture(scope="module")
def ws1():
    return run_verify_many(WS1)


@pytest.fixture(scope="module")
def ws2():
    return run_verify_many(WS2)


def _check(cfg, out):
    check_verify(cfg, out, exact=("selected_ids",),
                 fault_seen="selected_ids" if cfg.fault == "dsa_tie_order" else "indexer_loss")


@pytest.mark.parametrize("i", range(len(WS1)), ids=[f"{c.dsa_sparse_loss}-{c.dsa_topk_freq}-{c.fault}" + ("-carry" if c.carry else "")
                                              for c in WS1])
def test_verify_dsa_world_size_1(ws1, i):
    _check(WS1[i], ws1[i])


@pytest.mark.parametrize("i", range(len(WS2)), ids=[f"tp{c.tp}-pp{c.pp}-cp{c.cp}" + ("-carry" if c.carry else "")
                                              for c in WS2])
def test_verify_dsa_world_size_2(ws2, i):
    _check(WS2[i], ws2[i])


def test_dsa_fault_needs_a_dsa_model():
    with pytest.raises(ValueError, match="needs model='dsa'"):
        run_verify_many([VerifyConfig(model="mla", fault="dsa_tie_order")])
    with pytest.raises(ValueError, match="no sequence parallelism"):
        run_verify_many([VerifyConfig(model="dsa", tp=2, sp=True)])


def test_absorbed_mla_spec_is_refused_when_built_not_when_treeified():
    # megatron-core 0.19 lists AbsorbedMLASelfAttention inside stock specs (e.g. the Mamba stack's layer
    # kinds): treeify must pass such a spec through, and building that layer must name the way out
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from megatron_tree.megatron.specs import treeify_spec

    AbsorbedMLASelfAttention = type("AbsorbedMLASelfAttention", (), {})
    spec = treeify_spec(ModuleSpec(module=AbsorbedMLASelfAttention))
    assert spec.module is not AbsorbedMLASelfAttention
    with pytest.raises(ValueError, match="get_tree_dsa_module_spec"):
        build_module(spec)


def test_train_cli_dsa_context_parallel_matches_cp1():
    """`megatron-tree train --experimental-attention-variant dsa`: an MLA + DSA model trains on trees,
    and at --context-parallel-size 2 (tree_dsa_cp, DSA-aware plans) gives the losses of 1 rank."""
    from megatron_tree.training.launch import run_distributed as run
    from megatron_tree.training.trainer import build_train_parser, check_train_args, train

    common = ["--synthetic-preset", "many_small_64_4x16", "--synthetic-scale", "0.5", "--vocab-size", "128",
              "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--train-iters", "3",
              "--tree-global-batch-samples", "8", "--tree-max-tokens-per-mb", "256", "--lr", "1e-2", "--quiet",
              "--tree-lookahead", "1", "--experimental-attention-variant", "dsa", "--dsa-indexer-topk", "3"]
    runs = {}
    for cp in (1, 2):
        args = check_train_args(build_train_parser().parse_args(
            common + ["--context-parallel-size", str(cp), "--nproc", str(cp)]))
        runs[cp] = run(train, cp, args, timeout=300)[0]["history"]
    assert len(runs[1]) == 3
    for a, b in zip(runs[1], runs[2]):
        assert a["sample_ids"] == b["sample_ids"] and a["num_targets"] == b["num_targets"]
        assert abs(a["loss"] - b["loss"]) < 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])
    assert runs[1][-1]["loss"] < runs[1][0]["loss"]


def test_train_cli_dsa_argument_errors():
    from megatron_tree.training.trainer import build_train_parser, check_train_args

    def errors(*extra):
        with pytest.raises(ValueError) as e:
            check_train_args(build_train_parser().parse_args(["--synthetic-preset", "many_small_64_4x16", *extra]))
        return str(e.value)

    assert "--dsa-indexer-* options need" in errors("--dsa-indexer-topk", "3")
    assert "sequence parallelism" in errors("--experimental-attention-variant", "dsa", "--sequence-parallel",
                                            "--tensor-model-parallel-size", "2", "--nproc", "2")
    assert "hybrid pattern" in errors("--experimental-attention-variant", "dsa", "--hybrid-override-pattern", "M*-")
