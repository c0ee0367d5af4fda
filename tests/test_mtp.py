"""Multi-token prediction on trees (`megatron_tree.megatron.mtp`) against **stock** Megatron-Core MTP per sample.

Oracle: the installed Megatron-Core's own ``GPTModel`` with ``mtp_block_spec=get_gpt_mtp_block_spec(...)``
(local spec, stock ``DotProductAttention``, stock ``MultiTokenPredictionLayer`` rolling ``input_ids``,
labels and loss mask), run on each sample alone (batch of one, positions 0..L-1) in training mode with
``labels`` and a weighted ``loss_mask``; its MTP losses reach the gradients through stock's
``MTPLossAutoScaler`` (scale 1) and each depth's loss is read from stock's ``MTPLossLoggingHelper``
tracker (its per-token mean times the sample's rolled mask sum). One change to the oracle:
``compute_language_model_loss`` is a float64 cross entropy on the stock instance (stock's
``vocab_parallel_cross_entropy`` upcasts to float32, not to float64; the math is the same).

The tree side: `TreeGPTModel` with `get_tree_gpt_mtp_block_spec`, the stock model's state dict, the
samples packed into one forest, loss ``-sum(w * logp)`` over the main occurrences (the MTP losses ride
on the hidden states as in stock). Compared in float64: the total loss, each depth's summed loss,
every parameter gradient. The forest forks at depth 0 (three trees), 1, 2 (= K) and 5 (> K), holds a
one-token sample, a sample that is a prefix of another, a duplicate and prompt tokens without loss.
Planted faults (`megatron_tree.megatron.mtp.FAULTS`) must each move the result far past tolerance.
"""
from __future__ import annotations

import traceback

import pytest
import torch

try:
    from dist import init_megatron, run_distributed
except ImportError:  # run from the repository root as tests.*
    from tests.dist import init_megatron, run_distributed

from per_sample import randomize  # tests/per_sample.py

V = 64
F64 = dict(rtol=1e-10, atol=1e-10)
SCALE = 0.3  # mtp_loss_scaling_factor (not stock's default 0.1, so a wrong scale shows)

SAMPLES = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    [1, 2, 3, 4, 5, 9, 9, 9, 8],  # fork at depth 5 (> K)
    [1, 2, 3, 4, 5, 6, 7],  # prefix of sample 0
    [1, 30, 31, 32, 33],  # fork at depth 1
    [1, 2, 57, 58, 59, 61],  # fork at depth 2
    [3, 3, 3, 1, 2, 5],  # second tree (fork at depth 0)
    [50, 51],  # third tree, one target
    [60],  # one token: no target at all
    [1, 2, 3, 4, 5, 9, 9, 9, 8],  # duplicate of sample 1
]
NO_LOSS = {3: 2}  # sample 3: its first 2 targets are prompt (weight 0 / loss mask 0)


def coef(i: int, t: int) -> float:
    """Weight of target t of sample i: distinct values exact in float32 (the loss map's dtype)."""
    return 0.0 if t <= NO_LOSS.get(i, 0) else 0.5 + ((3 * i + 7 * t) % 11) / 8.0


# version gates: what the installed Megatron-Core's stock MTP can run (tested against it where it can)
def stock_dsa_mtp_runs() -> bool:
    from megatron_tree.compat.dsa import stock_dsa_mtp_runs as runs

    return runs()


def hybrid_has_mtp() -> bool:
    from megatron_tree.compat.mtp import hybrid_has_mtp as has

    return has()


def _models(K: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    from megatron_tree.megatron.model import TreeGPTModel
    from megatron_tree.megatron.specs import get_tree_gpt_layer_spec, get_tree_gpt_mtp_block_spec
    from megatron_tree.training.models import ModelArgs, make_config

    cfg = make_config(ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=48, vocab_size=V,
                                extra=dict(mtp_num_layers=K, mtp_loss_scaling_factor=SCALE)), dtype=torch.float64)
    s_spec = get_gpt_layer_local_spec(None, False, False)
    t_spec = get_tree_gpt_layer_spec(None, False, False, use_transformer_engine=False)
    stock = GPTModel(cfg, s_spec, V, 64, position_embedding_type="rope",
                     mtp_block_spec=get_gpt_mtp_block_spec(cfg, s_spec, False))
    tree = TreeGPTModel(cfg, t_spec, V, 64, position_embedding_type="rope",
                        mtp_block_spec=get_tree_gpt_mtp_block_spec(cfg, t_spec, False))
    randomize(stock, seed=11 + K)
    tree.load_state_dict(stock.state_dict(), strict=True)
    stock.compute_language_model_loss = lambda labels, logits: torch.nn.functional.cross_entropy(
        logits.permute(1, 2, 0), labels, reduction="none")  # float64 (see the module docstring)
    return stock, tree


def _stock_side(stock, K):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    total, depth = torch.zeros((), dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
    for i, toks in enumerate(SAMPLES):
        L = len(toks)
        x = torch.tensor(toks)[None]
        labels = torch.tensor(toks[1:] + [0])[None]
        mask = torch.tensor([coef(i, t) for t in range(1, L)] + [0.0], dtype=torch.float64)[None]
        MTPLossLoggingHelper.tracker.clear()
        ce = stock(x, torch.arange(L)[None], None, labels=labels, loss_mask=mask)
        loss = (ce * mask).sum()
        loss.backward()
        total += loss.detach()
        tracked = MTPLossLoggingHelper.tracker.get("values", MTPLossLoggingHelper.tracker.get("loss_values"))
        for k in range(1, K + 1):
            n = mask[0, k:].sum()  # the rolled mask's sum: stock's num_tokens of depth k
            if n > 0:
                depth[k - 1] += tracked[k - 1].double() * n
    return total, depth


def _tree_side(tree, K):
    from megatron_tree.megatron.packed_seq import tree_packed_seq_params
    from megatron_tree.tree import pack

    samples = [dict(tokens=t, weight=[0.0] + [coef(i, u) for u in range(1, len(t))]) for i, t in enumerate(SAMPLES)]
    mbs = pack(samples, 64, pad_to_multiple_of=16)
    total, depth = torch.zeros((), dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
    for mb in mbs:
        psp = tree_packed_seq_params(mb)
        lp = tree(psp.input_ids[None], psp.position_ids[None], None, packed_seq_params=psp)
        loss = -(lp * psp.loss_map.weights.to(lp.dtype)).sum()
        loss.backward()
        total += loss.detach()
        depth += psp.mtp_loss_sums
    lay = mbs[0].layout
    fork_depths = sorted({int(lay.position_ids[int(lay.segment_offsets[s])])
                          for s in range(len(lay.segment_parent)) if int(lay.segment_parent[s]) >= 0})
    structure = dict(num_mbs=len(mbs), trees=int((lay.segment_parent == -1).sum()) - lay.num_padding,
                     padding=lay.num_padding, fork_depths=fork_depths)
    return total, depth, structure


def _case(K, fault=None):
    import megatron_tree.megatron.mtp as mtp
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from megatron_tree.compat.mtp import rescales_per_token_mtp_loss

    mtp._FAULT = fault
    try:
        stock, tree = _models(K)
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
        stock.train()
        tree.train()
        s_total, s_depth = _stock_side(stock, K)
        t_total, t_depth, structure = _tree_side(tree, K)
        sg, tg = dict(stock.named_parameters()), dict(tree.named_parameters())
        res = dict(total=(t_total, s_total), depth=(t_depth, s_depth), structure=structure,
                   mtp_layer=type(tree.mtp.layers[0]).__name__, rescaled=rescales_per_token_mtp_loss(),
                   grad_names_equal=sorted(sg) == sorted(tg),
                   grads={n: (tg[n].grad.clone(), sg[n].grad.clone()) for n in sorted(sg)})
        res["worst_grad"] = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
                                for a, b in res["grads"].values())
        if fault is not None:
            res.pop("grads")
        return res
    finally:
        mtp._FAULT = None


def _mamba_models(K: int):
    """Stock ``MambaModel`` (megatron-core 0.19's HybridModel; Megatron's local modules, stock mixers) with
    the pattern "M*-M" and K MTP depths "M*", and the tree model `build_model` makes of the same config."""
    from megatron.core.models.mamba import MambaModel

    from megatron_tree.cpu import megatron_core as cpu
    from megatron_tree.megatron.family_specs import get_local_mamba_stack_spec
    from megatron_tree.training.models import ModelArgs, build_model, make_config

    cpu.enable(kernels=True)  # stock MambaMixer's gated norm: the torch stand-in on CPU
    margs = ModelArgs(kind="mamba", pattern="M*-M", num_layers=4, vocab_size=V, mtp_pattern="M*",
                      extra=dict(mtp_num_layers=K, mtp_loss_scaling_factor=SCALE))
    cfg = make_config(margs, dtype=torch.float64)
    stock = MambaModel(cfg, get_local_mamba_stack_spec(), vocab_size=V, max_sequence_length=64,
                       hybrid_layer_pattern="/".join(["M*-M"] + ["M*"] * K), position_embedding_type="rope",
                       share_embeddings_and_output_weights=False).to(torch.float64)
    return stock, build_model(cfg, margs)


def _checkpoints(root: str, models=_models) -> dict:
    """Stock GPTModel + MTP (``models``: or another (stock, tree) pair maker) saved with dist_checkpointing
    loads into the tree model (no missing or unexpected key, every parameter equal), and the tree model's
    checkpoint back into a stock one."""
    import os

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    out = {}
    stock, tree = models(2)
    randomize(tree, seed=99)  # different weights, so a load that changes nothing shows
    for name, src, dst in (("stock_to_tree", stock, tree), ("tree_to_stock", None, None)):
        if src is None:
            randomize(tree, seed=123)
            src, dst = tree, models(2)[0]
        d = os.path.join(root, name)
        os.makedirs(d)
        dist_checkpointing.save(src.sharded_state_dict(), d)
        loaded, missing, unexpected = dist_checkpointing.load(dst.sharded_state_dict(), d,
                                                              strict=StrictHandling.RETURN_ALL)
        res = dst.load_state_dict(loaded, strict=False)
        a, b = dict(src.named_parameters()), dict(dst.named_parameters())
        out[name] = dict(missing=sorted(missing), unexpected=sorted(unexpected), load=(res.missing_keys,
                         res.unexpected_keys), names_equal=sorted(a) == sorted(b),
                         equal=all(torch.equal(a[n], b[n]) for n in a),
                         mtp_keys=sum(k.startswith("mtp.") for k in src.sharded_state_dict()))
    return out


def _qwen3next_tree(K: int):
    """`build_model`'s Qwen3-Next stack (GDN, then gated qk-normed attention) with K MTP layers."""
    from megatron_tree.training.models import ModelArgs, build_model, make_config

    margs = ModelArgs(kind="qwen3next", num_layers=2, vocab_size=V,
                      extra=dict(mtp_num_layers=K, mtp_loss_scaling_factor=SCALE))
    tree = build_model(make_config(margs, dtype=torch.float64), margs)
    randomize(tree, seed=5)
    return tree


def _hooks(K: int = 2, kind: str = "gpt") -> dict:
    """The Megatron-LM hooks with ``--mtp-num-layers``: ``model_provider`` builds the tree MTP block, and
    ``forward_step`` on the forest gives what `tree_forward_step` gives with the same weights (loss, every
    gradient), with each depth's mean loss in stock's tracker (what Megatron-LM's training_log prints).
    ``kind`` "qwen3next": the provider's Qwen3-Next stack (``--experimental-attention-variant
    gated_delta_net``, read from the config)."""
    import argparse

    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    from megatron_tree.megatron.forward_step import tree_forward_step
    from megatron_tree.training import megatron_lm as H
    from megatron_tree.training.arguments import add_tree_args
    from megatron_tree.tree import pack

    tree = _qwen3next_tree(K) if kind == "qwen3next" else _models(K)[1]
    a = add_tree_args(argparse.ArgumentParser()).parse_args(["--tree-packing", "--tree-max-tokens-per-mb", "64"])
    for k, v in dict(vocab_size=V, padded_vocab_size=V, transformer_impl="local", normalization="RMSNorm",
                     untie_embeddings_and_output_weights=True, position_embedding_type="rope",
                     max_position_embeddings=64 if kind == "gpt" else 4096, micro_batch_size=1,
                     attention_dropout=0.0, num_layers=2,
                     mtp_num_layers=K, mtp_loss_scaling_factor=SCALE, calculate_per_token_loss=True).items():
        setattr(a, k, v)
    hooks = H.model_provider(config=tree.config, args=a)
    hooks.load_state_dict(tree.state_dict(), strict=True)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
    samples = [dict(tokens=t, weight=[0.0] + [coef(i, u) for u in range(1, len(t))]) for i, t in enumerate(SAMPLES)]
    (mb,) = pack(samples, 64, pad_to_multiple_of=16)
    MTPLossLoggingHelper.tracker.clear()
    out, lf = H.forward_step(iter([mb]), hooks, args=a)
    h_loss, _, _ = lf(out)
    h_loss.backward()
    tracked = MTPLossLoggingHelper.tracker.get("values", MTPLossLoggingHelper.tracker.get("loss_values")).clone()
    out, lf = tree_forward_step(iter([mb]), tree)
    t_loss, _, report = lf(out)
    t_loss.backward()
    means = torch.stack([report[f"mtp_{k} loss"][0] / report[f"mtp_{k} loss"][1] for k in range(1, K + 1)])
    hg, tg = dict(hooks.named_parameters()), dict(tree.named_parameters())
    from megatron_tree.compat.mtp import mtp_inner_layer

    inner = [mtp_inner_layer(m).self_attention for m in hooks.mtp.layers]
    return dict(layers=[type(m).__name__ for m in hooks.mtp.layers], loss=(h_loss.detach(), t_loss.detach()),
                decoder=[type(m.self_attention).__name__ for m in hooks.decoder.layers],
                mtp_attention=[(type(a).__name__, type(a.core_attention).__name__,
                                bool(getattr(a.config, "attention_output_gate", False))) for a in inner],
                depth=(tracked.double(), means.double()),
                worst_grad=max(float((hg[n].grad - tg[n].grad).abs().max()) for n in tg),
                mtp_grad=float(sum(tg[n].grad.abs().sum() for n in tg if n.startswith("mtp."))))


def _body(ckpt_root: str):
    init_megatron(tp=1)
    torch.set_default_dtype(torch.float64)  # Megatron's torch norms take the default dtype
    from megatron_tree.megatron.mtp import FAULTS

    out = {}
    cases = [("checkpoints", lambda: _checkpoints(ckpt_root)), ("hooks", _hooks),
             ("hooks_qwen3next", lambda: _hooks(1, "qwen3next"))]
    if hybrid_has_mtp():
        cases.append(("checkpoints_mamba", lambda: _checkpoints(ckpt_root + "/mamba", _mamba_models)))
    for name, fn in cases:
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001 - reported by its test
            out[name] = {"error": traceback.format_exc()}
    for key in [(1, None), (2, None)] + [(2, f) for f in FAULTS]:
        try:
            out[key] = _case(*key)
        except Exception:  # noqa: BLE001 - reported by the test of that case
            out[key] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return run_distributed(_body, 1, str(tmp_path_factory.mktemp("mtp_ckpt")), timeout=300)[0]


def _result(oracle, key):
    r = oracle[key]
    if "error" in r:
        pytest.fail(f"case {key} raised:\n{r['error']}")
    return r


@pytest.mark.parametrize("model", ["gpt"] + (["mamba"] if hybrid_has_mtp() else []))
@pytest.mark.parametrize("direction", ["stock_to_tree", "tree_to_stock"])
def test_stock_mtp_checkpoint_loads_into_the_tree_model_and_back(oracle, direction, model):
    """GPTModel; MambaModel with MTP depths of a Mamba and an attention layer (megatron-core >= 0.19)."""
    r = _result(oracle, "checkpoints" if model == "gpt" else "checkpoints_mamba")[direction]
    assert r["missing"] == [] and r["unexpected"] == [] and r["load"] == ([], [])
    assert r["names_equal"] and r["equal"] and r["mtp_keys"] > 0


def test_megatron_lm_hooks_train_mtp_on_the_tree(oracle):
    r = _result(oracle, "hooks")
    assert r["layers"] == ["TreeMultiTokenPredictionLayer"] * 2
    torch.testing.assert_close(*r["loss"], **F64)
    torch.testing.assert_close(*r["depth"], **F64)
    assert r["worst_grad"] < 1e-12 and r["mtp_grad"] > 0


def test_megatron_lm_hooks_train_qwen3next_mtp_on_the_tree(oracle):
    """Qwen3-Next (GDN, then gated attention) with MTP through the hooks: the MTP layer copies the last decoder
    layer (gated attention, tree core attention); hooks == tree_forward_step (verify checks it against stock)."""
    r = _result(oracle, "hooks_qwen3next")
    assert r["layers"] == ["TreeMultiTokenPredictionLayer"]
    assert r["decoder"] == ["TreeGatedDeltaNet", "SelfAttention"]
    (attn, core, gated), = r["mtp_attention"]
    assert attn == "SelfAttention" and core.startswith("Tree") and gated
    torch.testing.assert_close(*r["loss"], **F64)
    torch.testing.assert_close(*r["depth"], **F64)
    assert r["worst_grad"] < 1e-12 and r["mtp_grad"] > 0


def test_forest_really_branches(oracle):
    s = _result(oracle, (2, None))["structure"]
    assert s["num_mbs"] == 1 and s["trees"] == 4 and s["padding"] > 0  # 3 trees + the one-token sample
    assert s["fork_depths"] == [1, 2, 5]


@pytest.mark.parametrize("K", [1, 2])
def test_tree_mtp_equals_stock_mtp_per_sample(oracle, K):
    r = _result(oracle, (K, None))
    assert r["mtp_layer"] == "TreeMultiTokenPredictionLayer" and r["grad_names_equal"]
    assert any(n.startswith("mtp.layers.") for n in r["grads"])
    torch.testing.assert_close(*r["total"], **F64)
    t_depth, s_depth = r["depth"]
    assert t_depth.shape == (K,) and (s_depth > 1).all()
    torch.testing.assert_close(t_depth, s_depth, **F64)
    for n, (g_tree, g_stock) in r["grads"].items():
        assert g_stock.abs().max() > 0, n  # every parameter takes part, MTP layers included
        torch.testing.assert_close(g_tree, g_stock, **F64, msg=lambda m: f"grad of {n}: {m}")


@pytest.mark.parametrize("fault", ["physical_roll", "shallow_visible", "per_row_loss"])
def test_planted_fault_fails(oracle, fault):
    """Each bug moves the MTP depth losses and gradients far past tolerance (the main loss is untouched)."""
    r = _result(oracle, (2, fault))
    torch.testing.assert_close(*r["total"], **F64)
    t_depth, s_depth = r["depth"]
    assert float((t_depth - s_depth).abs().max()) > 1e-2
    assert r["worst_grad"] > 1e-2


# ---------------------------------------------------------------------------------------- fractional weights
# SFT sample weights and RL weights make a sample's depth-k weight sum (stock's rolled loss-mask sum,
# ``num_tokens``) fractional. Megatron-Core 0.19 multiplies each depth's per-token MTP loss by
# ``original_num_tokens / max(num_tokens, 1)`` and logs ``sum / max(num_tokens, 1)``; 0.16 attaches it
# unscaled and logs ``sum / num_tokens``. Per sample, the tree must attach and log what the installed version
# does (`compat.mtp.mtp_num_tokens_floor`). (tokens, per-token weights; weight[0] is never a target): two
# trees, the sample first.
FRACTIONAL = [
    ([5, 6, 7], [0.0, 0.8, 0.4]),  # the issue's: depth-1 weight 0.4 < 1, nothing at depth 2
    ([5, 6, 7, 8, 9], [0.0, 0.3, 0.9, 0.7, 0.6]),  # extends it: depth-1 weight 2.2 > 1, depth-2 1.3
    ([5, 6, 2, 3], [0.0, 0.0, 0.25, 0.5]),  # fork at depth 2, a zero-weight target: 0.75 and 0.5 < 1
    ([5, 6, 9], [0.0, 4.5, 0.0]),  # fork at depth 2: one deeper target, of weight 0 (depth-1 weight 0)
    ([3, 4, 5, 6, 7, 8], [0.0, 0.6, 0.2, 0.1, 0.9, 0.35]),  # second tree: 1.55 and 1.35 > 1
    ([3, 4], [0.0, 0.7]),  # one target, of depth 0: nothing for MTP
]
EXACT = dict(rtol=0.0, atol=1e-12)


def _depth_weight(w, k: int) -> float:
    """Stock's ``num_tokens`` of depth k for a sample of per-token weights ``w``: targets t >= k + 1."""
    return float(sum(w[k + 1:]))


class _Attached:
    """Records every loss stock's ``MTPLossAutoScaler.apply`` attaches (stock and tree call it once per depth)."""

    def __enter__(self):
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler as A

        self.got, self._own = [], A.__dict__.get("apply")
        inner = A.apply

        def apply(hidden, loss):
            self.got.append(loss.detach().clone())
            return inner(hidden, loss)

        A.apply = apply
        return self

    def __exit__(self, *exc):
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler as A

        if self._own is None:
            del A.apply
        else:
            A.apply = self._own


def _tracked(K):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper as H

    return H.tracker.get("values", H.tracker.get("loss_values"))[:K].double().clone()


def _accepted(K):
    """[K, 2] (correct, total) of stock's acceptance tracker (megatron-core 0.19), None where it has none."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper as H

    if "correct_values" not in H.tracker:
        return None
    return torch.stack([H.tracker["correct_values"][:K], H.tracker["total_values"][:K]], 1).double().clone()


def _fractional_case(K: int, samples=FRACTIONAL) -> dict:
    """Stock GPTModel + MTP on each sample alone (the weights as its loss mask, as Megatron's schedules pass
    it) against the tree on the forest of all: per sample and depth the attached MTP loss (the sum of what
    reaches ``MTPLossAutoScaler``) and the logged loss (stock's tracker; the tree's on a microbatch of that
    sample alone), the acceptance counts where stock keeps them (0.19: targets of weight 0 not counted), and
    every parameter gradient."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    from megatron_tree.megatron.packed_seq import tree_packed_seq_params
    from megatron_tree.tree import pack

    stock, tree = _models(K)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
    stock.train()
    tree.train()
    S = len(samples)
    s_att, s_log = torch.zeros(S, K, dtype=torch.float64), torch.zeros(S, K, dtype=torch.float64)
    s_acc, t_acc = [], []
    for i, (toks, w) in enumerate(samples):
        L = len(toks)
        mask = torch.tensor(w[1:] + [0.0], dtype=torch.float64)[None]
        MTPLossLoggingHelper.tracker.clear()
        with _Attached() as rec:
            ce = stock(torch.tensor(toks)[None], torch.arange(L)[None], None,
                       labels=torch.tensor(toks[1:] + [0])[None], loss_mask=mask)
        (ce * mask).sum().backward()
        s_att[i] = torch.stack([a.sum() for a in rec.got])
        s_log[i] = _tracked(K)
        s_acc.append(_accepted(K))

    batch = [dict(tokens=t, weight=w) for t, w in samples]
    mbs = pack(batch, 64, pad_to_multiple_of=16)
    t_att, t_log = torch.zeros(S, K, dtype=torch.float64), torch.zeros(S, K, dtype=torch.float64)
    for mb in mbs:
        psp = tree_packed_seq_params(mb)
        with _Attached() as rec:
            lp = tree(psp.input_ids[None], psp.position_ids[None], None, packed_seq_params=psp)
        (-(lp * psp.loss_map.weights.to(lp.dtype)).sum()).backward()
        lm = psp.loss_map
        depth = psp.position_ids[lm.source_rows]
        for k in range(1, K + 1):
            sel = torch.nonzero(depth >= k).squeeze(1)  # the occurrences depth k attaches, in its order
            t_att[:, k - 1].index_add_(0, lm.sample_index[sel], rec.got[k - 1].double())
    with torch.no_grad():  # the logged loss of each sample alone (the microbatch's mean: no step weights)
        for i, s in enumerate(batch):
            (mb,) = pack([s], 64, pad_to_multiple_of=16)
            MTPLossLoggingHelper.tracker.clear()
            psp = tree_packed_seq_params(mb)
            tree(psp.input_ids[None], psp.position_ids[None], None, packed_seq_params=psp)
            t_log[i] = _tracked(K)
            t_acc.append(_accepted(K))
    sg, tg = dict(stock.named_parameters()), dict(tree.named_parameters())
    return dict(num_mbs=len(mbs), trees=int((mbs[0].layout.segment_parent == -1).sum()) - mbs[0].layout.num_padding,
                attached=(t_att, s_att), logged=(t_log, s_log), accepted=(t_acc, s_acc),
                grad_names_equal=sorted(sg) == sorted(tg),
                grads={n: (tg[n].grad.clone(), sg[n].grad.clone()) for n in sorted(sg)})


def _fractional_body():
    init_megatron(tp=1)
    torch.set_default_dtype(torch.float64)
    out = {}
    for K in (1, 2):
        try:
            out[K] = _fractional_case(K)
        except Exception:  # noqa: BLE001 - reported by the test of that case
            out[K] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def fractional():
    return run_distributed(_fractional_body, 1, timeout=300)[0]


def test_fractional_weights_reach_both_sides_of_the_count_clamp():
    """The data: per depth, a sample whose weight sum is in (0, 1), one above 1 and one with targets of weight 0
    only (stock 0.19 divides by max(num_tokens, 1)); one forest of samples sharing prefixes."""
    for k in (1, 2):
        n = [_depth_weight(w, k) for _, w in FRACTIONAL]
        assert any(0 < x < 1 for x in n) and any(x > 1 for x in n), (k, n)
    assert _depth_weight(FRACTIONAL[0][1], 1) == pytest.approx(0.4)
    assert _depth_weight(FRACTIONAL[3][1], 1) == 0 and sum(FRACTIONAL[3][1]) > 4  # 0 * (4.5 / 0+) is not finite


@pytest.mark.parametrize("K", [1, 2])
def test_tree_mtp_with_fractional_weights_equals_stock_per_sample(fractional, K):
    """Issue 24: on 0.19 the tree attached 2.5 times stock's MTP loss for one sample [5, 6, 7] of weights
    [0, 0.8, 0.4] (it divided by the exact depth-1 weight 0.4, stock by max(0.4, 1); here 1.6982 vs 0.6793
    at K=1) and NaN gradients for [5, 6, 9] of weights [0, 4.5, 0] (4.5 / tiny overflows, times a 0 loss).
    Attached and logged MTP losses per sample and depth, and every gradient (decoder, MTP layers, embedding,
    head), to 1e-12."""
    r = _result(fractional, K)
    assert r["num_mbs"] == 1 and r["trees"] == 2 and r["grad_names_equal"]
    t_att, s_att = r["attached"]
    torch.testing.assert_close(t_att, s_att, **EXACT)
    assert (s_att[:, 0] != 0).sum() >= 4
    t_log, s_log = r["logged"]
    has = torch.tensor([[_depth_weight(w, k) > 0 for k in range(1, K + 1)] for _, w in FRACTIONAL])
    torch.testing.assert_close(t_log[has], s_log[has], **EXACT)
    assert (t_log[~has] == 0).all()  # stock 0.19 logs 0 there too; 0.16 logs 0 / 0
    t_acc, s_acc = r["accepted"]  # per sample: (correct, total) by depth; a weight-0 target is not counted
    for i, (t, st) in enumerate(zip(t_acc, s_acc)):
        assert (t is None) == (st is None), i
        if st is not None:
            torch.testing.assert_close(t, st, rtol=0, atol=0, msg=lambda m: f"acceptance of sample {i}: {m}")
    assert any(n.startswith("mtp.layers.") for n in r["grads"])
    for n, (g_tree, g_stock) in r["grads"].items():
        assert g_stock.abs().max() > 0, n
        torch.testing.assert_close(g_tree, g_stock, **EXACT, msg=lambda m: f"grad of {n}: {m}")


def _forest():
    from megatron_tree.tree import pack

    return pack(SAMPLES, 64, pad_to_multiple_of=16)[0].layout


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_layout_cuts_paths_at_depth_k(k):
    """Depth k's visibility is the tree's, restricted to keys of depth >= k, for queries of depth >= k;
    rows of depth < k see only themselves; positions are depth - k (independent dense construction)."""
    from megatron_tree.megatron.mtp import mtp_layout

    lay = _forest()
    got = mtp_layout(lay, k)
    got.validate()
    depth = lay.position_ids
    deep = (depth >= k) & ~lay.is_padding
    want = lay.dense_mask() & deep[:, None] & deep[None, :]
    want |= torch.eye(lay.num_rows, dtype=torch.bool)
    assert torch.equal(got.dense_mask(), want)
    assert torch.equal(got.position_ids, torch.where(deep, depth - k, 0))
    assert torch.equal(got.input_ids, lay.input_ids) and got.num_padding == lay.num_padding


@pytest.mark.parametrize("cp", [2, 4])
def test_mtp_halo_gives_every_row_its_path_parent(cp):
    """Under every rank's halo, each owned row of depth >= k reads its path_prev row (local or fetched,
    each fetched row sent by its owner), every other row the zero row: simulated over all ranks on the host."""
    import numpy as np

    from megatron_tree.cp import plan_context_parallel
    from megatron_tree.megatron.mtp import mtp_halo

    lay = _forest()
    plan = plan_context_parallel(lay, cp, strategy="contiguous")
    prev, depth = lay.path_prev.numpy(), lay.position_ids.numpy()
    for k in (1, 2):
        halos = [mtp_halo(plan, lay, r, k, num_padding=1) for r in range(cp)]
        crossing = 0
        for r, h in enumerate(halos):
            mine = plan.owner_rows(r)
            recv = []  # what rank r receives, grouped by source rank
            for s in range(cp):
                hs, before = halos[s], sum(halos[s].send_splits[:r])
                sent = hs.send_local[before:before + hs.send_splits[r]]
                assert len(sent) == h.recv_splits[s]
                recv.extend(plan.owner_rows(s)[sent].tolist())
            rows = np.concatenate([mine, [-1], recv, [-1]])  # owned rows, 1 padding row, received, zero row
            src = rows[h.index]
            want = np.where((depth[mine] >= k) & ~lay.is_padding.numpy()[mine], prev[mine], -1)
            assert np.array_equal(src[:-1], want) and src[-1] == -1
            crossing += len(recv)
        assert crossing > 0


# ---------------------------------------------------------------------------------------- verify / train
# `megatron-tree verify --mtp-num-layers K`: tree MTP under Megatron's schedule, DDP and optimizer against
# stock MTP per sample (CP 1; under CP the per-sample side is the tree code on each sample's chain, see
# training/verify_mtp.py). Small batches (3 families); one gloo spawn per world size.
def _verify_cases():
    from megatron_tree.training.verify import MTP_FAULTS, VerifyConfig

    # (the stock-oracle tests above plant every MTP fault; verify shows it fails on one per world size)
    ws1 = [VerifyConfig(mtp_num_layers=1, families=2),
           VerifyConfig(mtp_num_layers=2, families=2, loss="grpo", recompute="full"),
           VerifyConfig(model="mla", mtp_num_layers=1, families=2),
           VerifyConfig(mtp_num_layers=2, families=2, fault="mtp_shallow_visible"),
           # Qwen3-Next: GDN layers, the MTP layer copies the last decoder layer (qk-normed attention;
           # stock refuses an MTP layer copying a GDN layer)
           VerifyConfig(model="qwen3next", mtp_num_layers=1, families=2),
           VerifyConfig(model="qwen3next", mtp_num_layers=2, families=2, fault="mtp_physical_roll"),
           # carry (issue 25) at a 16-row budget (4 families: the 19-token sample, paths cut into chains): each
           # depth's input at a row under a carried parent is the parent's state from the store, the MTP layers'
           # K / V (and GDN / Mamba state) carry under their own store keys; dropping the carried parent fails
           VerifyConfig(mtp_num_layers=2, budget=16, carry=True, window=9, sinks=True, recompute="full", families=4),
           VerifyConfig(model="qwen3next", mtp_num_layers=1, budget=16, carry=True, families=4),
           VerifyConfig(mtp_num_layers=2, budget=16, carry=True, families=4, fault="mtp_carry_parent")]
    ws2 = [VerifyConfig(mtp_num_layers=2, tp=2, sp=True, families=2),
           VerifyConfig(mtp_num_layers=2, cp=2, families=2),
           VerifyConfig(mtp_num_layers=1, pp=2, families=2),
           VerifyConfig(mtp_num_layers=2, cp=2, families=2, fault="mtp_physical_roll"),
           # carry under CP: a parent another rank computes comes by the halo, a carried one from the store (the
           # fill gathers every rank's state rows); the depths' layers run on their own plans' visibility
           VerifyConfig(mtp_num_layers=2, cp=2, cp_strategy="zigzag", budget=16, carry=True, families=4),
           # the seed whose tiny GDN decay gradients read 1.16e-9 against their own scale (`verify.GRAD_SCALE_FLOOR`)
           VerifyConfig(model="qwen3next", mtp_num_layers=1, tp=2, sp=True, families=2)]
    # CP4 (parents on other ranks from every side); MoE in the MTP layers with experts over DP x CP
    ws4 = [VerifyConfig(mtp_num_layers=2, cp=4, families=2),
           VerifyConfig(mtp_num_layers=2, dp=2, cp=2, ep=2, families=6)]
    # DSA in the MTP layers (megatron-core >= 0.19; 0.16's stock DSA cannot run in an MTP layer): stock's
    # indexer loss of depth k covers every sample's k trailing positions, the tree's MTP tail rows; without
    # them (planted) the MTP layer's indexer gradients and indexer loss differ
    newer = []
    if stock_dsa_mtp_runs():
        newer += [("ws1", VerifyConfig(model="dsa", mtp_num_layers=2, families=2)),
                  ("ws1", VerifyConfig(model="dsa", mtp_num_layers=1, families=2, fault="mtp_no_tail")),
                  ("ws2", VerifyConfig(model="dsa", mtp_num_layers=2, cp=2, families=2))]
    # MambaModel (0.19's HybridModel: MTP depths from a "main/mtp/..." pattern, each an inner hybrid stack
    # of the tree's own layer specs): Mamba and attention inside the MTP layers, CP2; MoE with TP2 + SP
    if hybrid_has_mtp():
        newer += [("ws1", VerifyConfig(model="mamba", pattern="M*-M", mtp_num_layers=2, mtp_pattern="M-", families=2)),
                  ("ws1", VerifyConfig(model="mamba", pattern="M*-M", mtp_num_layers=2, families=2,
                                       fault="mtp_physical_roll")),
                  ("ws2", VerifyConfig(model="mamba", pattern="M*-M", mtp_num_layers=2, mtp_pattern="M*", cp=2,
                                       families=2)),
                  ("ws2", VerifyConfig(model="mamba", mtp_num_layers=1, mtp_pattern="*E", tp=2, sp=True, families=2)),
                  # carry: Mamba-2 inside the MTP depths continues carried state on the depth's cut layout
                  ("ws1", VerifyConfig(model="mamba", pattern="M*-M", mtp_num_layers=2, mtp_pattern="M*", budget=16,
                                       carry=True, families=4))]
    # (ws1 6: carry, on both stacks: 0.19 rescales each sample's MTP loss by its step-wide token counts)
    latest = {("ws1", 0), ("ws1", 2), ("ws1", 4), ("ws1", 6), ("ws2", 0), ("ws2", 1), ("ws4", 1)}  # the rest repeat
    for name, cfg in newer:  # (main tier only); these run on megatron-core >= 0.19 only
        cases = ws1 if name == "ws1" else ws2
        latest.add((name, len(cases)))
        cases.append(cfg)
    assert {c.fault for c in ws1 + ws2} - {None} <= set(MTP_FAULTS)
    return ws1, ws2, ws4, latest


VERIFY_WS1, VERIFY_WS2, VERIFY_WS4, LATEST = _verify_cases()


def _cases(name, configs):
    return [pytest.param(i, marks=[] if (name, i) in LATEST else [pytest.mark.main_tier_only])
            for i in range(len(configs))]


@pytest.fixture(scope="module")
def verify_ws1(request):
    from megatron_tree.training.verify import run_verify_many
    from selection import run_selected

    return run_selected(request, "test_verify_mtp_world_size_1", VERIFY_WS1, run_verify_many)


@pytest.fixture(scope="module")
def verify_ws2(request):
    from megatron_tree.training.verify import run_verify_many
    from selection import run_selected

    return run_selected(request, "test_verify_mtp_world_size_2", VERIFY_WS2, run_verify_many)


def _check(cfg, out):
    from verify_checks import check_verify

    seen = {None: None, "mtp_no_tail": "indexer_loss"}.get(cfg.fault, "mtp_loss")
    check_verify(cfg, out, fault_seen=seen, far=1e-6)
    if cfg.fault is None:
        assert "mtp_loss" in out and out["mtp_loss"] <= 1e-12


@pytest.fixture(scope="module")
def verify_ws4(request):
    from megatron_tree.training.verify import run_verify_many
    from selection import run_selected

    return run_selected(request, "test_verify_mtp_world_size_4", VERIFY_WS4, run_verify_many)


@pytest.mark.parametrize("i", _cases("ws4", VERIFY_WS4))
def test_verify_mtp_world_size_4(verify_ws4, i):
    _check(VERIFY_WS4[i], verify_ws4[i])


@pytest.mark.parametrize("i", _cases("ws1", VERIFY_WS1))
def test_verify_mtp_world_size_1(verify_ws1, i):
    _check(VERIFY_WS1[i], verify_ws1[i])


@pytest.mark.parametrize("i", _cases("ws2", VERIFY_WS2))
def test_verify_mtp_world_size_2(verify_ws2, i):
    _check(VERIFY_WS2[i], verify_ws2[i])


def test_verify_mtp_refuses_what_it_does_not_cover():
    from megatron_tree.training.verify import VerifyConfig, run_verify_many

    for cfg, needle in [(VerifyConfig(model="hybrid", mtp_num_layers=1), "covers --model gpt, mla, dsa"),
                        (VerifyConfig(mtp_num_layers=1, dtype="bfloat16"), "float64 / float32"),
                        (VerifyConfig(fault="mtp_per_row_loss"), "needs mtp_num_layers")]:
        with pytest.raises(ValueError, match=needle):
            run_verify_many([cfg])
    if not hybrid_has_mtp():
        with pytest.raises(ValueError, match="MambaModel has no MTP layers"):
            run_verify_many([VerifyConfig(model="mamba", mtp_num_layers=1)])
    dsa = VerifyConfig(model="dsa", mtp_num_layers=1, dsa_topk_freq=2)
    with pytest.raises(ValueError, match="IndexShare" if stock_dsa_mtp_runs() else "needs megatron-core >= 0.19"):
        run_verify_many([dsa])


def test_train_cli_mtp_accepts_dsa_and_mamba_where_stock_runs_them_and_qwen3next():
    from megatron_tree.training.trainer import build_train_parser, check_train_args

    base = ["--synthetic-preset", "many_small_64_4x16", "--train-iters", "1", "--mtp-num-layers", "1",
            "--tree-max-tokens-per-mb", "256"]
    dsa = base + ["--experimental-attention-variant", "dsa"]
    mamba = base + ["--model-family", "mamba", "--hybrid-override-pattern", "M*-"]
    for argv, ok in ((dsa, stock_dsa_mtp_runs()), (mamba, hybrid_has_mtp())):
        if ok:
            check_train_args(build_train_parser().parse_args(argv))
        else:
            with pytest.raises(ValueError, match="needs megatron-core >= 0.19"):
                check_train_args(build_train_parser().parse_args(argv))
    with pytest.raises(ValueError, match="--mtp-pattern needs letters"):
        check_train_args(build_train_parser().parse_args(mamba + ["--mtp-pattern", "*G"]))
    check_train_args(build_train_parser().parse_args(base + ["--experimental-attention-variant", "gated_delta_net",
                                                        "--linear-attention-freq", "2", "--num-layers", "2"]))


@pytest.mark.parametrize("kind", ["gpt"] + (["dsa"] if stock_dsa_mtp_runs() else [])
                         + (["mamba"] if hybrid_has_mtp() else []))
def test_train_cli_mtp_tree_flat_and_cp2_agree(kind):
    """`megatron-tree train --mtp-num-layers 2`: each depth's loss is in the step metrics, and tree packing,
    flat packing and tree CP 2 give the same main and MTP losses over two steps (float32 noise). "dsa":
    DeepSeek sparse attention in the decoder and the MTP layers (MTP tail rows packed by the trainer's
    pipeline, across CP ranks under CP 2); "mamba": MambaModel with a Mamba and an attention layer in
    each MTP depth (megatron-core >= 0.19); those two compare tree vs CP 2."""
    from megatron_tree.training.launch import run_distributed as run
    from megatron_tree.training.trainer import build_train_parser, check_train_args, format_progress, train

    common = ["--synthetic-preset", "many_small_64_4x16", "--synthetic-scale", "0.5", "--vocab-size", "128",
              *([] if kind == "mamba" else ["--num-layers", "2"]), "--hidden-size", "32", "--num-attention-heads", "4", "--train-iters", "2",
              "--tree-global-batch-samples", "8", "--tree-max-tokens-per-mb", "256", "--lr", "1e-2", "--quiet",
              "--tree-lookahead", "1", "--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]
    if kind == "dsa":
        common += ["--experimental-attention-variant", "dsa", "--recompute-granularity", "full"]
    if kind == "mamba":  # MambaModel's MTP depths: a Mamba and an attention layer each
        common += ["--model-family", "mamba", "--hybrid-override-pattern", "M*-M", "--mtp-pattern", "M*"]
    runs = {}
    for name, extra in (("tree", []), ("flat", ["--packing", "flat"]),
                        ("cp2", ["--context-parallel-size", "2", "--nproc", "2"])):
        if kind != "gpt" and name == "flat":
            continue
        args = check_train_args(build_train_parser().parse_args(common + extra))
        runs[name] = run(train, 2 if name == "cp2" else 1, args, timeout=300)[0]["history"]
    keys = ("loss", "mtp_1 loss", "mtp_2 loss")
    for name in set(runs) - {"tree"}:
        for a, b in zip(runs["tree"], runs[name]):
            for k in keys:
                assert abs(a[k] - b[k]) < 1e-5 * abs(a[k]), (name, k, a[k], b[k])
    assert runs["tree"][1]["mtp_1 loss"] != runs["tree"][0]["mtp_1 loss"]  # the MTP layers train
    assert "mtp_2 loss 4." in format_progress(1, 2, runs["tree"][0])
