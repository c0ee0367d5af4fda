"""`megatron-tree verify --model vlm`: image records for a tiny vision-language model.

GRPO-like families whose prompts hold a screenshot and whose completions sometimes hold another (a
tool's screenshot), as processed pixels (`data.images.VisionInput.put`: what a rollout engine hands
over); among them two families whose prompts have identical tokens behind different screenshots, and
one screenshot behind two different prompts. Both sides of verify attach the pixels of their
microbatches' image slots; the planted fault ``images_merged`` packs the tree side as if image content
were not part of a row's identity, so those two screenshots share rows (and one encoder output).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..data.images import VisionInput
from ..tree.images import image_refs
from .models import VLM_PATCH_DIM

MERGE = 2
#: image placeholder, vision start and end tokens: the top of the vocabulary (eos is vocab - 1)
def special_tokens(vocab: int) -> tuple[int, int, int]:
    return vocab - 2, vocab - 3, vocab - 4


def vlm_verify_samples(seed: int, vocab: int, families: int):
    """``(samples, vision)``: image records (deterministic in ``seed``) and the `VisionInput` holding
    their pixels."""
    from ..tree import Sample

    img, vs, ve = special_tokens(vocab)
    eos = vocab - 1
    text_hi = vocab - 4
    rng = np.random.default_rng(seed)
    vision = VisionInput(image_token_id=img, merge=MERGE, processor=None)
    shots = [vision.put(rng.normal(size=(16, VLM_PATCH_DIM)), (1, 4, 4)) for _ in range(families + 1)]
    tool = [vision.put(rng.normal(size=(24, VLM_PATCH_DIM)), (1, 4, 6)) for _ in range(2)]

    def image(key_grid):
        key, grid = key_grid
        return [vs] + [img] * (int(np.prod(grid)) // MERGE ** 2) + [ve], key_grid

    out = []
    twin_text = rng.integers(1, text_hi, 3).tolist()
    for f in range(families):
        # families 0 and 1: identical prompt tokens, different screenshots; the last family reuses
        # family 0's screenshot behind other text
        head = twin_text if f < 2 else rng.integers(1, text_hi, int(rng.integers(2, 5))).tolist()
        shot = shots[0] if f == families - 1 and families > 2 else shots[f]
        ptoks, pimg = image(shot)
        prompt, imgs = head + ptoks + rng.integers(1, text_hi, 2).tolist(), [pimg]
        for c in range(3):
            comp = rng.integers(1, text_hi, int(rng.integers(1, 4))).tolist()
            cimgs = []
            if c == 1:  # a tool screenshot inside the completion, then more text
                t, ti = image(tool[f % 2])
                comp += t + rng.integers(1, text_hi, 2).tolist()
                cimgs = [ti]
            comp += [eos] if rng.random() < 0.5 else []
            toks = prompt + comp
            keys = [k for k, _ in imgs + cimgs]
            grids = [g for _, g in imgs + cimgs]
            refs = image_refs(f"family {f} completion {c}", np.asarray(toks), img, keys, grids, MERGE)
            out.append(Sample(tokens=toks, loss_mask=[0] * len(prompt) + [1] * len(comp), advantage=float(rng.normal()),
                              old_logprobs=-np.log(vocab) + rng.normal(0, 0.2, len(toks)), images=refs))
    toks = rng.integers(1, text_hi, 5).tolist()  # a text-only record beside them
    out.append(Sample(tokens=toks, advantage=1.0, old_logprobs=-np.log(vocab) + rng.normal(0, 0.2, 5), images=[]))
    return out, vision


def images_merged(samples):
    """The planted fault: every image takes the content key of the first image of its grid, so records whose
    tokens agree share rows even where their screenshots differ (the trie merges them, and one screenshot's
    encoder output serves both)."""
    first: dict = {}
    out = []
    for s in samples:
        refs = [dataclasses.replace(r, key=first.setdefault(r.grid, r.key)) for r in (s.images or ())]
        out.append(dataclasses.replace(s, images=refs))
    return out


def attach(vision, item):
    """``item`` (a microbatch, or a ``(microbatch, plan...)`` tuple) with its image slots' pixels."""
    if isinstance(item, tuple):
        return (vision.attach(item[0]),) + tuple(item[1:])
    return vision.attach(item)
