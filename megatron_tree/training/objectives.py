"""The trainer's objectives: the record fields each ``--tree-loss`` reads, checked by file:line before any rank
starts, the samples each trains on, and the stats passes of the sequence-level ones.

=============  ===============================================================  =====================================
``--tree-loss`` record fields (JSONL keys; ``meta`` ones beside the sample's)   how it trains
=============  ===============================================================  =====================================
grpo / ppo     ``advantage``                                                    per occurrence
gspo           ``advantage``, ``old_logprobs``                                  stats pass: each sample's ratio
dpo / ipo      ``pair_id``, ``chosen``, ``ref_logprobs``                        stats pass: each pair's sums
simpo          ``pair_id``, ``chosen``                                          stats pass: each pair's sums
rm             ``pair_id`` / ``chosen``, or ``group`` / ``score``                stats pass: each record's reward
value          ``returns`` [tokens] (``old_values`` with --tree-value-clip)     per occurrence (`TokenTable`)
distill        ``teacher_topk_ids`` / ``teacher_topk_logprobs`` [tokens][k]     per occurrence (`TokenTable`)
=============  ===============================================================  =====================================

A reward model (``rm``) reads its scalar head (no bias: Bradley-Terry sees only differences of rewards, so a bias
would get a zero gradient; Hugging Face's sequence-classification heads have none either) at each record's last row: each record trains as
``tokens + [0]`` with its one target on the appended token (`reward_samples`), so the target's source row is
the record's last row; the appended row is a leaf and changes no other row. Its loss is Bradley-Terry
(``-log sigmoid(r_c - r_r)``, the mean over the step's pairs; `tree.pair_loss` with beta 1 and no reference)
over preference pairs or over every two records of a ranked group whose scores differ.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..tree.pair_loss import PAIR_LOSSES, check_pairs, check_ranked_groups, pair_members, ranked_pairs
from ..tree.token_fields import TokenTable, check_teacher_topk, check_token_values

__all__ = ["check_loss_fields", "objective_samples", "token_fields", "stats_reports", "gspo_stats_pass",
           "pair_stats_pass"]

#: the per-token fields of the token-level objectives, by loss
TOKEN_FIELDS = {"value": ("returns", "old_values"), "distill": ("teacher_topk_ids", "teacher_topk_logprobs")}


def _where(sources, i: int) -> str:
    return sources[i] if sources and i < len(sources) else f"sample {i}"


def check_loss_fields(loss: str, samples, sources=None, *, value_clip=None, vocab_size=None) -> None:
    """The record fields ``--tree-loss`` reads (module table), present and well-formed on every sample (named by
    file:line) before any rank starts."""
    need = {"grpo": ("advantage",), "ppo": ("advantage",), "gspo": ("advantage", "old_logprobs"),
            "dpo": ("ref_logprobs",), "ipo": ("ref_logprobs",)}.get(loss, ())
    for field in need:
        bad = next((i for i, s in enumerate(samples) if getattr(s, field) is None), None)
        if bad is not None:
            raise ValueError(f"{_where(sources, bad)}: has no {field}, which --tree-loss {loss} needs on every record")
    names = [_where(sources, i) for i in range(len(samples))]
    if loss in PAIR_LOSSES:
        _check_pair_fields(loss, samples, sources)
    elif loss == "rm":
        _check_reward_fields(samples, sources)
    elif loss in TOKEN_FIELDS:
        for i, s in enumerate(samples):
            for field in TOKEN_FIELDS[loss]:
                if field not in s.meta and (field != "old_values" or value_clip is not None):
                    raise ValueError(f"{names[i]}: has no {field}, which --tree-loss {loss}"
                                     f"{' --tree-value-clip' if field == 'old_values' else ''} needs on every record")
        if loss == "value":
            check_token_values("returns", [s.meta["returns"] for s in samples], samples, names)
            if value_clip is not None:
                check_token_values("old_values", [s.meta["old_values"] for s in samples], samples, names)
        else:
            check_teacher_topk([s.meta["teacher_topk_ids"] for s in samples],
                               [s.meta["teacher_topk_logprobs"] for s in samples], samples, names, vocab_size)


def _check_pair_fields(loss: str, samples, sources=None) -> None:
    """Preference-pair records: ``pair_id`` (an integer) and ``chosen`` (true / false) on every record (JSONL keys
    beside the sample's fields, read from ``Sample.meta``), every pair id held by one chosen and one rejected
    record, each with a target and no ``weight`` (a pair's loss is a function of its sums). A ValueError names
    the record by file:line."""
    ids = np.zeros(len(samples), np.int64)
    chosen = np.zeros(len(samples), bool)
    for i, s in enumerate(samples):
        pid, ch = s.meta.get("pair_id"), s.meta.get("chosen")
        if isinstance(pid, bool) or not isinstance(pid, (int, np.integer)):
            raise ValueError(f"{_where(sources, i)}: pair_id must be an integer on every record of --tree-loss {loss}, "
                             f"got {pid!r}")
        if not isinstance(ch, (bool, np.bool_)):
            raise ValueError(f"{_where(sources, i)}: chosen must be true or false on every record of --tree-loss "
                             f"{loss}, got {ch!r}")
        if s.weight is not None:
            raise ValueError(f"{_where(sources, i)}: a weight does not apply to --tree-loss {loss} (the loss of a pair "
                             "is a function of its summed log-probs)")
        if loss != "rm" and not s.target_mask().any():
            raise ValueError(f"{_where(sources, i)}: has no target; a preference pair's completions need one")
        ids[i], chosen[i] = int(pid), bool(ch)
    check_pairs(ids, chosen, names=[_where(sources, i) for i in range(len(samples))])


def _ranked(samples) -> bool:
    return bool(samples) and "pair_id" not in samples[0].meta and "score" in samples[0].meta


def _check_reward_fields(samples, sources=None) -> None:
    """Reward-model records: preference pairs (`_check_pair_fields`), or ranked groups: a ``group`` and a numeric
    ``score`` on every record, two different scores in every group, no ``weight``."""
    if not _ranked(samples):
        if samples and "pair_id" not in samples[0].meta:
            raise ValueError(f"{_where(sources, 0)}: --tree-loss rm needs preference pairs (pair_id and chosen) or "
                             "ranked groups (group and score) on every record")
        return _check_pair_fields("rm", samples, sources)
    for i, s in enumerate(samples):
        sc = s.meta.get("score")
        if s.group is None or isinstance(sc, bool) or not isinstance(sc, (int, float, np.integer, np.floating)):
            raise ValueError(f"{_where(sources, i)}: a ranked group's record needs a group and a numeric score "
                             f"(--tree-loss rm), got group {s.group!r}, score {sc!r}")
        if s.weight is not None:
            raise ValueError(f"{_where(sources, i)}: a weight does not apply to --tree-loss rm (the loss of a pair "
                             "is a function of its rewards)")
    check_ranked_groups(_group_codes(samples), [float(s.meta["score"]) for s in samples], len(samples),
                        names=[_where(sources, i) for i in range(len(samples))])


def _group_codes(samples) -> np.ndarray:
    """[B] a string key per sample's ``group`` (JSON groups may be lists; ``repr`` keys compare as the values do)."""
    return np.array([repr(s.group) for s in samples])


def reward_samples(samples) -> list:
    """What a reward model trains on: each record as ``tokens + [0]`` with one target, the appended token, so that
    its one occurrence reads the record's last row (module docstring); ``meta`` and ``group`` kept."""
    out = []
    for s in samples:
        mask = np.zeros(len(s) + 1, dtype=bool)
        mask[-1] = True
        out.append(dataclasses.replace(s, tokens=np.append(s.tokens, 0), loss_mask=mask, advantage=None,
                                       old_logprobs=None, ref_logprobs=None, routed_experts=None))
    return out


def objective_samples(loss: str, samples) -> list:
    """The samples ``--tree-loss`` trains on (checked by `check_loss_fields`): each preference pair a group (the
    data pipeline keeps a group's members in one step: ``group = ("pair", pair_id)`` where a record has none of its
    own), a reward model's records with their reward position (`reward_samples`)."""
    if loss in PAIR_LOSSES or (loss == "rm" and not _ranked(samples)):
        samples = [s if s.group is not None else dataclasses.replace(s, group=("pair", int(s.meta["pair_id"])))
                   for s in samples]
    return reward_samples(samples) if loss == "rm" else samples


def token_fields(loss: str, samples) -> dict:
    """name -> `TokenTable` of the per-token record fields a token-level objective reads (`megatron.loss`'s
    ``token_fields``), over every sample id; empty for the others."""
    return {f: TokenTable(f, [np.asarray(s.meta[f]) if f in s.meta else None for s in samples])
            for f in TOKEN_FIELDS.get(loss, ())}


# --------------------------------------------------------------------------------------------- stats passes
def stats_reports(ddp, step, items, args, loss_kwargs) -> list:
    """A stats pass: the step's microbatches forward only (no gradient, no MoE statistics), every occurrence
    reported (``report_occurrences``). One forward of the step, no backward."""
    from megatron.core import parallel_state as ps

    from ..megatron.carry import kept_exporters, step_carry_items
    from ..megatron.model import unwrap_model
    from .models import forward_backward

    stats_items = items
    if getattr(args, "tree_carry", False):  # a fresh store; kept exporters forward once here too
        keep = kept_exporters(step.microbatches, unwrap_model(ddp).config, getattr(args, "tree_carry_memory", None))
        stats_items = step_carry_items(step, ps.get_data_parallel_group(), keep=keep)
    kw = dict(loss_kwargs, loss_type="sft", entropy_coef=0.0, report_occurrences=True)
    with torch.no_grad():
        return forward_backward(ddp, stats_items, forward_only=True, **kw)


def gspo_stats_pass(ddp, step, items, args, loss_kwargs):
    """GSPO's stats pass (`stats_reports`): every occurrence's ``logp - old``, gathered into each sample's ratio
    ``exp(mean)`` over DP x CP and sent from the last pipeline stage (`megatron.loss.gspo_sequence_ratios`)."""
    from ..megatron.loss import gspo_sequence_ratios, sample_sum_groups

    return gspo_sequence_ratios(stats_reports(ddp, step, items, args, loss_kwargs), **sample_sum_groups())


def pair_stats_pass(ddp, step, items, args, loss_kwargs, samples):
    """Preference pairs' stats pass (dpo / ipo / simpo, and rm over the reward model's values; `stats_reports`):
    every occurrence's log-prob (value) summed per sample over DP x CP and sent from the last pipeline stage
    (`megatron.loss.gather_sample_sums`), then each sample's factors (`tree.pair_loss.pair_loss_factors`) from its
    pairs in the step's window (``step.sample_ids``, every rank's). Returns the (coef, share) `tree.loss.SampleValues`
    the graded pass trains with."""
    from ..megatron.loss import gather_sample_sums, sample_sum_groups
    from ..tree.loss import SampleValues
    from ..tree.pair_loss import pair_loss_factors

    ids, sums, counts = gather_sample_sums(stats_reports(ddp, step, items, args, loss_kwargs), "logprobs",
                                           **sample_sum_groups())
    window = np.asarray(step.sample_ids, dtype=np.int64)
    at = np.searchsorted(window, ids)
    pi, n = np.zeros(len(window)), np.zeros(len(window))
    pi[at], n[at] = sums, counts
    c, r = _window_pairs(samples, window)
    if args.tree_loss == "rm":  # Bradley-Terry: DPO's form of the rewards, beta 1, no reference
        coef, share = pair_loss_factors("dpo", pi, np.zeros(len(window)), n, c, r, n_targets=float(n.sum()),
                                        n_pairs=float(len(c)), beta=1.0)
    else:
        ref = np.array([0.0 if samples[i].ref_logprobs is None else
                        float(samples[i].ref_logprobs[samples[i].target_mask()].sum()) for i in window])
        coef, share = pair_loss_factors(args.tree_loss, pi, ref, n, c, r, n_targets=float(n.sum()),
                                        n_pairs=float(len(c)), beta=args.tree_dpo_beta, gamma=args.tree_simpo_gamma)
    return SampleValues(window, torch.as_tensor(coef)), SampleValues(window, torch.as_tensor(share))


def _window_pairs(samples, window) -> tuple:
    """(chosen / better positions [P], rejected / worse positions [P]) in ``window``: its preference pairs, or every
    two records of a ranked group with different scores; a pair or group cut by the step is an error."""
    if _ranked([samples[i] for i in window[:1]]):
        keys = _group_codes([samples[i] for i in window])
        whole = _group_codes(samples)
        uniq, count = np.unique(keys, return_counts=True)
        total = dict(zip(*np.unique(whole, return_counts=True)))
        cut = [g for g, k in zip(uniq.tolist(), count.tolist()) if total[g] != k]
        if cut:
            raise ValueError(f"group {cut[0]}: only part of its records is in this step's {len(window)} samples (give "
                             "a --tree-global-batch-samples the groups' sizes divide)")
        return ranked_pairs(keys, np.array([float(samples[i].meta["score"]) for i in window]))
    pair_ids = np.array([samples[i].meta["pair_id"] for i in window], dtype=np.int64)
    chosen = np.array([bool(samples[i].meta["chosen"]) for i in window])
    uniq, count = np.unique(pair_ids, return_counts=True)
    if (count != 2).any():
        p = int(uniq[np.flatnonzero(count != 2)[0]])
        raise ValueError(f"pair {p}: only one of its records is in this step's {len(window)} samples (the data "
                         "pipeline keeps a group together; give the pair's records no group of their own or the "
                         "same one, and a --tree-global-batch-samples the groups' sizes divide)")
    return pair_members(pair_ids, chosen)
