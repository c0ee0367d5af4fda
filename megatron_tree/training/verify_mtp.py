"""``megatron-tree verify --mtp-num-layers K``: the per-sample side runs **stock** Megatron-Core MTP.

The per-sample model is built with stock ``MultiTokenPredictionLayer``s (`models.build_model(...,
stock_mtp=True)`: same parameters as the tree side's `TreeMultiTokenPredictionLayer`s) and its
``_postprocess`` is stock ``GPTModel._postprocess`` (`stock_mtp_postprocess`, installed on the model
instance): labels and loss mask built from the one-sample microbatch's loss map, ``packed_seq_params``
given ``cu_seqlens`` of the whole microbatch (one sequence: the sample, then its padding) so that stock's
``roll_tensor`` rolls ``input_ids``, labels and loss mask per depth, stock's loss scaling and
``MTPLossAutoScaler``; its main output, stock's per-token cross entropy, is turned into per-occurrence
log-probs. Stock's ``vocab_parallel_cross_entropy`` upcasts to float32; the per-sample model's
``compute_language_model_loss`` is the same vocab-parallel cross entropy in the logits' precision
(`float64_cross_entropy`), so float64 runs stay exact. Each depth's summed loss is read from stock's
``MTPLossLoggingHelper`` tracker (its per-microbatch mean times the rolled mask's sum).

Models: gpt, mla, dsa and qwen3next (the MTP layer copies the decoder's last layer, Qwen3-Next's attention
layer). DSA (megatron-core >= 0.19, `compat.dsa.stock_dsa_mtp_runs`): the per-sample side is stock DSA in the
stock MTP layer, whose indexer loss covers each sample's k trailing positions; the tree side packs them as
MTP tail rows (``pack(..., mtp_tail=K)``), and the MTP layers' top-k selections are compared too (filed as
layers ``num_layers + k``, `number_mtp_captures`). `check_mtp_config` names what is refused and why.

Under tree CP (``cp > 1``) the per-sample side is the tree MTP code on each sample's chain over verify's
single-owner plan (stock's packed CP roll would split the sample over CP ranks zigzag-wise, which the
single-owner plan does not do); the CP 1 runs tie that code to stock.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import torch

__all__ = ["install_stock_mtp", "float64_cross_entropy", "stock_mtp_postprocess", "number_mtp_captures"]


def float64_cross_entropy(model, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Stock ``compute_language_model_loss`` (labels [b, s], vocab-sharded logits [s, b, V/tp] -> [b, s])
    without the float32 cast: float64 logits give a float64 loss."""
    from ..megatron.loss import vocab_parallel_logprobs

    tp = model.pg_collection.tp
    s, b, v = logits.shape
    lp = vocab_parallel_logprobs(logits.reshape(s * b, v), torch.arange(s * b, device=logits.device),
                                 labels.t().reshape(-1), vocab_start=tp.rank() * v, group=tp if tp.size() > 1 else None)
    return -lp.view(s, b).t()


def _tracker_values():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    t = MTPLossLoggingHelper.tracker
    v = t.get("loss_values", t.get("values"))
    return None if v is None else v.detach().clone()


def stock_mtp_postprocess(model, hidden_states, **kwargs):
    """Stock ``GPTModel._postprocess`` with MTP on a one-sample tree microbatch -> [M] log-probs."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from ..megatron.mtp import logits_without_mtp
    from ..megatron.packed_seq import TreePackedSeqParams

    psp = kwargs.get("packed_seq_params")
    if (not isinstance(psp, TreePackedSeqParams) or kwargs.get("labels") is not None or not model.post_process
            or not kwargs.get("mtp_in_postprocess")):
        return GPTModel._postprocess(model, hidden_states, **kwargs)
    if psp.loss_map is None:
        return logits_without_mtp(model, hidden_states, kwargs.get("runtime_gather_output"))
    return _per_sample(model, hidden_states, psp, lambda labels, mask, roll_psp: GPTModel._postprocess(
        model, hidden_states, **dict(kwargs, labels=labels, loss_mask=mask, packed_seq_params=roll_psp,
                                     mtp_in_postprocess=True)))


def stock_hybrid_mtp_postprocess(model, hidden_states, psp, *, input_ids, position_ids, labels=None,
                                 runtime_gather_output=None):
    """Stock ``HybridModel.forward``'s last stage (0.19: ``self.mtp(...)``, then ``process_mtp_loss``, then
    the main head's loss) on a one-sample tree microbatch -> [M] log-probs; the decoder before it is the
    tree stack on the sample's chain. `TreeMambaModel._tree_postprocess` on verify's per-sample side."""
    from megatron.core.transformer.multi_token_prediction import process_mtp_loss

    from ..megatron.model import TreeMambaModel

    if not model.wants_tree_logprobs(psp, labels):
        return TreeMambaModel._tree_postprocess(model, hidden_states, psp, input_ids=input_ids,
                                                position_ids=position_ids, labels=labels,
                                                runtime_gather_output=runtime_gather_output)

    def run(labels_, mask, roll_psp):
        h = model.mtp(input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
                      attention_mask=None, rotary_pos_emb=model.tree_rotary_pos_emb(psp),
                      packed_seq_params=roll_psp, embedding=model.embedding)
        h = process_mtp_loss(hidden_states=h, labels=labels_, loss_mask=mask, output_layer=model.output_layer,
                             output_weight=None, runtime_gather_output=runtime_gather_output,
                             is_training=model.training, compute_language_model_loss=model.compute_language_model_loss,
                             config=model.config, cp_group=model.pg_collection.cp, tp_group=model.tp_group,
                             packed_seq_params=roll_psp, input_ids=input_ids)
        logits, _ = model.output_layer(h, runtime_gather_output=runtime_gather_output)
        return model.compute_language_model_loss(labels_, logits)

    return _per_sample(model, hidden_states, psp, run)


def _per_sample(model, hidden_states, psp, run):
    """Stock MTP on a one-sample microbatch: ``run(labels, loss_mask, roll_psp)`` is the stock last stage
    (per-token CE [1, n]) given the sample's labels / loss mask as stock builds them and ``packed_seq_params``
    whose ``cu_seqlens`` make stock's ``roll_tensor`` roll within the microbatch. Records each depth's summed
    loss from stock's tracker on ``psp``; returns the main head's [M] log-probs."""
    lm, n, dev = psp.loss_map, psp.num_local_rows, hidden_states.device
    if lm.sample_index.unique().numel() > 1:
        raise ValueError("stock MTP per sample: a microbatch holds more than one sample")
    labels = torch.zeros(1, n, dtype=torch.long, device=dev)
    labels[0, lm.source_rows] = lm.targets
    dtype = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    mask = torch.zeros(1, n, dtype=dtype, device=dev)
    mask[0, lm.source_rows] = lm.weights.to(dtype)
    cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
    roll_psp = dataclasses.replace(psp, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    roll_psp.__dict__["_capture_parent"] = psp  # DSA captures: the same microbatch forward
    before = _tracker_values()
    ce = run(labels, mask, roll_psp)
    after = _tracker_values()
    K = int(model.config.mtp_num_layers)
    means = (after if before is None else after - before)[:K]
    counts = torch.stack([mask[0, k:].sum() for k in range(1, K + 1)])
    sums = torch.where(counts > 0, means.to(counts.dtype) * counts, torch.zeros_like(counts))
    psp.__dict__["mtp_loss_sums"], psp.__dict__["mtp_num_tokens"] = sums.detach(), counts
    return -ce[0, lm.source_rows]


def number_mtp_captures(model) -> None:
    """File the DSA selections captured in MTP layer k under layer ``num_layers + k`` (on 0.19 the MTP
    layer's own number is k, a decoder layer's), on either side of verify."""
    mtp = getattr(model, "mtp", None)
    for k, layer in enumerate(getattr(mtp, "layers", ()), 1):
        for m in layer.modules():
            if hasattr(m, "layer_number") and hasattr(m, "indexer"):
                m.capture_layer_number = model.config.num_layers + k


def install_stock_mtp(model) -> None:
    """Make a `TreeGPTModel` / `TreeMambaModel` built with ``stock_mtp=True`` run stock MTP per sample
    (module docstring)."""
    from ..megatron.model import TreeMambaModel

    if isinstance(model, TreeMambaModel):
        model._tree_postprocess = partial(stock_hybrid_mtp_postprocess, model)
    else:
        model._postprocess = partial(stock_mtp_postprocess, model)
    model.compute_language_model_loss = partial(float64_cross_entropy, model)


FAULTS = ("mtp_physical_roll", "mtp_shallow_visible", "mtp_per_row_loss", "mtp_no_tail", "mtp_carry_parent")


def set_mtp_fault(fault) -> None:
    """Plant verify fault ``fault`` (one of `FAULTS`; anything else: none) in `megatron_tree.megatron.mtp`
    for the runs that follow (verify sets it for its tree side only)."""
    from ..megatron import mtp

    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    mtp._FAULT = fault[len("mtp_"):] if fault in FAULTS else None
    MTPLossLoggingHelper.tracker.clear()  # sized by the first run's depth count: start each side afresh


def mtp_totals(reports, num_layers: int, group) -> "torch.Tensor | None":
    """[K, 2] ``(loss_sum, num_tokens)`` of every MTP depth over this rank's reports, summed over ``group``
    (DP x CP); None on a stage without reports."""
    from .models import report_totals

    rows = [report_totals(reports, key=f"mtp_{k} loss") for k in range(1, num_layers + 1)]
    if any(r is None for r in rows):
        return None
    out = torch.stack(rows).double()
    torch.distributed.all_reduce(out, group=group)
    return out


def check_mtp_config(cfg) -> None:
    """Clear errors for what verify's MTP runs do not cover."""
    if cfg.fault in FAULTS and not cfg.mtp_num_layers:
        raise ValueError(f"fault {cfg.fault} plants a bug in multi-token prediction: it needs mtp_num_layers >= 1 "
                         "(--mtp-num-layers)")
    if not cfg.mtp_num_layers:
        return
    if cfg.mtp_num_layers < 0:
        raise ValueError(f"mtp_num_layers must be >= 0, got {cfg.mtp_num_layers}")
    from ..compat.dsa import stock_dsa_mtp_runs

    if cfg.model == "dsa" and not stock_dsa_mtp_runs():
        raise ValueError("verify --mtp-num-layers --model dsa needs megatron-core >= 0.19: 0.16's stock DSA indexes its "
                         "indexer-loss tracker out of range in an MTP layer (IndexError in training), so there is no "
                         "stock per-sample run to compare against")
    if cfg.model == "dsa" and cfg.dsa_topk_freq > 1:
        raise ValueError("verify --mtp-num-layers --model dsa runs every layer's own top-k: an MTP layer reusing a "
                         "decoder layer's selections (--dsa-topk-freq > 1, IndexShare) is not covered")
    if cfg.fault == "mtp_carry_parent" and not cfg.carry:
        raise ValueError("fault mtp_carry_parent drops the depth inputs carried rows hand later microbatches: it "
                         "needs --carry")
    if cfg.fault == "mtp_no_tail" and cfg.model != "dsa":
        raise ValueError("fault mtp_no_tail drops the MTP tail rows, which only DSA's indexer loss reads: --model dsa")
    if cfg.model == "mamba":
        from ..compat.mtp import hybrid_has_mtp

        if not hybrid_has_mtp():
            raise ValueError("verify --mtp-num-layers --model mamba needs megatron-core >= 0.19: this Megatron-Core's "
                             "MambaModel has no MTP layers")
    if cfg.model not in ("gpt", "mla", "qwen3next", "dsa", "mamba"):
        raise ValueError(f"verify --mtp-num-layers covers --model gpt, mla, dsa, qwen3next and mamba (got "
                         f"{cfg.model!r}): the hybrid GPT stack's MTP layer would copy its last layer, not verified")
    if cfg.dtype == "bfloat16":
        raise ValueError("verify --mtp-num-layers runs in float64 / float32 (its per-sample side is stock MTP one "
                         "sample per microbatch; the bf16 judge's packed baseline is not)")
