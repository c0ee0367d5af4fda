"""The Bridge's weight mapping and the tree module classes.

The Bridge's ``AutoMapping`` chooses a parameter's tensor-parallel split from its module's class
*name* (a registry of names per "column" / "row" / "replicated"), so a tree subclass of a stock
module (``TreeGatedDeltaNet`` of ``GatedDeltaNet``) is unknown to it until registered with its stock
parent's type. `register_tree_modules` registers every tree class we build: statically for the ones
the Bridge registers lazily (its Qwen3-Next bridge registers ``GatedDeltaNet`` when its mapping is
first made) and by mirroring for any stock parent registered now.
"""
from __future__ import annotations

__all__ = ["auto_bridge", "register_tree_modules", "load_hf_weights", "save_hf_pretrained", "HFWeightsError"]

# the Bridge's own type for these stock parents (param_mapping.AutoMapping, qwen3_next_bridge)
_STATIC = {"TreeDotProductAttention": "column", "TreeGatedDeltaNet": "column",
           # the local DSA indexer's weights projection (TE specs use a duplicated TELinear): every TP rank holds it whole
           "DuplicatedLinear": "replicated"}


def _tree_classes() -> list:
    from ..megatron.attention import TreeDotProductAttention
    from ..megatron.gdn import TreeGatedDeltaNet
    from ..megatron.mla import TreeMLASelfAttention
    from ..megatron.mtp import TreeMultiTokenPredictionLayer

    classes = [TreeDotProductAttention, TreeGatedDeltaNet, TreeMLASelfAttention, TreeMultiTokenPredictionLayer]
    try:
        from ..megatron.dsa import TreeDSAIndexer, TreeDSAttention

        classes += [TreeDSAttention, TreeDSAIndexer]
    except ImportError:  # megatron-core without DSA
        pass
    try:
        from ..megatron.mamba import TreeMambaMixer  # made on first access (needs the stock mixer)

        classes.append(TreeMambaMixer)
    except (ImportError, RuntimeError):
        pass
    return classes


def register_tree_modules() -> None:
    """Register the tree module classes with the Bridge's ``AutoMapping`` (idempotent)."""
    from ..cpu.bridge import import_bridge

    import_bridge()
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    registry = AutoMapping._MODULE_TYPE_REGISTRY
    for name, kind in _STATIC.items():
        AutoMapping.register_module_type(name, kind)
    for cls in _tree_classes():
        for base in cls.__mro__[1:]:
            kind = next((k for k, names in registry.items() if base.__name__ in names), None)
            if kind is not None:
                AutoMapping.register_module_type(cls.__name__, kind)
                break


def auto_bridge(path, **kwargs):
    """``megatron.bridge.AutoBridge.from_hf_pretrained(path, **kwargs)`` with the tree module
    classes registered (on a host without transformer-engine through `megatron_tree.cpu.bridge`)."""
    from ..cpu.bridge import import_bridge

    bridge_pkg = import_bridge()
    register_tree_modules()
    return bridge_pkg.AutoBridge.from_hf_pretrained(str(path), **kwargs)


class HFWeightsError(ValueError):
    """A Hugging Face checkpoint that does not give every parameter of the model a value."""


def load_hf_weights(bridge, model, hf_path=None) -> None:
    """``bridge.load_hf_weights(model)`` that cannot leave a parameter unloaded.

    The Bridge skips, with a log warning only, every Megatron parameter that has no mapping or whose
    HF tensor is not in the checkpoint, leaving it at its initial value (e.g. transformers 5.x saves
    Nemotron-H's embedding as ``backbone.embedding.weight``; megatron-bridge 0.6.2 maps
    ``backbone.embeddings.weight``). Here every parameter is set to NaN first and any parameter still
    NaN afterwards is an `HFWeightsError` naming it (on any rank: the check is all-reduced)."""
    import torch

    models = model if isinstance(model, (list, tuple)) else [model]
    with torch.no_grad():
        for m in models:
            for p in m.parameters():
                p.fill_(float("nan"))
    bridge.load_hf_weights(list(models), hf_path=hf_path)
    missing = sorted({name for m in models for name, p in m.named_parameters() if bool(torch.isnan(p).any())})
    flag = torch.tensor([float(len(missing))])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag)
    if missing or flag.item() > 0:
        where = f"{', '.join(missing[:6])}{f' and {len(missing) - 6} more' if len(missing) > 6 else ''}" if missing \
            else "parameters on another rank"
        raise HFWeightsError(f"the Hugging Face checkpoint {hf_path or getattr(bridge.hf_pretrained, 'model_name_or_path', '')} "
                             f"left these parameters without a value ({type(bridge._model_bridge).__name__} has no "
                             f"mapping for them, or the tensor it maps is not in the checkpoint: see its warnings): "
                             f"{where}")


def save_hf_pretrained(bridge, model, path, **kwargs) -> None:
    """``bridge.save_hf_pretrained(model, path)`` (a Hugging Face directory: config, weights, tokenizer
    files of the source checkpoint). megatron-bridge 0.6.2's save imports ``modelopt`` (NVIDIA ModelOpt)
    only to ask whether the model is ModelOpt-quantized, and does not declare the dependency; where
    ModelOpt is not installed that question has the answer no (a tree provider refuses ModelOpt
    specs), given by a stand-in module for the duration of the save."""
    import importlib.util

    models = list(model) if isinstance(model, (list, tuple)) else [model]
    kwargs.setdefault("show_progress", False)
    if importlib.util.find_spec("modelopt") is not None:
        bridge.save_hf_pretrained(models, str(path), **kwargs)
        return
    with _modelopt_is_quantized_stand_in():
        bridge.save_hf_pretrained(models, str(path), **kwargs)


class _modelopt_is_quantized_stand_in:
    _NAMES = ("modelopt", "modelopt.torch", "modelopt.torch.quantization", "modelopt.torch.quantization.utils")

    def __enter__(self):
        import sys
        import types

        self._added = [n for n in self._NAMES if n not in sys.modules]
        for name in self._added:
            module = types.ModuleType(name)
            module.__path__ = []
            sys.modules[name] = module
        sys.modules["modelopt.torch.quantization.utils"].is_quantized = lambda model: False
        return self

    def __exit__(self, *exc):
        import sys

        for name in self._added:
            sys.modules.pop(name, None)
        return False
