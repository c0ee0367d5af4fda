"""Activation bytes a microbatch's forward keeps for its backward, predicted per schedule item (host side).

What autograd keeps for a microbatch depends on the model's modules and on the kernels that run them
(a torch reference keeps chunk intermediates a fused kernel recomputes), so the prediction is a linear
model per **layer kind** over features of the microbatch, with coefficients measured once per model
configuration (`ActivationProfile`, fitted by `fit_activation_profile` from what saved-tensor hooks
counted: `megatron.saved_bytes`; `tools/calibrate_activations.py` writes one, `megatron-tree plan
--carry --activation-profile` reads it). Features (`microbatch_features`):

    n      rows the model computes (a carry item: its owned rows; padding included)
    qpad   n rounded up to the tree-attention block (128: the torch attention keeps q / o per block)
    c      carried rows a carry reader reads
    cpad   c rounded up to the block (their K / V enter its attention's second stage)
    qpad2, n2  ``qpad`` and ``n`` again when c > 0 (the second stage's own q / o, and the merge)
    c      also the conv of GDN / Mamba-2 under carry (it convolves the carried rows with the own)
    gP, gA, gK  Gated DeltaNet's chunked scan: chunk rows, chunk area (rows x chunk length) and
           chunks over the own rows' segments, level by level (chunk length min(64, the level's
           longest segment))
    mP, mA, mK  the same for Mamba-2's SSD, which batches a level's segments by length (next power
           of two) and chunks each batch at min(chunk_size, its longest)
    t      loss targets (the loss keeps per-target terms)

Kinds: ``*`` attention, ``G`` Gated DeltaNet, ``M`` Mamba-2, ``-`` MLP, ``E`` MoE (one coefficient
vector for all layers of a kind: the profile keeps the per-layer mean, the layer count comes from
the pattern), and ``model`` (embedding, final norm, output layer, loss; under full recomputation also
the checkpointed layer inputs). A fill item runs without autograd and keeps nothing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from .carry import _host, forest_levels, mb_own_forest

__all__ = ["KIND_FEATURES", "FEATURES", "ATTENTION_BLOCK", "CHUNK", "MAMBA_CHUNK", "microbatch_features", "ActivationProfile",
           "fit_activation_profile", "nnls"]

ATTENTION_BLOCK = 128  # ops.attention.DEFAULT_BLOCK_SIZE
CHUNK = 64  # the chunked GDN scan's chunk length
MAMBA_CHUNK = 128  # Megatron's MambaMixer chunk_size default

#: the features each kind's bytes are linear in
KIND_FEATURES = {
    "*": ("n", "qpad", "cpad", "qpad2", "n2"),
    "G": ("n", "c", "gP", "gA", "gK"),
    "M": ("n", "c", "mP", "mA", "mK"),
    "-": ("n",),
    "E": ("n",),
    "model": ("one", "n", "t", "s", "samples"),
}
FEATURES = ("one", "n", "qpad", "c", "cpad", "qpad2", "n2", "gP", "gA", "gK", "mP", "mA", "mK", "t", "s", "samples")


def _pad(x: int, block: int) -> int:
    return -(-x // block) * block


def _recurrent_features(seg_len: np.ndarray, level: np.ndarray, real: np.ndarray, forest: bool, gdn_chunk: int,
                        mamba_chunk: int) -> dict:
    """Chunk features of the segments the recurrent layers run, level by level. Gated DeltaNet: the
    tree scan (``forest`` False: a microbatch without carry) pads a level's chunks to min(chunk, its
    longest real segment); the forest scan (a carry microbatch's own forest, padding rows included
    as one-row roots) batches a level's segments by length, chunk min(chunk, next power of two,
    the batch's longest). Mamba-2 batches a level's real segments by length (next power of two) and
    chunks each batch at min(chunk_size, its longest)."""
    out = dict.fromkeys(("gP", "gA", "gK", "mP", "mA", "mK"), 0)

    def add(prefix, C, k):
        out[prefix + "P"] += int(k * C)
        out[prefix + "A"] += int(k * C * C)
        out[prefix + "K"] += int(k)

    for lv in np.unique(level):
        here = level == lv
        ln, ln_real = seg_len[here], seg_len[here & real]
        if forest:
            cap = np.minimum(gdn_chunk, 1 << np.ceil(np.log2(ln)).astype(np.int64))
            for C in np.unique(cap):
                b = ln[cap == C]
                C = min(int(C), int(b.max()))
                add("g", C, (-(-b // C)).sum())
        elif len(ln_real):
            C = min(gdn_chunk, int(ln_real.max()))
            add("g", C, (-(-ln_real // C)).sum())
        if len(ln_real):
            bucket = np.ceil(np.log2(ln_real)).astype(np.int64)
            for bk in np.unique(bucket):
                b = ln_real[bucket == bk]
                T = int(b.max())
                C = min(mamba_chunk, T)
                add("m", C, -(-T // C) * len(b))
    return out


def microbatch_features(mb, phase: str = "run", *, gdn_chunk: int = CHUNK, mamba_chunk: int = MAMBA_CHUNK) -> dict:
    """The features (module docstring) of one microbatch (`TreeMicrobatch`; a carry microbatch in
    ``phase`` "fill" / "run" / "restore"). A fill's are all zero (it keeps nothing)."""
    lay, info = mb.layout, getattr(mb, "carry", None)
    N = lay.num_rows
    if phase == "fill":
        return dict.fromkeys(FEATURES, 0)
    if info is not None:
        n, c = mb.owned_rows, len(info.carried)
        seg_start, seg_len, seg_parent = mb_own_forest(mb)[:3]
        level = forest_levels(seg_parent)
        real = seg_start < n - lay.num_padding
    else:
        n, c = N, 0
        seg_len, level = _host(lay.segment_lengths), _host(lay.segment_level)
        real = _host(lay.segment_offsets)[:-1] < N - lay.num_padding
    out = {"one": 1, "n": int(n), "qpad": _pad(int(n), ATTENTION_BLOCK), "c": int(c),
           "cpad": _pad(c, ATTENTION_BLOCK), "qpad2": _pad(n, ATTENTION_BLOCK) if c else 0, "n2": int(n) if c else 0,
           "t": 0, "s": 0, "samples": len(mb.sample_ids)}
    if mb.loss_map is not None:
        out["t"] = len(mb.loss_map)
        out["s"] = len(np.unique(_host(mb.loss_map.source_rows)))
    out.update(_recurrent_features(seg_len, level, real, info is not None, gdn_chunk, mamba_chunk))
    return out


@dataclass
class ActivationProfile:
    """Per-kind coefficients (bytes per unit of each feature, per layer of the kind) of one model
    configuration, and the model's layer kinds in order (``pattern``: one letter per mixer / MLP, as
    `CarryGeometry.pattern`). ``about``: what it was measured on (model, dtype, recompute, backend)."""

    pattern: str
    coef: dict = field(default_factory=dict)  # kind -> {feature: bytes}
    about: dict = field(default_factory=dict)

    def kind_bytes(self, kind: str, features: dict) -> float:
        return float(sum(w * features[f] for f, w in self.coef.get(kind, {}).items()))

    def predict_features(self, features: dict) -> int:
        """Bytes autograd keeps for a microbatch with these features (`microbatch_features`)."""
        return int(round(self.kind_bytes("model", features) + sum(self.kind_bytes(k, features) for k in self.pattern)))

    def predict(self, mb, phase: str = "run") -> int:
        """Bytes autograd keeps for ``mb``'s forward in ``phase`` (0 for a fill)."""
        return 0 if phase == "fill" else self.predict_features(microbatch_features(mb, phase))

    def to_json(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump({"pattern": self.pattern, "coef": self.coef, "about": self.about}, fh, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, path: str) -> "ActivationProfile":
        with open(path) as fh:
            d = json.load(fh)
        bad = sorted(set(d.get("coef", {})) - set(KIND_FEATURES))
        if "pattern" not in d or bad:
            raise ValueError(f"{path}: not an activation profile (tools/calibrate_activations.py writes one)"
                             + (f"; unknown kinds {bad}" if bad else ""))
        return cls(d["pattern"], d["coef"], d.get("about", {}))


def nnls(X: np.ndarray, y: np.ndarray, iters: int = 200) -> np.ndarray:
    """Non-negative least squares (Lawson-Hanson): argmin ||X w - y|| with w >= 0. Columns are
    scaled to unit norm first (features differ by orders of magnitude)."""
    X = np.asarray(X, np.float64)
    y = np.asarray(y, np.float64)
    scale = np.linalg.norm(X, axis=0)
    scale[scale == 0] = 1.0
    Xs = X / scale
    m = Xs.shape[1]
    w = np.zeros(m)
    passive = np.zeros(m, bool)
    for _ in range(iters):
        grad = Xs.T @ (y - Xs @ w)
        cand = ~passive & (grad > 1e-12 * max(1.0, np.abs(grad).max()))
        if not cand.any():
            break
        passive[np.argmax(np.where(cand, grad, -np.inf))] = True
        while True:
            z = np.zeros(m)
            z[passive] = np.linalg.lstsq(Xs[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                w = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(w[neg] / (w[neg] - z[neg] + 1e-300))
            w = w + alpha * (z - w)
            passive &= w > 1e-12
            w[~passive] = 0.0
    return w / scale


def fit_activation_profile(pattern: str, measured: list, about: dict | None = None) -> ActivationProfile:
    """Fit the per-kind coefficients of a model with layer kinds ``pattern`` from ``measured``: a list
    of ``(features, {kind: bytes})`` (`microbatch_features`, `megatron.saved_bytes` per kind, the bytes
    summed over the kind's layers). Non-negative least squares per kind, per layer of the kind."""
    counts = {k: pattern.count(k) for k in set(pattern)}
    counts["model"] = 1
    coef = {}
    for kind, n_layers in counts.items():
        if kind not in KIND_FEATURES:
            continue
        names = KIND_FEATURES[kind]
        X = np.array([[f[name] for name in names] for f, _ in measured], np.float64)
        y = np.array([by_kind.get(kind, 0) / n_layers for _, by_kind in measured], np.float64)
        w = nnls(X, y) if len(y) else np.zeros(len(names))
        coef[kind] = {name: float(v) for name, v in zip(names, w) if v > 0}
    return ActivationProfile(pattern, coef, dict(about or {}))
