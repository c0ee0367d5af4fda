"""The Bridge's weight mapping and the tree module classes.

The Bridge's ``AutoMapping`` chooses a parameter's tensor-parallel split from its module's class
*name* (a registry of names per "column" / "row" / "replicated"), so a tree subclass of a stock
module (``TreeGatedDeltaNet`` of ``GatedDeltaNet``) is unknown to it until registered with its stock
parent's type. `register_tree_modules` registers every tree class we build: statically for the ones
the Bridge registers lazily (its Qwen3-Next bridge registers ``GatedDeltaNet`` when its mapping is
first made) and by mirroring for any stock parent registered now.
"""
from __future__ import annotations

__all__ = ["auto_bridge", "register_tree_modules", "load_hf_weights", "save_hf_pretrained", "HFWeightsError",
           "copy_source_files", "save_hf_errors", "with_local_module_names"]

# the Bridge's own type for these stock parents (param_mapping.AutoMapping, qwen3_next_bridge)
_STATIC = {"TreeDotProductAttention": "column", "TreeGatedDeltaNet": "column",
           # the local DSA indexer's weights projection (TE specs use a duplicated TELinear): every TP rank holds it whole
           "DuplicatedLinear": "replicated",
           # the local twin of the Bridge's TERowParallelLinearLayerNorm (`local_twins`), and Gemma 3's tree core
           "RowParallelLinearLayerNorm": "row", "TreeGemma3DotProductAttention": "replicated",
           "TreeGemma2DotProductAttention": "replicated"}


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
    classes registered (on a host without transformer-engine through `megatron_tree.cpu.bridge`), and on
    such a host its weight mapping taught the local modules' names (`with_local_module_names`)."""
    from ..cpu.bridge import import_bridge
    from ..ops.backend import module_available

    bridge_pkg = import_bridge()
    register_tree_modules()
    bridge = bridge_pkg.AutoBridge.from_hf_pretrained(str(path), **kwargs)
    if not module_available("transformer_engine"):
        cls = type(bridge._model_bridge)  # (a new model bridge per access: its class is taught)
        if not getattr(cls.mapping_registry, "_tree_local_names", False):
            cls.mapping_registry = with_local_module_names(cls.mapping_registry)
    return bridge


#: transformer-engine fuses a layer's norms into the next linear; the local spec keeps them as modules
_TE_FUSED_NORMS = ((".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
                   (".self_attention.linear_qkv.layer_norm_bias", ".input_layernorm.bias"),
                   (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
                   (".mlp.linear_fc1.layer_norm_bias", ".pre_mlp_layernorm.bias"))
#: grouped-GEMM experts (one tensor per expert, ``weight<i>``) and the sequential ones the CPU path builds
_GROUPED_EXPERTS = ((".experts.linear_fc1.weight*", ".experts.local_experts.*.linear_fc1.weight"),
                    (".experts.linear_fc2.weight*", ".experts.local_experts.*.linear_fc2.weight"),
                    (".experts.linear_fc1.bias*", ".experts.local_experts.*.linear_fc1.bias"),
                    (".experts.linear_fc2.bias*", ".experts.local_experts.*.linear_fc2.bias"))


def _alias(mapping, megatron_param: str):
    import copy

    twin = copy.copy(mapping)
    twin.megatron_param = megatron_param
    for name, value in vars(twin).items():  # per-mapping caches are the copy's own
        if name.endswith("_cache") and isinstance(value, dict):
            setattr(twin, name, {})
    return twin


def with_local_module_names(mapping_registry):
    """A model bridge class's ``mapping_registry`` method that also maps the local (no transformer-engine)
    modules' names where the Bridge maps a tensor only by a name the CPU path does not build: a norm
    named only by TE's fused name (megatron-bridge 0.6.2's MiMo MTP norms) and experts named only
    grouped-GEMM style (its OLMoE: ``experts.linear_fc1.weight<i>``; the CPU path builds sequential
    experts, ``experts.local_experts.<i>.linear_fc1.weight``), each to the same HF tensors by the same
    mapping. Without it those parameters stay unloaded (`load_hf_weights` refuses the checkpoint) or the
    Bridge stops on a task it cannot map. Names it already maps are unchanged."""
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry

    def registry(self):
        reg = mapping_registry(self)
        have = {m.megatron_param for m in reg.mappings}
        extra = []
        for m in reg.mappings:
            for named, local in _TE_FUSED_NORMS + _GROUPED_EXPERTS:
                if m.megatron_param.endswith(named):
                    alias = m.megatron_param[:-len(named)] + local
                    if alias not in have:
                        have.add(alias)
                        extra.append(_alias(m, alias))
        return MegatronMappingRegistry(*reg.mappings, *extra) if extra else reg

    registry._tree_local_names = True
    return registry


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


# what a Hugging Face directory holds besides the weights and config.json: copied from the source as it is
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_NOT_COPIED = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


def save_hf_pretrained(bridge, model, path, *, trust_remote_code: bool = False, **kwargs) -> None:
    """The model as a Hugging Face directory that a failure cannot cost the trained weights (collective).

    In this order: the weights (the Bridge's ``save_hf_weights``: gathered over TP / PP / EP, rank 0
    writes), then ``config.json`` (the source's config; its ``auto_map`` kept only with
    ``trust_remote_code``, as the Bridge does), then every other file of the source directory copied as
    it is (tokenizer and processor files, chat template, generation config; the source's own ``*.py``
    with ``trust_remote_code``): never re-instantiated, so a tokenizer that needs a package this host
    lacks (sentencepiece, tiktoken) or no tokenizer at all costs nothing. (The Bridge's own
    ``save_hf_pretrained`` instantiates the tokenizer first and lost every trained weight when it
    could not.) A source that is not a local directory (a hub id) gets its files from the local hub
    cache; where they are not there, a warning names them. megatron-bridge 0.6.2's weight save imports
    ``modelopt`` (NVIDIA ModelOpt) only to ask whether the model is ModelOpt-quantized, and does not
    declare the dependency; where ModelOpt is not installed that question has the answer no (a tree
    provider refuses ModelOpt specs), given by a stand-in module for the duration of the save."""
    import importlib.util
    from pathlib import Path

    import torch.distributed as dist

    models = list(model) if isinstance(model, (list, tuple)) else [model]
    kwargs.setdefault("show_progress", False)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        Path(path).mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("modelopt") is not None:
        bridge.save_hf_weights(models, str(path), **kwargs)
    else:
        with _modelopt_is_quantized_stand_in():
            bridge.save_hf_weights(models, str(path), **kwargs)
    if rank0:
        _save_config(bridge.hf_pretrained, path, trust_remote_code)
        copy_source_files(getattr(bridge.hf_pretrained, "model_name_or_path", None), path,
                          trust_remote_code=trust_remote_code)
    if dist.is_initialized():
        dist.barrier()


def _save_config(hf_pretrained, path, trust_remote_code: bool) -> None:
    import copy

    config = copy.deepcopy(getattr(hf_pretrained, "config", hf_pretrained))
    if hasattr(config, "quantization_config"):  # the saved weights are plain
        del config.quantization_config
    if not trust_remote_code and "auto_map" in vars(config):
        del config.auto_map
    config.save_pretrained(str(path))


def copy_source_files(source, path, *, trust_remote_code: bool = False) -> list:
    """Copy the files of HF checkpoint ``source`` that are neither weights nor ``config.json`` into ``path``,
    byte for byte (``*.py`` only with ``trust_remote_code``); returns their names. A hub id is read from
    the local hub cache; what cannot be found is a warning, not an error (the weights are saved)."""
    import os
    import shutil
    import warnings
    from pathlib import Path

    if source is None:
        return []
    src = Path(str(source))
    if not src.is_dir():
        try:
            from huggingface_hub import snapshot_download

            src = Path(snapshot_download(str(source), local_files_only=True))
        except Exception as e:  # noqa: BLE001 - any failure: the files are named in the warning
            warnings.warn(f"--save-hf {path}: the tokenizer / processor files of {source} are not copied (not a "
                          f"local directory, not in the local hub cache: {type(e).__name__}); the weights and "
                          "config.json are saved", stacklevel=2)
            return []
    copied = []
    for f in sorted(src.iterdir()):
        name = f.name
        if (not f.is_file() or name.startswith(".") or name in _NOT_COPIED or name.endswith(_WEIGHT_SUFFIXES)
                or (name.endswith(".py") and not trust_remote_code)):
            continue
        target = Path(path) / name
        if os.path.abspath(target) != os.path.abspath(f):
            shutil.copy2(f, target)
        copied.append(name)
    return copied


def save_hf_errors(save_hf, hf_model) -> list:
    """Why ``--save-hf save_hf`` could not be written at the end of a run, found before its first step: a
    file where the directory goes, a directory (or the nearest existing parent) this process cannot write,
    or the ``--hf-model`` source directory itself (its weights would be overwritten while it is read)."""
    import os

    if not save_hf:
        return []
    target = os.path.abspath(save_hf)
    if hf_model and os.path.isdir(str(hf_model)) and os.path.realpath(target) == os.path.realpath(str(hf_model)):
        return [f"--save-hf {save_hf} is the --hf-model checkpoint directory itself: save the trained model elsewhere"]
    if os.path.exists(target) and not os.path.isdir(target):
        return [f"--save-hf {save_hf} is a file, not a directory"]
    probe = target
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        return [f"--save-hf {save_hf}: {probe} cannot be written by this user (the trained model is saved there "
                "after the last step)"]
    return []


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
