"""Count the bytes autograd keeps for backward, per layer kind (saved-tensor hooks: device independent).

`SavedBytes(model)` is a context manager: inside it, every tensor an autograd node saves is counted
once per storage (a view of a counted storage adds nothing; parameters are not activations and are
not counted; what a recomputation saves inside the backward is not counted either) and attributed to the layer kind of the innermost module running when it was saved
(`layer_kinds`: ``*`` attention, ``G`` Gated DeltaNet, ``M`` Mamba-2, ``-`` MLP, ``E`` MoE, the
norm in front of each with it; everything else, e.g. embedding, final norm, output layer, loss, the
inputs full recomputation checkpoints, to ``model``). What `cp.planning.activations` predicts.

    meter = SavedBytes(model)
    with meter:
        forward_backward(model, [item], ...)   # one microbatch
    meter.by_kind     # {"*": bytes, "-": bytes, ..., "model": bytes}

The storages stay referenced until `reset` (a freed storage's address could be reused and then not
be counted).
"""
from __future__ import annotations

import torch

from .model import unwrap_model as _unwrap

__all__ = ["SavedBytes", "layer_kinds"]

_MIXER_SLOTS = ("self_attention", "mixer", "input_layernorm", "norm")
_MLP_SLOTS = ("mlp", "pre_mlp_layernorm")


def _present(mod) -> bool:
    """A real submodule (Megatron fills a layer's absent slots with IdentityOp / IdentityFuncOp)."""
    return isinstance(mod, torch.nn.Module) and not isinstance(mod, torch.nn.Identity) and \
        not type(mod).__name__.startswith("Identity")


def _mixer_kind(mod) -> str:
    name = type(mod).__name__
    if "GatedDeltaNet" in name:
        return "G"
    if "Mamba" in name or "Mixer" in name:
        return "M"
    return "*"


def _mlp_kind(mod) -> str:
    return "E" if "MoE" in type(mod).__name__ else "-"


def layer_kinds(model) -> tuple[str, dict]:
    """``(pattern, {module: kind})``: the model's layer kinds in order (a GPT layer gives its
    attention and its MLP: ``*-``) and the kind of each module that roots one (a decoder layer's
    mixer / MLP slot and the norm in front of it)."""
    m = _unwrap(model)
    layers = list(getattr(getattr(m, "decoder", None), "layers", None) or [])
    mtp = getattr(m, "mtp", None)
    if mtp is not None:
        raise ValueError("SavedBytes: multi-token prediction layers are not attributed yet")
    pattern, roots = [], {}
    for layer in layers:
        mixer = next((getattr(layer, s) for s in ("self_attention", "mixer") if hasattr(layer, s)), None)
        mlp = getattr(layer, "mlp", None)
        mixer_kind = None
        if _present(mixer):
            mixer_kind = _mixer_kind(mixer)
            pattern.append(mixer_kind)
        mlp_kind = None
        if _present(mlp):
            mlp_kind = _mlp_kind(mlp)
            pattern.append(mlp_kind)
        for slot in _MIXER_SLOTS + _MLP_SLOTS:
            sub = getattr(layer, slot, None)
            if not _present(sub):
                continue
            kind = mixer_kind if slot in _MIXER_SLOTS else mlp_kind
            if kind is None:  # a norm in front of an absent slot (an MLP-only layer's input norm)
                kind = mlp_kind if slot in _MIXER_SLOTS else mixer_kind
            if kind is not None:
                roots[sub] = kind
    return "".join(pattern), roots


class SavedBytes:
    """Saved-tensor bytes per layer kind while the context is active (module docstring)."""

    def __init__(self, model):
        self.pattern, roots = layer_kinds(model)
        self._params = {p.untyped_storage().data_ptr() for p in _unwrap(model).parameters()}
        self._stack = ["model"]
        self._handles = []
        for mod, kind in roots.items():
            self._handles.append(mod.register_forward_pre_hook(lambda _m, _a, k=kind: self._stack.append(k)))
            self._handles.append(mod.register_forward_hook(lambda _m, _a, _o: self._pop()))
        self.by_kind: dict = {}
        self._seen: dict = {}
        self._hooks = None

    def _pop(self):
        self._stack.pop()

    def _pack(self, t: torch.Tensor):
        # a recomputation inside the backward saves again what it frees at once: not what the forward keeps
        if t.layout == torch.strided and torch._C._current_graph_task_id() == -1:
            s = t.untyped_storage()
            key = s.data_ptr()
            if key not in self._params and key not in self._seen and s.nbytes():
                self._seen[key] = s  # referenced: its address cannot be reused while we count
                kind = self._stack[-1]
                self.by_kind[kind] = self.by_kind.get(kind, 0) + s.nbytes()
        return t

    def reset(self) -> dict:
        """Return the counts so far and start again."""
        out, self.by_kind, self._seen = self.by_kind, {}, {}
        return out

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._hooks = None
        return False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
