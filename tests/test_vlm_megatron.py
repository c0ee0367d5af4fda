"""`TreeVisionLanguageModel` (a vision encoder + `TreeGPTModel` with multimodal RoPE) on image records
against **stock** Megatron-Core run per record: ``GPTModel(position_embedding_type="mrope")`` on each record
alone, its placeholder rows replaced by the same encoder's output for that record's images, positions from
`tree.images.mrope_positions` (equal to HF's ``get_rope_index``: tests/test_vlm_hf.py). float64; log-probs
and every gradient, the encoder's included. Then carry (a budget that cuts image runs) against the whole
tree through Megatron's schedule, a frozen encoder, and TP 2 + SP on two gloo ranks."""
from __future__ import annotations

import copy

import pytest
import torch

try:
    from dist import init_megatron, run_distributed
except ImportError:  # run from the repository root as tests.*
    from tests.dist import init_megatron, run_distributed

from per_sample import coef, randomize  # tests/per_sample.py
from vlm_parts import IMG, MERGE, PATCH, PatchEncoder, PatchProcessor, vlm_samples  # tests/vlm_parts.py

V, H = 64, 32


def _models(tp: int, sp: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_tree.megatron.model import TreeGPTModel
    from megatron_tree.megatron.specs import get_tree_gpt_layer_spec
    from megatron_tree.megatron.vision_language import TreeVisionLanguageModel
    from megatron_tree.training.models import ModelArgs, make_config

    cfg = make_config(ModelArgs(num_layers=2, hidden_size=H, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=48, vocab_size=V), dtype=torch.float64, tp=tp, sp=sp)
    cfg.mrope_section = [2, 1, 1]  # head dim 8: four rotary frequencies, two for t, one each for h and w
    kw = dict(position_embedding_type="mrope", scatter_embedding_sequence_parallel=False)
    stock = GPTModel(cfg, get_gpt_layer_local_spec(), V, 128, **kw)
    lm = TreeGPTModel(cfg, get_tree_gpt_layer_spec(), V, 128, **kw)
    randomize(stock, seed=3)
    lm.load_state_dict(stock.state_dict(), strict=True)
    enc = PatchEncoder(2 * 3 * PATCH * PATCH, H)
    randomize(enc, seed=4)
    return cfg, stock, enc, TreeVisionLanguageModel(cfg, lm, copy.deepcopy(enc))


def _stock_logprobs(cfg, stock, enc, samples, vision) -> dict:
    """{(i, t): log-prob} of stock GPTModel on each record alone, images encoded per record."""
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

    from megatron_tree.tree.images import mrope_positions

    out = {}
    for i, s in enumerate(samples):
        x = torch.as_tensor(s.tokens, dtype=torch.long)[None]
        emb = stock.embedding(input_ids=x, position_ids=None)  # [L, 1, h]
        if s.images:
            pix, grid = vision.pixels([im.key for im in s.images])
            rows = torch.cat([torch.arange(im.start, im.start + im.length) for im in s.images])
            emb = emb[:, 0].index_put((rows,), enc(pix, grid)).unsqueeze(1)
        if cfg.sequence_parallel:
            emb = scatter_to_sequence_parallel_region(emb)
        pos = torch.from_numpy(mrope_positions(len(s), s.images))[:, None, :]
        logits = stock(x, pos, None, decoder_input=emb)
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        lp = torch.log_softmax(gather_from_tensor_model_parallel_region(logits)[0].double(), -1)
        m = s.target_mask()
        for t in range(1, len(s)):
            if m[t]:
                out[(i, t)] = lp[t - 1, int(s.tokens[t])]
    return out


def _tree_logprobs(tree, mbs) -> dict:
    from megatron_tree.megatron.packed_seq import tree_packed_seq_params

    out = {}
    for mb in mbs:
        psp = tree_packed_seq_params(mb)
        lp = tree(psp.input_ids[None], psp.position_ids[None], None, packed_seq_params=psp)
        for e, (i, t) in enumerate(zip(psp.loss_map.sample_index.tolist(), psp.loss_map.positions.tolist())):
            out[(i, t)] = lp[e]
    return out


def _grads(named) -> dict:
    """Gradients by name; under sequence parallelism a norm's is summed over the TP group (each rank holds
    the part of its sequence shard, and the two sides shard different sequences), as Megatron's
    finalize_model_grads does."""
    from megatron.core import parallel_state as ps

    out = {}
    for n, p in named:
        if p.grad is None:
            continue
        g = p.grad.detach().clone()
        if getattr(p, "sequence_parallel", False) and ps.get_tensor_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(g, group=ps.get_tensor_model_parallel_group())
        out[n] = g
    return out


def _body(tp: int, sp: bool):
    init_megatron(tp=tp, kernels=True)
    torch.set_default_dtype(torch.float64)
    from megatron_tree.data.images import VisionInput
    from megatron_tree.tree import pack

    vision = VisionInput(image_token_id=IMG, merge=MERGE, processor=PatchProcessor())
    samples = vlm_samples(vision)
    cfg, stock, enc, tree = _models(tp, sp)
    res = {}
    mbs = [vision.attach(mb) for mb in pack(samples, 256, pad_to_multiple_of=2 * tp)]
    res["rows"] = (sum(mb.stats.tree_tokens for mb in mbs), sum(len(s) for s in samples))
    ref = _stock_logprobs(cfg, stock, enc, samples, vision)
    got = _tree_logprobs(tree, mbs)
    keys = sorted(ref)
    res["keys_equal"] = keys == sorted(got)
    res["lp"] = (torch.stack([got[k] for k in keys]).detach(), torch.stack([ref[k] for k in keys]).detach())
    res["encoder_calls"] = (list(tree.vision_model.calls), list(enc.calls))
    sum(coef(*k) * ref[k] for k in keys).backward()
    sum(coef(*k) * got[k] for k in keys).backward()
    sg = {**_grads(stock.named_parameters()), **{"vision." + n: g for n, g in _grads(enc.named_parameters()).items()}}
    tg = {**_grads(tree.language_model.named_parameters()),
          **{"vision." + n: g for n, g in _grads(tree.vision_model.named_parameters()).items()}}
    res["grads"] = {n: (tg.get(n), sg[n]) for n in sg}
    # power: the image rows matter (an encoder that is off changes the log-probs)
    with torch.no_grad():
        tree.vision_model.merge.bias.add_(0.1)
        moved = _tree_logprobs(tree, mbs)
        tree.vision_model.merge.bias.sub_(0.1)
    res["encoder_shift"] = max(float((moved[k] - got[k]).abs()) for k in keys)
    if tp == 1:
        res["carry"] = _carry_vs_whole(samples, vision)
        res["frozen"] = _frozen(samples, vision, mbs)
    return res


def _carry_vs_whole(samples, vision):
    """Carry at budgets that cut image runs against the whole tree, through Megatron's schedule (loss and
    main grads, encoder included), each on a fresh DDP model of the same weights."""
    from megatron_tree.megatron.carry import carry_items
    from megatron_tree.training.models import forward_backward, report_totals, wrap_ddp
    from megatron_tree.tree import pack

    out = {}
    for budget, keep in ((10, None), (16, True)):
        res = {}
        for side in ("carry", "whole"):
            cfg, _, _, tree = _models(1, False)
            ddp = wrap_ddp(tree, cfg)
            if side == "carry":
                mbs = [vision.attach(mb) for mb in pack(samples, budget, carry=True, pad_to_multiple_of=2)]
                cut = any(int(n) < ref.length for mb in mbs for n, ref in zip(mb.image_slots.lengths,
                                                                                mb.image_slots.refs))
                reports = forward_backward(ddp, carry_items(mbs, keep=keep), loss_type="sft")
            else:
                mbs = [vision.attach(mb) for mb in pack(samples, 1024, pad_to_multiple_of=2)]
                reports = forward_backward(ddp, mbs, loss_type="sft")
            res[side] = dict(loss=report_totals(reports).clone(),
                             grads={n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()})
        a, b = res["carry"], res["whole"]
        err = max(float((a["grads"][n] - g).abs().max() / g.abs().max().clamp(min=1e-30)) for n, g in b["grads"].items())
        out[(budget, keep)] = dict(loss=float(abs(a["loss"][0] - b["loss"][0])), tokens=(float(a["loss"][1]),
                                   float(b["loss"][1])), grads=err, cut=cut,
                                   encoder_grad=float(b["grads"]["vision_model.merge.weight"].abs().max()))
    return out


def _frozen(samples, vision, mbs):
    """``freeze_vision``: the encoder gets no gradient; the language model's equal the trained encoder's run."""
    from megatron_tree.megatron.vision_language import TreeVisionLanguageModel

    out = {}
    for freeze in (False, True):
        cfg, _, _, tree = _models(1, False)
        tree = TreeVisionLanguageModel(cfg, tree.language_model, tree.vision_model, freeze_vision=freeze)
        got = _tree_logprobs(tree, mbs)
        sum(coef(*k) * v for k, v in got.items()).backward()
        out[freeze] = dict(lm=_grads(tree.language_model.named_parameters()),
                           vision=_grads(tree.vision_model.named_parameters()))
    return dict(vision_grads=len(out[True]["vision"]), lm_err=max(
        float((out[True]["lm"][n] - g).abs().max()) for n, g in out[False]["lm"].items()))


@pytest.fixture(scope="module")
def single():
    return run_distributed(_body, 1, 1, False, timeout=300)[0]


def _check(res):
    assert res["keys_equal"]
    tree_rows, flat_rows = res["rows"]
    assert tree_rows < flat_rows
    torch.testing.assert_close(*res["lp"], rtol=1e-10, atol=1e-10)
    for n, (t, s) in res["grads"].items():
        assert t is not None, f"{n}: no gradient on the tree side"
        torch.testing.assert_close(t, s, rtol=1e-9, atol=1e-10, msg=n)
    assert any(n.startswith("vision.") for n in res["grads"])
    assert res["encoder_shift"] > 1e-3


def test_tree_vlm_equals_stock_per_record(single):
    _check(single)
    tree_calls, stock_calls = single["encoder_calls"]
    # one encoder call per microbatch, on its distinct occurrences: 1 prompt image + 4 branch images (one
    # screenshot behind two texts is two occurrences) + the two look-alikes = 7, where per record it is 10
    assert sum(tree_calls) == 7 and sum(stock_calls) == 10


def test_carry_cutting_image_runs_equals_the_whole_tree(single):
    for (budget, keep), r in single["carry"].items():
        assert r["cut"], f"budget {budget} cuts no image run"
        assert r["tokens"][0] == r["tokens"][1]
        assert r["loss"] <= 1e-10 * max(1.0, abs(r["tokens"][0]))
        assert r["grads"] <= 1e-10, (budget, keep, r)
        assert r["encoder_grad"] > 0


def test_frozen_encoder_gets_no_gradient_and_changes_nothing_else(single):
    assert single["frozen"]["vision_grads"] == 0
    assert single["frozen"]["lm_err"] <= 1e-12


def test_tree_vlm_tp2_sequence_parallel_equals_stock():
    for res in run_distributed(_body, 2, 2, True, timeout=300):
        _check(res)
