"""`tree_provider`: a Megatron-Bridge model provider that builds the tree model.

A Bridge provider (``GPTModelProvider`` and its family subclasses, ``HybridModelProvider``) is a
``TransformerConfig`` whose ``provide()`` resolves a spec and calls the stock model class with the
provider's own arguments (padded vocab, pre/post process, rotary settings, MTP block, process
groups). The tree provider is a copy of it whose class is a subclass, ``Tree<Provider>``, with one
change in ``provide()``: where the Bridge's provider module calls ``GPTModel`` / ``HybridModel`` it
gets a builder that treeifies the resolved spec (`megatron_tree.megatron.specs.treeify_spec`: core
attention, GDN and Mamba mixers, MLA, DSA, MTP layers) and builds `TreeGPTModel` / `TreeMambaModel`
with the same arguments. Everything else is the Bridge's, including weight loading (the provider's
pre-wrap hooks) and ``provide_distributed_model``.

Refused with a clear error (`TreeProviderError`): settings whose modules the swap cannot reach or
that cannot run on a tree (transformer-engine's full-layer spec, a ModelOpt spec, CUDA graphs,
virtual pipeline stages), and, as a last check on the built model, any stock sequence mixer left in
it (a spec that put one back, e.g. a custom spec hook).
"""
from __future__ import annotations

import contextlib
import copy
import sys
import threading

__all__ = ["tree_provider", "is_tree_provider", "TreeProviderError", "check_tree_model"]

_LOCK = threading.RLock()

# stock module class names that a tree model must not contain (their tree subclasses carry other names)
_STOCK_MIXERS = {
    "DotProductAttention": "core attention", "TEDotProductAttention": "core attention",
    "GatedDeltaNet": "Gated DeltaNet mixer", "MambaMixer": "Mamba-2 mixer", "MLASelfAttention": "MLA attention",
    "DSAttention": "DSA core attention", "DSAIndexer": "DSA indexer",
    "MultiTokenPredictionLayer": "MTP layer", "TransformerLayer_TE_full": "TE full layer",
}


class TreeProviderError(ValueError):
    """A provider setting that the tree model cannot honour."""


class _TreeProviderMixin:
    """Mixed in before a Bridge provider class by `tree_provider`."""

    tree_model = True

    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        refuse_undoing_settings(self)
        if getattr(self, "_pg_collection", None) is None:
            # provide_distributed_model sets it; a direct provide() uses Megatron's global groups
            from megatron.core.process_groups_config import ProcessGroupCollection

            self._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        with _building_tree_models(type(self)), _family_cores_kept(self):
            model = super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        _checkpoint_post_norm_epsilon(model, self)
        check_tree_model(model)
        return model


def _checkpoint_post_norm_epsilon(model, config) -> None:
    """Megatron-Bridge's ``TERowParallelLinearLayerNorm`` (Gemma 2 / 3, EXAONE 4's post-norms) builds its norm as
    ``TENorm(config, size)``, with TENorm's default epsilon 1e-5 where the checkpoint says ``rms_norm_eps``:
    set to ``config.layernorm_epsilon``, as the local twin (`local_twins.RowParallelLinearLayerNorm`) builds it."""
    for module in model.modules():
        if type(module).__name__ == "TERowParallelLinearLayerNorm" and hasattr(module.post_layernorm, "eps"):
            module.post_layernorm.eps = config.layernorm_epsilon


@contextlib.contextmanager
def _family_cores_kept(provider):
    """The Bridge's ``GPTModelProvider.provide`` overwrites the resolved spec's core attention with Megatron's
    ``DotProductAttention`` whenever ``attention_backend`` is ``local`` (which the tree provider sets, see
    `tree_provider`): a family's own core (Gemma 3's local / global one) would become plain tree attention.
    Until the model class is called the setting reads ``auto``; the tree builders put ``local`` back before
    building (Megatron's model sets transformer-engine's attention environment from it)."""
    from megatron.core.transformer.enums import AttnBackend

    before = provider.attention_backend
    provider.attention_backend = AttnBackend.auto
    try:
        yield
    finally:
        provider.attention_backend = before


_CLASSES: dict = {}


def _tree_class(cls):
    if issubclass(cls, _TreeProviderMixin):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Tree{cls.__name__}", (_TreeProviderMixin, cls),
                             {"__module__": __name__, "__doc__": f"{cls.__name__} building the tree model "
                                                                 f"(megatron_tree.bridge.tree_provider)."})
    return _CLASSES[cls]


def tree_provider(provider):
    """The tree version of a Megatron-Bridge provider (``bridge.to_megatron_provider()``): a copy of
    it (the original is unchanged) whose ``provide()`` / ``provide_distributed_model()`` build
    `TreeGPTModel` / `TreeMambaModel` from the provider's own spec, treeified, and arguments. On a
    host without transformer-engine the spec is first pointed at Megatron's local modules
    (`megatron_tree.bridge.cpu`). Set on the copy: ``attention_backend="local"`` (every core attention
    is tree attention), ``variable_seq_lengths=True`` and the ``alltoall`` MoE dispatcher in place of
    ``allgather`` (which Megatron refuses with variable lengths). Idempotent."""
    from .cpu import cpu_settings, use_local_specs
    from .mapping import register_tree_modules

    if is_tree_provider(provider):
        return provider
    if not hasattr(provider, "provide"):
        raise TypeError(f"tree_provider expects a Megatron-Bridge model provider, got {type(provider).__name__}")
    _model_swaps(type(provider))  # a provider building a model class the tree does not know: refused first
    out = copy.copy(provider)
    for name in ("_pre_wrap_hooks", "_post_wrap_hooks"):  # our copy gets its own hook lists
        if isinstance(getattr(provider, name, None), list):
            object.__setattr__(out, name, list(getattr(provider, name)))
    out.__class__ = _tree_class(type(provider))
    # every core attention becomes tree attention (ours, not transformer-engine's): "local" keeps Megatron
    # from asserting the TE attention-backend environment variables for a backend nothing uses
    from megatron.core.transformer.enums import AttnBackend

    out.attention_backend = AttnBackend.local
    # a tree microbatch's row count changes every microbatch; Megatron refuses the allgather MoE token
    # dispatcher with variable sequence lengths, alltoall computes the same routing
    out.variable_seq_lengths = True
    if getattr(out, "moe_token_dispatcher_type", None) == "allgather":
        out.moe_token_dispatcher_type = "alltoall"
    use_local_specs(out)
    cpu_settings(out)
    refuse_undoing_settings(out)
    register_tree_modules()
    return out


def is_tree_provider(provider) -> bool:
    return isinstance(provider, _TreeProviderMixin)


def refuse_undoing_settings(provider) -> None:
    """Raise `TreeProviderError` naming every provider setting that would undo the tree swap."""
    bad = []
    if getattr(provider, "use_transformer_engine_full_layer_spec", False):
        bad.append("use_transformer_engine_full_layer_spec=True (transformer-engine's fused TransformerLayer has no "
                   "core-attention slot to swap)")
    if getattr(provider, "restore_modelopt_state", False):
        bad.append("restore_modelopt_state=True (ModelOpt specs)")
    spec = getattr(provider, "transformer_layer_spec", None)
    if "modelopt" in getattr(spec, "__name__", ""):
        bad.append(f"transformer_layer_spec={spec.__name__} (a ModelOpt spec)")
    graphs = getattr(provider, "cuda_graph_impl", "none")
    if graphs not in (None, "none") or getattr(provider, "enable_cuda_graph", False):
        bad.append(f"cuda_graph_impl={graphs!r} (a tree's shape changes every microbatch)")
    if getattr(provider, "virtual_pipeline_model_parallel_size", None):
        bad.append("virtual_pipeline_model_parallel_size (interleaved pipelines are not supported by tree training)")
    if bad:
        raise TreeProviderError(f"{type(provider).__name__}: these settings would undo or cannot run the tree model: "
                                + "; ".join(bad))


def check_tree_model(model) -> None:
    """Raise `TreeProviderError` if a stock sequence mixer is left in a built model (named by path)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    left = []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls in _STOCK_MIXERS:
            left.append(f"{name} ({cls}: {_STOCK_MIXERS[cls]})")
        elif "TransformerLayer" in cls and not isinstance(module, TransformerLayer):
            left.append(f"{name} ({cls}: not a Megatron TransformerLayer)")
    from ..megatron.output_path import TreeOutputError, check_output_layer

    try:
        check_output_layer(model)
    except TreeOutputError as e:
        left.append(str(e))
    if left:
        raise TreeProviderError("the built model still holds stock modules where the tree needs its own (a spec "
                                "function or setting put them back): " + ", ".join(left[:8])
                                + (f" and {len(left) - 8} more" if len(left) > 8 else ""))


def _mtp_marker(config, vp_stage=None):
    """Stands for the Bridge's ``gpt_provider.mtp_block_spec`` while a tree model is built: the tree builder
    makes the MTP block itself for this host (`_tree_gpt_model`), and the Bridge's function builds it with
    transformer-engine modules whatever the host has (it fails where there is none). True iff MTP layers."""
    return True if getattr(config, "mtp_num_layers", None) else None


def _tree_gpt_model(config, transformer_layer_spec=None, *args, mtp_block_spec=None, vp_stage=None, **kwargs):
    """Stands where a Bridge provider calls ``GPTModel``: the same call, the tree model."""
    from ..megatron.model import TreeGPTModel
    from ..megatron.specs import get_tree_gpt_mtp_block_spec, te_available, treeify_spec

    from megatron.core.transformer.enums import AttnBackend

    config.attention_backend = AttnBackend.local  # see _family_cores_kept
    spec = treeify_spec(transformer_layer_spec)
    if mtp_block_spec is not None:
        # the Bridge builds the MTP block with transformer-engine modules; ours follows the host
        mtp_block_spec = get_tree_gpt_mtp_block_spec(config, spec, use_transformer_engine=te_available(),
                                                     vp_stage=vp_stage)
    return TreeGPTModel(config, spec, *args, mtp_block_spec=mtp_block_spec, vp_stage=vp_stage, **kwargs)


def _tree_hybrid_model(config=None, hybrid_stack_spec=None, *args, **kwargs):
    """Stands where a Bridge provider calls ``HybridModel``: the same call, `TreeMambaModel`."""
    from megatron.core.transformer.enums import AttnBackend

    from ..megatron.model import TreeMambaModel
    from ..megatron.specs import treeify_spec

    config.attention_backend = AttnBackend.local  # see _family_cores_kept
    return TreeMambaModel(config, hybrid_stack_spec=treeify_spec(hybrid_stack_spec), *args, **kwargs)


def _stock_builders() -> dict:
    from megatron.core.models.gpt import GPTModel

    out = {GPTModel: _tree_gpt_model}
    with contextlib.suppress(ImportError):
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        out[HybridModel] = _tree_hybrid_model
    with contextlib.suppress(ImportError):
        from megatron.core.models.mamba import MambaModel

        out[MambaModel] = _tree_hybrid_model
    falcon = sys.modules.get("megatron.bridge.models.falcon_h1.modeling_falconh1.falconh1_model")
    if falcon is not None:  # imported with its provider: the Bridge's own model class for Falcon-H1
        from .falcon_h1 import tree_falcon_h1_model

        out[falcon.FalconH1Model] = tree_falcon_h1_model
    qwen3_vl = sys.modules.get("megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model")
    if qwen3_vl is not None:  # imported with its provider: the Bridge's own vision-language model class
        from .qwen3_vl import tree_qwen3_vl_model

        out[qwen3_vl.Qwen3VLModel] = tree_qwen3_vl_model
    return out


def _model_swaps(provider_cls) -> list:
    """(module, global name, stock object, its stand-in) for every stock model class named in a module that
    defines a ``provide`` on ``provider_cls``'s MRO, plus the Bridge's MTP block spec function there (the
    Bridge's own ``FalconH1Model`` is among them: `falcon_h1`). A provider whose ``provide()`` builds another
    model class is refused by name: the tree has no counterpart of it."""
    owners = [c for c in provider_cls.__mro__ if "provide" in vars(c) and c is not _TreeProviderMixin]
    builders = _stock_builders()
    swaps = []
    for module in dict.fromkeys(sys.modules.get(c.__module__) for c in owners):
        if module is not None:
            swaps += [(module, k, v, builders[v]) for k, v in vars(module).items()
                      if isinstance(v, type) and v in builders]
    if not swaps:
        name = provider_cls.__name__.removeprefix("Tree") if issubclass(provider_cls, _TreeProviderMixin) \
            else provider_cls.__name__
        raise TreeProviderError(f"{name}: its provide() ({', '.join(c.__qualname__ for c in owners) or '?'}) "
                                "builds no GPTModel / HybridModel / FalconH1Model / Qwen3VLModel, the model classes "
                                "megatron_tree.bridge builds "
                                "as tree models; the family's own model class has no tree counterpart")
    swaps += [(module, "mtp_block_spec", module.mtp_block_spec, _mtp_marker)
              for module in dict.fromkeys(m for m, *_ in swaps) if callable(getattr(module, "mtp_block_spec", None))]
    # a vision-language provider names transformer-engine's GPT layer spec itself (Qwen3-VL's provide())
    vl = {m for m, _, _, b in swaps if getattr(b, "__name__", "") == "tree_qwen3_vl_model"}
    if vl:
        from .qwen3_vl import local_block_spec, local_layer_spec

        for name, stand_in in (("get_gpt_layer_with_transformer_engine_spec", local_layer_spec),
                               ("get_transformer_block_with_experimental_attention_variant_spec", local_block_spec)):
            swaps += [(m, name, getattr(m, name), stand_in) for m in vl if hasattr(m, name)]
    return swaps


@contextlib.contextmanager
def _building_tree_models(provider_cls):
    """While a tree provider's ``provide()`` runs, every module that defines a ``provide`` on its class's
    MRO resolves its stock model class names to the tree builders (the modules' own globals, restored on
    exit; serialised by a lock): a family provider whose ``provide()`` calls ``super().provide()``
    (Gemma's) builds its model in its parent's module."""
    swaps = _model_swaps(provider_cls)
    with _LOCK:
        try:
            for module, name, _, stand_in in swaps:
                setattr(module, name, stand_in)
            yield
        finally:
            for module, name, stock, _ in swaps:
                setattr(module, name, stock)


def hf_provider(path, *, load_weights: bool = True, trust_remote_code: bool = False, **overrides):
    """(bridge, tree provider) for a Hugging Face checkpoint directory or id: ``AutoBridge
    .from_hf_pretrained(path)``, its provider made a tree provider, ``overrides`` set on it
    (e.g. ``tensor_model_parallel_size=2``, ``params_dtype=torch.float64``), then ``finalize()``d. With ``load_weights``
    the provider's pre-wrap hook loads the checkpoint's weights (``provide_distributed_model``);
    with ``provide()`` call ``bridge.load_hf_weights([model])`` yourself. ``trust_remote_code``: let
    transformers run the checkpoint's own Python code (its config's ``auto_map``), as
    ``from_pretrained(trust_remote_code=True)`` does."""
    from .mapping import auto_bridge

    bridge = auto_bridge(path, trust_remote_code=True) if trust_remote_code else auto_bridge(path)
    provider = tree_provider(bridge.to_megatron_provider(load_weights=load_weights))
    for key, value in overrides.items():
        if not hasattr(provider, key):
            raise TreeProviderError(f"hf_provider: {type(provider).__name__} has no setting {key!r}")
        setattr(provider, key, value)
    provider.finalize()
    return bridge, provider
