"""`Sample`: one training sequence and its per-token / per-sample RL fields.

Index convention: every per-token array is aligned with ``tokens``; entry ``t`` describes token
``t`` *as a target*, predicted from row ``t-1``. Entry 0 therefore never produces a loss.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .routes import validate_routes

_TOKEN_FIELDS = ("old_logprobs", "ref_logprobs")
_SCALAR_OR_TOKEN_FIELDS = ("advantage", "weight")


@dataclass
class Sample:
    """One sequence.

    tokens        [L] int, 0 <= id < 2**31
    loss_mask     [L] bool; ``loss_mask[t]`` marks token t as a target predicted from row t-1.
                  Default: every token after the first. ``loss_mask[0]`` must be False.
    advantage     scalar (per sample) or [L] (per token); RL advantage of each target
    old_logprobs  [L] log-prob of token t under the behaviour policy (PPO/GRPO ratio)
    ref_logprobs  [L] log-prob of token t under the reference policy (KL penalty)
    weight        scalar or [L]; loss weight of each target (default 1)
    group         optional group id (e.g. GRPO prompt group); carried, never interpreted by packing
    meta          free-form user data, carried untouched
    routed_experts  [L, moe_layers, topk] int: the experts each MoE layer chose for token t when the
                  rollout was generated (routing replay, `megatron_tree.tree.routes`); entry t is the
                  routing of row t itself (not a target)
    images        list of `megatron_tree.tree.images.ImageRef` in order of appearance (vision-language
                  records): the placeholder run and content key of each image; rows are shared only
                  where images agree too, and positions are multimodal (`tree.images`)
    """

    tokens: Any
    loss_mask: Any = None
    advantage: Any = None
    old_logprobs: Any = None
    ref_logprobs: Any = None
    weight: Any = None
    group: Any = None
    meta: dict = field(default_factory=dict)
    routed_experts: Any = None
    images: Any = None

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens)
        if self.images is not None:
            self.images = list(self.images)
        if self.routed_experts is not None and not isinstance(self.routed_experts, np.ndarray):
            try:
                self.routed_experts = np.asarray(self.routed_experts)
            except ValueError:  # ragged: validate_sample names the rule
                self.routed_experts = np.asarray(self.routed_experts, dtype=object)
        if self.loss_mask is not None:
            self.loss_mask = np.asarray(self.loss_mask)
        for name in _TOKEN_FIELDS:
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, np.asarray(v, dtype=np.float64))
        for name in _SCALAR_OR_TOKEN_FIELDS:
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, np.asarray(v, dtype=np.float64))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def target_mask(self) -> np.ndarray:
        """[L] bool mask of tokens that are targets (validated form of ``loss_mask``)."""
        if self.loss_mask is None:
            m = np.ones(len(self), dtype=bool)
            m[:1] = False
            return m
        return self.loss_mask.astype(bool)

    def per_token(self, name: str, default: float) -> np.ndarray:
        """[L] float64 values of a scalar-or-per-token field (``default`` when absent)."""
        v = getattr(self, name)
        if v is None:
            return np.full(len(self), default, dtype=np.float64)
        return np.full(len(self), float(v)) if v.ndim == 0 else v


def as_sample(x) -> Sample:
    """Accept a `Sample`, a dict with the same field names, or a bare token sequence."""
    if isinstance(x, Sample):
        return x
    if isinstance(x, dict):
        return Sample(**x)
    return Sample(tokens=x)


def validate_sample(index: int, s: Sample, *, max_tokens: int | None = None, vocab_size: int | None = None,
                    where: str | None = None, route_spec=None, mtp_tail: int = 0) -> None:
    """Raise ValueError naming the sample (``where`` overrides, e.g. "file.jsonl:12") and the broken rule.
    ``route_spec`` (`megatron_tree.tree.routes.RouteSpec`): the model's MoE layers, top-k and expert
    count that ``routed_experts`` must match (their per-token shape is checked whatever it is).
    ``mtp_tail``: the MTP tail rows packing adds after the sample (``pack(..., mtp_tail=)``), which must
    fit ``max_tokens`` with it."""
    name = where or f"sample {index}"
    t = s.tokens
    if t.ndim != 1:
        raise ValueError(f"{name}: tokens must be a 1-D sequence, got shape {t.shape}")
    L = t.shape[0]
    if L == 0:
        raise ValueError(f"{name}: empty sample (no tokens)")
    if not np.issubdtype(t.dtype, np.integer):
        if not (np.issubdtype(t.dtype, np.floating) and np.all(np.mod(t, 1) == 0)):
            raise ValueError(f"{name}: tokens must be integers, got dtype {t.dtype}")
    if t.min() < 0 or t.max() >= 2**31:
        raise ValueError(f"{name}: token ids must lie in [0, 2**31), got range [{t.min()}, {t.max()}]")
    if vocab_size is not None and t.max() >= vocab_size:
        raise ValueError(f"{name}: token id {int(t.max())} >= vocab size {vocab_size}")
    if max_tokens is not None and L > max_tokens:
        raise ValueError(f"{name}: {L} tokens exceed max_tokens_per_mb={max_tokens}")
    if max_tokens is not None and mtp_tail and L + mtp_tail > max_tokens:
        raise ValueError(f"{name}: {L} tokens and its {mtp_tail} MTP tail rows (mtp_tail) exceed "
                         f"max_tokens_per_mb={max_tokens}")
    if s.loss_mask is not None:
        if s.loss_mask.shape != (L,):
            raise ValueError(f"{name}: loss_mask has shape {s.loss_mask.shape}, tokens have length {L}")
        m = s.loss_mask
        if m.dtype != bool:
            if m.dtype.kind not in "iuf":
                raise ValueError(f"{name}: loss_mask must hold booleans (or 0 / 1), got dtype {m.dtype}")
            off = np.flatnonzero((m != 0) & (m != 1))
            if len(off):
                raise ValueError(f"{name}: loss_mask must hold booleans (or 0 / 1), got {m[off[0]]} at token "
                                 f"{int(off[0])}")
        if bool(s.loss_mask[0]):
            raise ValueError(f"{name}: loss_mask[0] is set, but token 0 has no preceding row to predict it")
    for f in _TOKEN_FIELDS + _SCALAR_OR_TOKEN_FIELDS:
        v = getattr(s, f)
        if v is None:
            continue
        if f in _TOKEN_FIELDS and v.shape != (L,):
            raise ValueError(f"{name}: {f} must have one value per token ({L}), got shape {v.shape}")
        if f in _SCALAR_OR_TOKEN_FIELDS and v.ndim != 0 and v.shape != (L,):
            raise ValueError(f"{name}: {f} must be a scalar or have one value per token ({L}), got shape {v.shape}")
        if v.ndim == 0:
            if not np.isfinite(v):
                raise ValueError(f"{name}: {f} has a non-finite value at a target position (per-sample value "
                                 f"{float(v)})")
            continue
        bad = s.target_mask() & ~np.isfinite(v)
        if bad.any():
            at = int(np.argmax(bad))
            raise ValueError(f"{name}: {f} has a non-finite value at a target position (token {at}: {float(v[at])})")
    if s.routed_experts is not None:
        s.routed_experts = validate_routes(name, s.routed_experts, L, route_spec)
    if s.images:
        _validate_images(name, s.images, L)


def _validate_images(name: str, images: list, length: int) -> None:
    from .images import ImageRef

    end = 0
    for k, im in enumerate(images):
        if not isinstance(im, ImageRef):
            raise ValueError(f"{name}: images[{k}] must be a tree.images.ImageRef (the data layer makes them from "
                             f"paths or bytes), got {type(im).__name__}")
        if im.start < end or im.length <= 0 or im.start + im.length > length:
            raise ValueError(f"{name}: images[{k}] covers tokens {im.start}:{im.start + im.length}, which must lie "
                             f"inside the {length} tokens, after image {k - 1}'s end ({end}), and not be empty")
        end = im.start + im.length


def samples_from(seq: Sequence) -> list[Sample]:
    return [as_sample(x) for x in seq]
