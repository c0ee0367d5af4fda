"""Per-occurrence entropy of `TreeGPTModel` / `TreeMambaModel` against **stock** Megatron-Core models
run on each sample alone.

Oracle: Megatron-Core's own ``GPTModel`` (local block spec) / ``MambaModel`` (local stack spec), run
per sample (a batch of one, positions 0..L-1, no packed-seq params), full-vocabulary logits
(``parallel_output=False`` under TP), and the entropy of the next-token distribution at every
position with plain torch: ``-(softmax(z) * log_softmax(z)).sum(-1)`` in float64. The tree side is
the model with ``TreePackedSeqParams.return_entropy`` on a forest that really branches (forks at
depths 1, 5, 6 and 9, a prefix sample, a duplicate, three trees, padding): vocab-parallel under TP 2
(two vocab shards, entropy from all-reduced sums). Checked: every entropy, the log-probs beside
them, the gradients of a weighted sum of entropies with distinct weights per occurrence, and the
loss of `tree_loss_func` with an entropy coefficient (value, gradients, the mean-entropy report).
Planted fault: each occurrence reads the entropy of the next distinct source row
(``megatron_tree.megatron.loss._FAULT = "entropy_row_shift"``): the comparison must fail.

One gloo spawn of 2 ranks: first at TP 1 (rank 0 the GPT case, rank 1 the Mamba case), then both
ranks at TP 2 (GPT).
"""
from __future__ import annotations

import traceback

import pytest
import torch

try:
    from dist import init_megatron, run_distributed
except ImportError:  # run from the repository root as tests.*
    from tests.dist import init_megatron, run_distributed

from per_sample import SAMPLES, coef, randomize  # tests/per_sample.py

V = 64
F64 = dict(rtol=1e-10, atol=1e-10)
# stock MambaMixer rounds A_log / dt_bias to fp32 inside a float64 model (tests/test_model_families.py)
MAMBA = dict(rtol=1e-6, atol=1e-6)
MAMBA_GRAD = dict(rtol=1e-5, atol=2e-5)
ENTROPY_COEF = 0.37
MAMBA_PATTERN = "M*"


def _build(kind: str, tp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.mamba import MambaModel

    from megatron_tree.megatron.family_specs import get_local_mamba_stack_spec, get_tree_mamba_stack_spec
    from megatron_tree.megatron.model import TreeGPTModel, TreeMambaModel
    from megatron_tree.megatron.specs import get_tree_gpt_decoder_block_spec
    from megatron_tree.training.models import ModelArgs, make_config

    if kind == "gpt":
        cfg = make_config(ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                    ffn_hidden_size=48, vocab_size=V), tp=tp, dtype=torch.float64)
        kw = dict(vocab_size=V, max_sequence_length=64, position_embedding_type="rope")
        stock = GPTModel(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm"),
                         parallel_output=False, **kw)
        tree = TreeGPTModel(cfg, get_tree_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                                                 normalization="RMSNorm"), **kw)
    else:
        cfg = make_config(ModelArgs(kind="mamba", pattern=MAMBA_PATTERN, hidden_size=32, vocab_size=V), tp=tp,
                          dtype=torch.float64)
        kw = dict(vocab_size=V, max_sequence_length=64, hybrid_override_pattern=MAMBA_PATTERN,
                  position_embedding_type="rope")
        stock = MambaModel(cfg, get_local_mamba_stack_spec(), parallel_output=False, **kw)
        tree = TreeMambaModel(cfg, get_tree_mamba_stack_spec(use_transformer_engine=False), **kw)
    return stock.to(torch.float64), tree.to(torch.float64)


def _stock_per_sample(stock, samples):
    """{(i, t): (log-prob of token t, entropy of the distribution predicting it)} from the stock model
    run on sample i alone; plain torch softmax over its full-vocabulary logits."""
    out = {}
    for i, toks in enumerate(samples):
        x = torch.as_tensor(toks, dtype=torch.long)
        logits = stock(x[None], torch.arange(len(x))[None], None)[0].double()  # [L, V], stock causal attention
        assert logits.shape == (len(toks), V)
        logp = torch.log_softmax(logits, dim=-1)
        ent = -(torch.softmax(logits, dim=-1) * logp).sum(-1)
        for t in range(1, len(toks)):
            out[(i, t)] = (logp[t - 1, toks[t]], ent[t - 1])
    return out


def _tree_per_occurrence(tree, mb):
    from megatron_tree.megatron.packed_seq import tree_packed_seq_params

    psp = tree_packed_seq_params(mb, return_entropy=True)
    lay, lm = psp.layout, psp.loss_map
    lp, ent = tree(lay.input_ids[None], lay.position_ids[None], None, packed_seq_params=psp)
    assert lp.shape == ent.shape == (len(lm),)
    keys = list(zip(lm.sample_index.tolist(), lm.positions.tolist()))
    assert len(set(keys)) == len(keys)
    return keys, lp, ent, lm


def _case(kind: str, tp: int) -> dict:
    from megatron_tree.megatron import loss as loss_mod
    from megatron_tree.megatron.loss import tree_loss_func
    from megatron_tree.tree import pack

    stock, tree = _build(kind, tp)
    randomize(stock, seed=7 + len(kind))
    tree.load_state_dict(stock.state_dict(), strict=True)
    mbs = pack(SAMPLES, 64, pad_to_multiple_of=16)
    assert len(mbs) == 1
    mb = mbs[0]
    res = {"rows": mb.layout.num_rows, "distinct_source_rows": int(torch.unique(mb.loss_map.source_rows).numel()),
           "occurrences": len(mb.loss_map)}

    ref = _stock_per_sample(stock, SAMPLES)
    keys, lp, ent, lm = _tree_per_occurrence(tree, mb)
    res["keys_equal"] = sorted(keys) == sorted(ref)
    res["dtype"] = (lp.dtype, ent.dtype)
    res["ent_tree"], res["ent_stock"] = ent.detach(), torch.stack([ref[k][1] for k in keys]).detach()
    res["lp_tree"], res["lp_stock"] = lp.detach(), torch.stack([ref[k][0] for k in keys]).detach()

    # gradient of the entropy term: distinct weights per occurrence
    w = torch.tensor([coef(i, t) for i, t in keys], dtype=torch.float64)
    stock.zero_grad()
    tree.zero_grad()
    (w * torch.stack([ref[k][1] for k in keys])).sum().backward(retain_graph=True)
    (w * ent).sum().backward(retain_graph=True)
    sg, tg = dict(stock.named_parameters()), dict(tree.named_parameters())
    res["grads_entropy"] = {n: (tg[n].grad.clone(), sg[n].grad.clone()) for n in sorted(sg)}

    # the loss with an entropy coefficient: sum of -logp - coef * H over the targets (all weights 1)
    stock.zero_grad()
    tree.zero_grad()
    loss_tree, num, report = tree_loss_func(lm, (lp, ent), entropy_coef=ENTROPY_COEF)
    loss_stock = sum(-ref[k][0] - ENTROPY_COEF * ref[k][1] for k in keys)
    loss_tree.backward()
    loss_stock.backward()
    res["loss"] = (loss_tree.detach(), loss_stock.detach(), int(num))
    res["report_entropy"] = report["entropy"].detach()
    res["grads_loss"] = {n: (tg[n].grad.clone(), sg[n].grad.clone()) for n in sorted(sg)}
    try:
        tree_loss_func(lm, lp, entropy_coef=ENTROPY_COEF)
        res["coef_without_entropy"] = None
    except ValueError as e:
        res["coef_without_entropy"] = str(e)

    # planted fault: entropy read from the next distinct source row
    loss_mod._FAULT = "entropy_row_shift"
    try:
        with torch.no_grad():
            _, _, ent_bad, _ = _tree_per_occurrence(tree, mb)
    finally:
        loss_mod._FAULT = None
    res["fault_max_err"] = float((ent_bad - res["ent_stock"]).abs().max())
    return res


def _run(kind, tp):
    try:
        return _case(kind, tp)
    except Exception:  # noqa: BLE001 - reported by the test of that case
        return {"error": traceback.format_exc()}


def _body():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps_ = init_megatron(tp=1, kernels=True)
    torch.set_default_dtype(torch.float64)  # Megatron's torch norms take the default dtype
    out = {}
    kind = "gpt" if dist.get_rank() == 0 else "mamba"
    out[(kind, 1)] = _run(kind, 1)
    ps_.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    out[("gpt", 2)] = _run("gpt", 2)
    return out


@pytest.fixture(scope="module")
def results():
    r0, r1 = run_distributed(_body, 2, timeout=300)
    return {("gpt", 1): r0[("gpt", 1)], ("mamba", 1): r1[("mamba", 1)], ("gpt", 2, 0): r0[("gpt", 2)],
            ("gpt", 2, 1): r1[("gpt", 2)]}


CASES = [("gpt", 1), ("mamba", 1), ("gpt", 2, 0), ("gpt", 2, 1)]


def _get(results, case):
    r = results[case]
    if "error" in r:
        pytest.fail(f"case {case} raised:\n{r['error']}")
    return r


@pytest.mark.parametrize("case", CASES, ids=["gpt-tp1", "mamba-tp1", "gpt-tp2-rank0", "gpt-tp2-rank1"])
def test_entropy_equals_stock_per_sample(results, case):
    r = _get(results, case)
    tol, gtol = (MAMBA, MAMBA_GRAD) if case[0] == "mamba" else (F64, F64)
    assert r["keys_equal"] and r["dtype"] == (torch.float64, torch.float64)
    # shared rows really are shared: fewer distinct source rows than occurrences
    assert r["distinct_source_rows"] < r["occurrences"] == sum(len(s) - 1 for s in SAMPLES)
    torch.testing.assert_close(r["ent_tree"], r["ent_stock"], **tol)
    torch.testing.assert_close(r["lp_tree"], r["lp_stock"], **tol)
    assert r["ent_stock"].min() > 0.1  # O(1) weights: no distribution is nearly one-hot
    for name, (g_tree, g_stock) in r["grads_entropy"].items():
        assert g_stock.abs().max() > 0, name  # every parameter takes part
        torch.testing.assert_close(g_tree, g_stock, **gtol, msg=lambda m: f"entropy grad of {name}: {m}")


@pytest.mark.parametrize("case", CASES, ids=["gpt-tp1", "mamba-tp1", "gpt-tp2-rank0", "gpt-tp2-rank1"])
def test_loss_entropy_coefficient(results, case):
    r = _get(results, case)
    tol, gtol = (MAMBA, MAMBA_GRAD) if case[0] == "mamba" else (F64, F64)
    loss_tree, loss_stock, num = r["loss"]
    torch.testing.assert_close(loss_tree, loss_stock, **tol)
    assert num == r["occurrences"]
    torch.testing.assert_close(r["report_entropy"], torch.stack([r["ent_stock"].sum(), torch.tensor(float(num))]),
                               **tol)
    for name, (g_tree, g_stock) in r["grads_loss"].items():
        torch.testing.assert_close(g_tree, g_stock, **gtol, msg=lambda m: f"loss grad of {name}: {m}")
    assert "return_entropy" in r["coef_without_entropy"]


def test_tp_ranks_agree(results):
    a, b = _get(results, ("gpt", 2, 0)), _get(results, ("gpt", 2, 1))
    assert torch.equal(a["ent_tree"], b["ent_tree"]) and torch.equal(a["lp_tree"], b["lp_tree"])


@pytest.mark.parametrize("case", CASES, ids=["gpt-tp1", "mamba-tp1", "gpt-tp2-rank0", "gpt-tp2-rank1"])
def test_planted_fault_entropy_row_off_by_one_fails(results, case):
    assert _get(results, case)["fault_max_err"] > 1e-3


def test_function_gradcheck_and_low_precision():
    """The autograd Function alone (one rank): torch.autograd.gradcheck of both outputs in float64 on
    shared rows; bf16 logits give float32 values (equal to the float64 result of the same logits to
    float32 rounding) and a bf16 gradient."""
    from megatron_tree.megatron.loss import vocab_parallel_logprobs_entropy

    gen = torch.Generator().manual_seed(0)
    z = torch.randn(4, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    inverse = torch.tensor([0, 0, 1, 2, 2, 2, 3])
    targets = torch.tensor([1, 5, 0, 10, 3, 3, 7])
    assert torch.autograd.gradcheck(lambda x: vocab_parallel_logprobs_entropy(x, inverse, targets), (z,))
    lp, ent = vocab_parallel_logprobs_entropy(z, inverse, targets)
    ref = torch.distributions.Categorical(logits=z[inverse]).entropy()
    torch.testing.assert_close(ent, ref, **F64)
    # the entropy only logged (no gradient flows into it): the log-prob gradient is vocab_parallel_logprobs'
    from megatron_tree.megatron.loss import vocab_parallel_logprobs

    w = torch.arange(1.0, 8.0, dtype=torch.float64)
    g1 = torch.autograd.grad((w * vocab_parallel_logprobs_entropy(z, inverse, targets)[0]).sum(), z)[0]
    g2 = torch.autograd.grad((w * vocab_parallel_logprobs(z, inverse, targets)).sum(), z)[0]
    torch.testing.assert_close(g1, g2, **F64)
    g3 = torch.autograd.grad((w * vocab_parallel_logprobs_entropy(z, inverse, targets)[1]).sum(), z)[0]
    assert g3.abs().max() > 0
    zb = z.detach().bfloat16().requires_grad_()
    lp_b, ent_b = vocab_parallel_logprobs_entropy(zb, inverse, targets)
    assert lp_b.dtype == ent_b.dtype == torch.float32
    ref_b = torch.distributions.Categorical(logits=zb.detach().double()[inverse]).entropy()
    torch.testing.assert_close(ent_b.double(), ref_b, rtol=1e-6, atol=1e-6)
    (lp_b.sum() + ent_b.sum()).backward()
    assert zb.grad.dtype == torch.bfloat16
