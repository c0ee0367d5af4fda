"""Loss helpers: packed loss and d(loss)/d(logits) equal the per-sample computation."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_tree.tree import Sample, gather_logprobs, pack, policy_loss, sft_loss

V = 11


def _family_batch(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for g in range(3):
        prompt = rng.integers(0, V, rng.integers(3, 7)).tolist()
        for c in range(4):
            comp = rng.integers(0, V, rng.integers(1, 5)).tolist()
            toks = prompt + comp
            mask = [0] * len(prompt) + [1] * len(comp)
            old = rng.normal(-2, 0.3, len(toks))
            ref = rng.normal(-2, 0.3, len(toks))
            out.append(Sample(toks, loss_mask=mask, advantage=rng.normal(size=len(toks)), old_logprobs=old,
                              ref_logprobs=ref, weight=float(rng.uniform(0.5, 2))))
    out.append(out[0])  # duplicate sample: its occurrences count twice, as in flat training
    out.append(Sample(out[1].tokens[:4].tolist(), loss_mask=[0, 1, 1, 1], advantage=0.3,
                      old_logprobs=np.zeros(4) - 1, ref_logprobs=np.zeros(4) - 1))  # prefix of another sample
    return out


def _per_sample_terms(logits, mb, samples, fn):
    """Run ``fn(logits_i[t-1], target, sample, t)`` per sample on logits gathered at sample rows."""
    terms, counts = [], []
    for sid in mb.sample_ids:
        s = samples[sid]
        li = logits[mb.sample_rows(sid)]
        lp = F.log_softmax(li[:-1], dim=-1).gather(1, torch.as_tensor(s.tokens[1:]).long().unsqueeze(1)).squeeze(1)
        m = torch.as_tensor(s.target_mask()[1:])
        terms.append(fn(lp, s)[m])
        counts.append(int(m.sum()))
    return terms, counts


def test_sft_loss_and_grad_match_per_sample():
    samples = _family_batch()
    (mb,) = pack(samples, 256)
    # the shared last prompt row really precedes different next tokens
    assert len(mb.loss_map.source_rows.unique()) < len(mb.loss_map)
    N = mb.num_rows
    for reduction in ("token", "sample", "sum"):
        logits = torch.randn(N, V, dtype=torch.float64, requires_grad=True)
        lp = gather_logprobs(logits, mb.loss_map.source_rows, mb.loss_map.targets)
        loss = sft_loss(lp, mb.loss_map, reduction=reduction)
        (g,) = torch.autograd.grad(loss, logits)

        ref_logits = logits.detach().clone().requires_grad_(True)
        terms, counts = _per_sample_terms(ref_logits, mb, samples,
                                          lambda lp_, s: -lp_ * torch.as_tensor(s.per_token("weight", 1.0)[1:]))
        if reduction == "token":
            ref = torch.cat(terms).sum() / sum(counts)
        elif reduction == "sum":
            ref = torch.cat(terms).sum()
        else:
            per = [t.sum() / c for t, c in zip(terms, counts) if c]
            ref = torch.stack(per).mean()
        (g_ref,) = torch.autograd.grad(ref, ref_logits)
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_policy_loss_per_occurrence_matches_per_sample_ppo(kl_coef):
    samples = _family_batch(1)
    (mb,) = pack(samples, 256)
    logits = torch.randn(mb.num_rows, V, dtype=torch.float64, requires_grad=True)
    lp = gather_logprobs(logits, mb.loss_map.source_rows, mb.loss_map.targets)
    loss, metrics = policy_loss(lp, mb.loss_map, clip_eps=0.2, clip_eps_high=0.28, kl_coef=kl_coef)
    (g,) = torch.autograd.grad(loss, logits)

    def ppo(lp_, s):
        adv = torch.as_tensor(s.per_token("advantage", 0.0)[1:])
        old = torch.as_tensor(s.old_logprobs[1:])
        r = torch.exp(lp_ - old)
        per = -torch.minimum(r * adv, r.clamp(0.8, 1.28) * adv)
        d = torch.as_tensor(s.ref_logprobs[1:]) - lp_
        per = per + kl_coef * (torch.exp(d) - d - 1)
        return per * torch.as_tensor(s.per_token("weight", 1.0)[1:])

    ref_logits = logits.detach().clone().requires_grad_(True)
    terms, counts = _per_sample_terms(ref_logits, mb, samples, ppo)
    ref = torch.cat(terms).sum() / sum(counts)
    (g_ref,) = torch.autograd.grad(ref, ref_logits)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)
    assert 0.0 <= metrics["clip_fraction"] <= 1.0 and metrics["num_tokens"] == len(mb.loss_map)


def test_loss_across_microbatches_uses_global_denominator():
    samples = _family_batch(2)
    mbs = pack(samples, 24)
    assert len(mbs) > 1
    total = sum(len(m.loss_map) for m in mbs)
    logits = [torch.randn(m.num_rows, V, dtype=torch.float64) for m in mbs]
    tree = sum(sft_loss(gather_logprobs(l, m.loss_map.source_rows, m.loss_map.targets), m.loss_map,
                        denominator=total) for l, m in zip(logits, mbs))
    flat = []
    for l, m in zip(logits, mbs):
        terms, _ = _per_sample_terms(l, m, samples, lambda lp_, s: -lp_ * torch.as_tensor(s.per_token("weight", 1.0)[1:]))
        flat += terms
    torch.testing.assert_close(tree, torch.cat(flat).sum() / total, rtol=1e-12, atol=1e-12)


def test_policy_loss_needs_advantages():
    (mb,) = pack([[1, 2, 3]], 8)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(torch.zeros(len(mb.loss_map)), mb.loss_map)
    # mixed data: SFT works, the policy loss names the sample without an advantage
    (mb,) = pack([Sample([1, 2], advantage=1.0), Sample([1, 3])], 8)
    assert torch.isfinite(sft_loss(torch.zeros(len(mb.loss_map)), mb.loss_map))
    with pytest.raises(ValueError, match="sample 1: has no advantages"):
        policy_loss(torch.zeros(len(mb.loss_map)), mb.loss_map)


# ------------------------------------------------------------------ per-token fields, per-occurrence clip ranges
def _per_token_batch(seed=0):
    """Samples whose weight, advantage, old/ref log-prob and clip ranges change from token to token
    (so reading a neighbour's value changes the loss), prompts masked out, a duplicate and a prefix."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(3):
        prompt = rng.integers(0, V, rng.integers(3, 6)).tolist()
        for c in range(3):
            toks = prompt + rng.integers(0, V, rng.integers(2, 6)).tolist()
            L = len(toks)
            out.append(Sample(toks, loss_mask=[0] * len(prompt) + [1] * (L - len(prompt)),
                              advantage=rng.normal(size=L), weight=rng.uniform(0.2, 3.0, L),
                              # near the log-probs of the small logits below: ratios fall on both sides
                              old_logprobs=rng.normal(-np.log(V), 0.4, L), ref_logprobs=rng.normal(-np.log(V), 0.4, L),
                              meta=dict(clip_lo=rng.uniform(0.02, 0.3, L), clip_hi=rng.uniform(0.05, 0.5, L))))
    out.append(out[0])  # duplicate
    s = out[1]
    out.append(Sample(s.tokens[:4].tolist(), loss_mask=[0, 0, 1, 1], advantage=s.advantage[:4], weight=s.weight[:4] * 2,
                      old_logprobs=s.old_logprobs[:4], ref_logprobs=s.ref_logprobs[:4] - 0.1,
                      meta=dict(clip_lo=s.meta["clip_lo"][:4], clip_hi=s.meta["clip_hi"][:4])))
    return out


def _occurrence_clip(loss_map, samples, key):
    """[M] clip range of each occurrence, read from its sample's per-token array at its position."""
    return torch.tensor([samples[i].meta[key][t] for i, t in zip(loss_map.sample_index.tolist(),
                                                                loss_map.positions.tolist())], dtype=torch.float64)


def _oracle_terms(logits_of, samples, kind, kl_coef=0.0, scalar_clip=None):
    """Per sample, per target t (explicit loop): w[t] * l_t with l_t the NLL (``kind="sft"``) or the
    PPO/GRPO surrogate with the sample's own A[t], old[t], ref[t], clip ranges [t], and the log-prob
    of token t from the logits of row t-1 of the sample alone (``logits_of(i)`` [L, V]).
    Returns (terms per sample, number of clipped-low, clipped-high occurrences)."""
    terms, low, high = [], 0, 0
    for i, s in enumerate(samples):
        li = logits_of(i)
        per = []
        for t in np.flatnonzero(s.target_mask()):
            lp = torch.log_softmax(li[t - 1], dim=-1)[int(s.tokens[t])]
            w = float(s.weight[t])
            if kind == "sft":
                per.append(-w * lp)
                continue
            A, old, ref = float(s.advantage[t]), float(s.old_logprobs[t]), float(s.ref_logprobs[t])
            lo, hi = (s.meta["clip_lo"][t], s.meta["clip_hi"][t]) if scalar_clip is None else scalar_clip
            r = torch.exp(lp - old)
            low, high = low + int(r < 1 - lo), high + int(r > 1 + hi)
            l = -torch.minimum(r * A, torch.clamp(r, 1 - lo, 1 + hi) * A)
            l = l + kl_coef * (torch.exp(ref - lp) - (ref - lp) - 1)
            per.append(w * l)
        terms.append(per)
    return terms, low, high


def _reduce_oracle(terms, reduction):
    flat = [x for per in terms for x in per]
    if reduction == "sum":
        return torch.stack(flat).sum()
    if reduction == "token":
        return torch.stack(flat).sum() / len(flat)  # the original denominator: number of targets
    return torch.stack([torch.stack(per).sum() / len(per) for per in terms if per]).mean()


@pytest.mark.parametrize("reduction", ["token", "sample", "sum"])
@pytest.mark.parametrize("kind", ["sft", "grpo", "grpo_kl"])
def test_per_token_fields_and_clip_ranges_match_per_sample(kind, reduction):
    """Packed loss over several microbatches (global denominators) == the per-sample formula written
    from the sample fields, value and d/d(logits); per-token weights/advantages/old/ref log-probs
    and per-occurrence clip ranges [M]."""
    samples = _per_token_batch(3)
    mbs = pack(samples, 24)
    assert len(mbs) > 2
    gen = torch.Generator().manual_seed(5)
    logits = [(0.3 * torch.randn(mb.num_rows, V, generator=gen, dtype=torch.float64)).requires_grad_() for mb in mbs]
    where = {sid: (k, mb) for k, mb in enumerate(mbs) for sid in mb.sample_ids}
    M = sum(len(mb.loss_map) for mb in mbs)
    den = {"token": M, "sample": len(samples), "sum": None}[reduction]
    kl = 0.1 if kind == "grpo_kl" else 0.0

    tree = 0.0
    for lg, mb in zip(logits, mbs):
        lm = mb.loss_map
        lp = gather_logprobs(lg, lm.source_rows, lm.targets)
        if kind == "sft":
            tree = tree + sft_loss(lp, lm, reduction=reduction, denominator=den)
        else:
            loss, _ = policy_loss(lp, lm, clip_eps=_occurrence_clip(lm, samples, "clip_lo"),
                                  clip_eps_high=_occurrence_clip(lm, samples, "clip_hi"), kl_coef=kl,
                                  reduction=reduction, denominator=den)
            tree = tree + loss
    g_tree = torch.autograd.grad(tree, logits)

    terms, low, high = _oracle_terms(lambda i: logits[where[i][0]][where[i][1].sample_rows(i)], samples,
                                     "sft" if kind == "sft" else "grpo", kl_coef=kl)
    ref = _reduce_oracle(terms, reduction)
    g_ref = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(tree, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_tree, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if kind != "sft":
        # both bounds clip somewhere, and per-token ranges clip differently from one scalar range
        assert low > 0 and high > 0
        scalar = _oracle_terms(lambda i: logits[where[i][0]][where[i][1].sample_rows(i)], samples, "grpo",
                               scalar_clip=(0.16, 0.27))[1:]
        assert scalar != (low, high)


def test_megatron_loss_func_takes_per_occurrence_clip_ranges():
    """`tree_loss_func` (the Megatron ``loss_func``) with [M] clip ranges and per-token fields: its
    loss_sum is the per-sample sum, its token count the number of targets."""
    from megatron_tree.megatron.loss import tree_loss_func

    samples = _per_token_batch(4)
    (mb,) = pack(samples, 256)
    lm = mb.loss_map
    logits = 0.3 * torch.randn(mb.num_rows, V, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    lp = gather_logprobs(logits, lm.source_rows, lm.targets)
    loss_sum, n, report = tree_loss_func(lm, lp, loss_type="grpo", clip_eps=_occurrence_clip(lm, samples, "clip_lo"),
                                         clip_eps_high=_occurrence_clip(lm, samples, "clip_hi"), kl_coef=0.05)
    terms, low, high = _oracle_terms(lambda i: logits[mb.sample_rows(i)], samples, "grpo", kl_coef=0.05)
    assert low > 0 and high > 0
    torch.testing.assert_close(loss_sum, _reduce_oracle(terms, "sum"), rtol=1e-12, atol=1e-12)
    assert int(n) == sum(len(p) for p in terms) == len(lm)
    sft_sum, _, _ = tree_loss_func(lm, lp, loss_type="sft")
    torch.testing.assert_close(sft_sum, _reduce_oracle(_oracle_terms(lambda i: logits[mb.sample_rows(i)], samples,
                                                                     "sft")[0], "sum"), rtol=1e-12, atol=1e-12)
