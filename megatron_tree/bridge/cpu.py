"""The Bridge's CPU part: a Megatron-Bridge provider on a host without transformer-engine or CUDA.

`use_local_specs`: local (no transformer-engine) specs. `cpu_settings`: on a host without CUDA, the
fused kernels a Bridge provider asks for (TE / Apex / Triton fusions, MoE permute and router fusion,
grouped GEMM, the DeepEP / HybridEP "flex" token dispatcher) are turned off and weights are made on the CPU, as `megatron_tree.training.models
.make_config` does for its own CPU configs.

The Bridge's providers default to transformer-engine specs (the GPT layer / decoder block spec, the
hybrid stack spec, Qwen3-Next's experimental-attention block). On a host without transformer-engine
(`use_local_specs` does nothing elsewhere) they are pointed at Megatron's stock structure with
Megatron's local modules (`megatron_tree.megatron.family_specs`' local builders, the ones the tests'
stock oracles use), zero-centred norms as `megatron_tree.cpu.bridge.ZeroCenteredRMSNorm`. The
Bridge's weight mappings name both the fused TE norms and the separate local ones. A family's own spec
function gets its local twin: OLMoE's (which modifies the Bridge's ``default_layer_spec``) run on the
Bridge's ``local_layer_spec``; Gemma's (which names TE modules directly) with each TE module replaced by its
local twin (`local_twins`); a TE module without a twin is refused by name. This lives
here, not in `megatron_tree.cpu`, only because it builds from `megatron_tree.megatron`, a layer above it.
"""
from __future__ import annotations

from ..cpu.bridge import ZeroCenteredRMSNorm, swap_norms
from ..ops.backend import module_available
from .local_twins import LocalTwinError, local_norm, local_twin_spec

__all__ = ["use_local_specs", "cpu_settings"]

#: fused-kernel switches of a TransformerConfig that need CUDA (TE, Apex or Triton kernels)
CUDA_ONLY_FUSIONS = ("bias_activation_fusion", "masked_softmax_fusion", "bias_dropout_fusion", "apply_rope_fusion",
                     "gradient_accumulation_fusion", "persist_layer_norm", "moe_permute_fusion", "moe_router_fusion",
                     "cross_entropy_loss_fusion", "moe_grouped_gemm", "batch_p2p_sync")


def cpu_settings(provider) -> list:
    """On a host without CUDA turn off ``provider``'s CUDA-only fusions and initialise on the CPU.
    Returns the names changed (nothing where CUDA is available). Call before ``finalize()``."""
    import torch

    if torch.cuda.is_available():
        return []
    changed = [name for name in CUDA_ONLY_FUSIONS if getattr(provider, name, False)]
    for name in changed:
        setattr(provider, name, False)
    if getattr(provider, "moe_token_dispatcher_type", None) == "flex":  # DeepEP / HybridEP: GPU only
        provider.moe_token_dispatcher_type = "alltoall"
        changed.append("moe_token_dispatcher_type")
    if not getattr(provider, "use_cpu_initialization", False):
        provider.use_cpu_initialization = True
        changed.append("use_cpu_initialization")
    return changed


def use_local_specs(provider) -> bool:
    """On a host without transformer-engine, point a Bridge provider's spec at Megatron's local
    modules. Returns False (nothing changed) where transformer-engine is installed. Refuses a
    provider whose spec is custom (no local counterpart is known)."""
    if module_available("transformer_engine"):
        return False
    zero_centered = bool(getattr(provider, "layernorm_zero_centered_gamma", False))
    if hasattr(provider, "falconh1_stack_spec"):  # Falcon-H1: its own stack spec, names TE modules directly
        te_stack = provider.falconh1_stack_spec

        def falcon_local_stack():
            return local_twin_spec(te_stack() if callable(te_stack) else te_stack, zero_centered)

        provider.falconh1_stack_spec = falcon_local_stack
        return True
    if hasattr(provider, "hybrid_stack_spec"):
        from ..megatron.family_specs import get_local_mamba_stack_spec

        current = provider.hybrid_stack_spec
        if current is not None and not callable(current) and getattr(current, "module", None).__name__ not in (
                "HybridStack", "MambaStack"):
            raise ValueError(f"{type(provider).__name__}.hybrid_stack_spec is a custom spec: megatron_tree.bridge "
                             "knows its local (no transformer-engine) counterpart only for the stock hybrid stack")
        spec = get_local_mamba_stack_spec(moe_grouped_gemm=bool(getattr(provider, "moe_grouped_gemm", False)))
        provider.hybrid_stack_spec = swap_norms(spec, ZeroCenteredRMSNorm) if zero_centered else spec
        return True
    te_spec = provider.transformer_layer_spec
    name = getattr(te_spec, "__name__", type(te_spec).__name__)
    if not _stock_spec(te_spec):
        twin = _local_twin(te_spec, zero_centered) or _module_twins(te_spec, zero_centered)
        try:  # a spec with a transformer-engine module that has no twin is refused now, not at provide()
            _call_spec(twin, provider, None)
        except LocalTwinError as e:
            fn = getattr(te_spec, "func", te_spec)
            raise ValueError(f"{type(provider).__name__}.transformer_layer_spec is {getattr(fn, '__module__', '?')}."
                             f"{getattr(fn, '__qualname__', name)}, a family's own spec: {e}; replacing it with the "
                             "generic local spec would drop what the family's layers do (refused instead)") from None
        except Exception:  # noqa: BLE001 - a spec function that needs a finalized config is checked when built
            pass
        provider.transformer_layer_spec = twin
        return True

    def local_spec(config, vp_stage=None):
        spec = _local_gpt_spec(config, vp_stage)
        return swap_norms(spec, ZeroCenteredRMSNorm) if zero_centered else spec

    local_spec.__name__ = f"local_for_{name}"
    provider.transformer_layer_spec = local_spec
    return True


#: modules whose spec functions build Megatron's stock GPT layers (their local counterpart is `_local_gpt_spec`)
_STOCK_SPEC_MODULES = ("megatron.bridge.models.gpt_provider", "megatron.bridge.models.mla_provider",
                       "megatron.core.models.gpt.gpt_layer_specs",
                       "megatron.core.models.gpt.experimental_attention_variant_module_specs")


def _stock_spec(spec) -> bool:
    fn = getattr(spec, "func", spec)  # functools.partial (the DeepSeek-V3 provider's)
    return callable(fn) and getattr(fn, "__module__", None) in _STOCK_SPEC_MODULES


def _local_twin(spec_fn, zero_centered: bool):
    """The local twin of a family's spec function that modifies the Bridge's default TE layer spec (OLMoE's
    ``olmoe_layer_spec``: ``default_layer_spec(config)`` with its own attention class): the same function
    run while its module's ``default_layer_spec`` is the Bridge's ``local_layer_spec`` (the same layer
    with Megatron's local modules, separate norms: same structure, same parameter names). None for a
    spec function of any other shape."""
    import sys

    fn = getattr(spec_fn, "func", spec_fn)
    module = sys.modules.get(getattr(fn, "__module__", ""))
    try:
        from megatron.bridge.models import gpt_provider
    except ImportError:  # pragma: no cover - only Bridge providers get here
        return None
    if module is None or getattr(module, "default_layer_spec", None) is not gpt_provider.default_layer_spec:
        return None

    def twin(config, vp_stage=None):
        module.default_layer_spec = gpt_provider.local_layer_spec
        try:
            spec = _call_spec(spec_fn, config, vp_stage)
        finally:
            module.default_layer_spec = gpt_provider.default_layer_spec
        return swap_norms(spec, ZeroCenteredRMSNorm) if zero_centered else spec

    twin.__name__ = f"local_twin_of_{getattr(fn, '__name__', 'spec')}"
    return twin


def _call_spec(spec_fn, config, vp_stage):
    import inspect

    takes_vp = "vp_stage" in inspect.signature(spec_fn).parameters
    return spec_fn(config, vp_stage=vp_stage) if takes_vp else spec_fn(config)


def _module_twins(spec_fn, zero_centered: bool):
    """A family's spec function whose spec names transformer-engine modules directly (Gemma 3's
    ``gemma3_layer_spec``): its spec with each module replaced by its local twin (`local_twins`)."""

    def twin(config, vp_stage=None):
        from megatron.core.transformer.spec_utils import ModuleSpec
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

        spec = local_twin_spec(_call_spec(spec_fn, config, vp_stage), zero_centered)
        if isinstance(spec, ModuleSpec) and spec.module.__name__.endswith("TransformerLayer"):
            # Megatron would give a layer spec's block the default final norm (a transformer-engine TENorm
            # honours a zero-centred gain, its local default refuses it): the block with the twin's norm
            spec = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage),
                                              layer_norm=local_norm(zero_centered))
        return spec

    twin.__name__ = f"local_twins_of_{getattr(getattr(spec_fn, 'func', spec_fn), '__name__', 'spec')}"
    return twin


def _local_gpt_spec(config, vp_stage):
    """Megatron's local-module counterpart of a GPT provider's TE spec, chosen by the config."""
    from megatron.core.models.gpt import gpt_layer_specs as gls

    variant = getattr(config, "experimental_attention_variant", None)
    if variant in ("gated_delta_net", "dsa"):
        from ..megatron.family_specs import get_local_transformer_block_with_experimental_attention_variant_spec

        return get_local_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=vp_stage)
    if variant is not None:
        raise ValueError(f"experimental_attention_variant={variant!r} has no tree variant (gated_delta_net, dsa)")
    # the decoder block builder: per-layer dense / MoE (moe_layer_freq), MLA, qk norms, PP slicing
    return gls.get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization,
                                          qk_l2_norm=bool(getattr(config, "qk_l2_norm", False)), vp_stage=vp_stage)
