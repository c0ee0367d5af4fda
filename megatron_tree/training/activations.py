"""Measure what a model's microbatches keep for backward and fit its `ActivationProfile`.

`measure_activation_bytes(model, microbatches)` runs each schedule item alone through Megatron's
schedule (`models.forward_backward`) under `megatron.saved_bytes.SavedBytes` and returns, per item,
its phase, its features (`cp.planning.activations.microbatch_features`) and the bytes per layer
kind. `calibration_workload(seed)` is the probe set `tools/calibrate_activations.py` fits on:
prompt families of three completions packed whole and with carry at several budgets, so every
feature varies (rows, carried rows, chunk lengths, forks). The model runs one microbatch at a time,
so a 1-layer-per-kind copy of a large model at its real widths is enough to calibrate it.
"""
from __future__ import annotations

import numpy as np

from ..cp.planning.activations import ActivationProfile, fit_activation_profile, microbatch_features

__all__ = ["measure_activation_bytes", "calibration_workload", "calibrate_activations"]


def measure_activation_bytes(model, microbatches: list, *, carry: bool = False, **loss_kwargs) -> list:
    """``[(phase, features, {kind: bytes})]`` for every schedule item of ``microbatches`` (one step: with
    ``carry`` its fill / run / restore items in schedule order, fills included with zero bytes)."""
    from ..megatron.carry import carry_items
    from ..megatron.saved_bytes import SavedBytes
    from .models import forward_backward

    meter = SavedBytes(model)
    items = carry_items(microbatches) if carry else list(microbatches)
    out = []
    try:
        for item in items:
            meter.reset()
            with meter:
                forward_backward(model, [item], **loss_kwargs)
            mb, phase = (item.mb, item.phase) if carry else (item, "run")
            out.append((phase, microbatch_features(mb, phase), meter.reset()))
    finally:
        meter.remove()
    return out


def calibration_workload(seed: int, *, vocab_size: int, scale: int = 1) -> list:
    """``[(samples, budget, carry)]``: prompt families (3 completions each) of varied lengths, packed
    whole at budgets that fit them and with carry at budgets below the longest sample. ``scale``
    multiplies every length (and budget)."""
    rng = np.random.default_rng(seed)

    def families(n, lo, hi):
        out = []
        for _ in range(n):
            prompt = rng.integers(1, vocab_size, int(rng.integers(lo, hi)) * scale).tolist()
            for _ in range(3):
                out.append(prompt + rng.integers(1, vocab_size, int(rng.integers(3, hi)) * scale).tolist())
        return out

    return [(families(4, 10, 30), 128 * scale, False), (families(4, 20, 60), 256 * scale, False),
            (families(5, 5, 20), 64 * scale, False), (families(3, 30, 90), 32 * scale, True),
            (families(3, 5, 30), 48 * scale, True), (families(3, 40, 100), 64 * scale, True)]


def calibrate_activations(model, workload: list, *, pad_to_multiple_of: int = 4, about: dict | None = None,
                          **loss_kwargs) -> tuple[ActivationProfile, list]:
    """Measure ``workload`` (`calibration_workload`'s form) on ``model`` and fit its profile. Returns
    ``(profile, measured)``: ``measured`` is `measure_activation_bytes`'s list over the workload."""
    from ..megatron.saved_bytes import layer_kinds
    from ..tree import pack

    measured = []
    for samples, budget, carry in workload:
        mbs = pack(samples, budget, carry=carry, pad_to_multiple_of=pad_to_multiple_of)
        measured += measure_activation_bytes(model, mbs, carry=carry, **loss_kwargs)
    pattern = layer_kinds(model)[0]
    fit = [(f, by_kind) for phase, f, by_kind in measured if phase != "fill"]
    return fit_activation_profile(pattern, fit, about), measured
