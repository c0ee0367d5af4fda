"""Seeded synthetic workloads mirroring the field's standard prefix-sharing families.

Each preset returns a list of `Sample`s (GRPO style: each completion carries a per-sample
advantage normalised within its group, old log-probs, and a loss mask that excludes the prompt).
Samples are returned shuffled (rollouts arrive interleaved), so packers are tested on arrival order.

Presets (lengths in tokens):
  fixed_5k_16x100        one family: prompt 5000 + 16 completions x 100
  varied_5k_16x100       4 families: prompt 5000±512 (clipped ±1024), completions 100±32 (clipped ±64)
  many_small_64_4x16     64 families: prompt 64 + 4 completions x 16
  dominant_14745_16x921  one dominant family 14745 + 16 x 921, plus 8 background families 512 + 4 x 64
  long_8k_16x8k          one family: prompt 8192 + 16 completions x 8192
  agent_multiturn        agent traces forking at every turn: 4 turns, branching factor 2 per turn,
                         each turn = observation 96 + action 32 (loss only on actions)

`shared_prompt` is the benchmarks' plain workload: one prompt, equal completions, in arrival order.
"""
from __future__ import annotations

import numpy as np

from ..tree.sample import Sample

PRESETS = ("fixed_5k_16x100", "varied_5k_16x100", "many_small_64_4x16", "dominant_14745_16x921", "long_8k_16x8k",
           "agent_multiturn")


def _clipped_normal(rng, mean, std, clip):
    return int(np.clip(np.round(rng.normal(mean, std)), mean - clip, mean + clip))


def _family(rng, vocab, prompt_len, completion_lens, group) -> list[Sample]:
    prompt = rng.integers(1, vocab, prompt_len)
    rewards = rng.normal(size=len(completion_lens))
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    out = []
    for c, a in zip(completion_lens, adv):
        comp = rng.integers(1, vocab, c)
        tokens = np.concatenate([prompt, comp])
        mask = np.zeros(len(tokens), dtype=bool)
        mask[prompt_len:] = True
        old = np.where(mask, -rng.exponential(2.0, len(tokens)), 0.0)
        out.append(Sample(tokens=tokens, loss_mask=mask, advantage=float(a), old_logprobs=old, group=group))
    return out


def _agent_tree(rng, vocab, turns, branching, obs_len, act_len, group) -> list[Sample]:
    """All root-to-leaf traces of a tree that forks at every turn (each branch: new action + observation)."""
    system = rng.integers(1, vocab, obs_len)
    paths = [(system, np.zeros(obs_len, dtype=bool))]
    for _ in range(turns):
        nxt = []
        for toks, mask in paths:
            for _ in range(branching):
                act = rng.integers(1, vocab, act_len)
                obs = rng.integers(1, vocab, obs_len)
                nxt.append((np.concatenate([toks, act, obs]),
                            np.concatenate([mask, np.ones(act_len, bool), np.zeros(obs_len, bool)])))
        paths = nxt
    adv = rng.normal(size=len(paths))
    return [Sample(tokens=t, loss_mask=m, advantage=float(a), group=group) for (t, m), a in zip(paths, adv)]


def make_preset(name: str, *, seed: int = 0, vocab: int = 32000, scale: float = 1.0) -> list[Sample]:
    """Samples of preset ``name`` (shuffled). ``scale`` < 1 shrinks every length (for CPU demos/tests)."""
    rng = np.random.default_rng(seed)
    s = lambda n: max(1, int(round(n * scale)))
    if name == "fixed_5k_16x100":
        out = _family(rng, vocab, s(5000), [s(100)] * 16, 0)
    elif name == "varied_5k_16x100":
        out = []
        for g in range(4):
            p = s(_clipped_normal(rng, 5000, 512, 1024))
            out += _family(rng, vocab, p, [s(_clipped_normal(rng, 100, 32, 64)) for _ in range(16)], g)
    elif name == "many_small_64_4x16":
        out = [x for g in range(64) for x in _family(rng, vocab, s(64), [s(16)] * 4, g)]
    elif name == "dominant_14745_16x921":
        out = _family(rng, vocab, s(14745), [s(921)] * 16, 0)
        out += [x for g in range(1, 9) for x in _family(rng, vocab, s(512), [s(64)] * 4, g)]
    elif name == "long_8k_16x8k":
        out = _family(rng, vocab, s(8192), [s(8192)] * 16, 0)
    elif name == "agent_multiturn":
        out = [x for g in range(2) for x in _agent_tree(rng, vocab, 4, 2, s(96), s(32), g)]
    else:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    perm = rng.permutation(len(out))
    return [out[i] for i in perm]


def shared_prompt(prompt_len: int, completions: int, completion_len: int, *, vocab: int,
                  seed: int = 0) -> list[Sample]:
    """One prompt of ``prompt_len`` tokens and ``completions`` completions of ``completion_len`` each, in
    arrival order, loss on the completions only (no advantages): the benchmarks' model-step workload.
    Tokens are drawn from [1, vocab) by ``default_rng(seed)``, the prompt first."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, vocab, prompt_len)
    mask = np.arange(prompt_len + completion_len) >= prompt_len
    return [Sample(np.concatenate([prompt, rng.integers(1, vocab, completion_len)]), loss_mask=mask.copy())
            for _ in range(completions)]


def default_budget(samples, cap: int = 65536) -> int:
    """A sensible --max-tokens-per-mb: the smallest power of two >= 4096 that holds the longest
    sample and the largest prefix tree (trees above ``cap`` rows are left to be split)."""
    from ..tree.packing import PrefixPlan

    toks = [s.tokens for s in samples]
    largest_tree = int(PrefixPlan(toks).tree_rows().max())
    need = max(4096, max(len(t) for t in toks), min(largest_tree, cap))
    return 1 << (need - 1).bit_length()
