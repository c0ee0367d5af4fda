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
