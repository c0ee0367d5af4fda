"""Reading a Hugging Face checkpoint's config before any rank starts (no Bridge, no transformers import
for a local directory)."""
from __future__ import annotations

import json
import os

__all__ = ["hf_config_value", "local_config", "remote_code_error", "checkpoint_refusals"]


def hf_config_value(path: str, key: str, *, trust_remote_code: bool = False):
    """``config.json[key]`` of a local HF checkpoint directory, else ``transformers.AutoConfig``'s
    attribute (a hub id). A missing directory, file or key is a ValueError naming it."""
    if os.path.isdir(str(path)):
        data = local_config(path)
        if data is None:
            raise ValueError(f"--hf-model {path}: no config.json there (a Hugging Face checkpoint directory holds one)")
        value = data.get(key, (data.get("text_config") or {}).get(key))
    else:
        from transformers import AutoConfig

        value = getattr(AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code), key, None)
    if value is None:
        raise ValueError(f"--hf-model {path}: its config has no {key!r}")
    return value


def local_config(path: str):
    """config.json of a local checkpoint directory as a dict; None for anything else (a hub id)."""
    cfg = os.path.join(str(path), "config.json")
    if not os.path.isfile(cfg):
        return None
    with open(cfg, encoding="utf-8") as f:
        return json.load(f)


def remote_code_error(path: str, trust_remote_code: bool, config=None):
    """None, or why ``--hf-model path`` cannot load without running its own code: a local checkpoint whose
    config.json (``config``, read from ``path`` when not given) names code of its own (``auto_map``) is
    asked of ``transformers.AutoConfig`` as the Bridge will ask it, and transformers' refusal is returned
    as it says it (a model type transformers knows natively loads without that code, as transformers
    decides)."""
    config = local_config(path) if config is None else config
    if trust_remote_code or config is None or "auto_map" not in config:
        return None
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except ValueError as e:
        return (f"--hf-model {path}: its config.json names code of its own (auto_map), and transformers says: "
                f"{' '.join(str(e).split())} -- pass --trust-remote-code to run that code")
    return None


def _rope(cfg: dict) -> dict:
    """The rope settings of a config.json (transformers 5's ``rope_parameters``, 4's ``rope_scaling``)."""
    return dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})


def _differs(rope: dict, expected: dict) -> list:
    return [f"{k}={rope.get(k)!r} (built as {v!r})" for k, v in expected.items()
            if rope.get(k) is not None and float(rope[k]) != float(v)]


#: what Megatron-Core / megatron-bridge 0.6.2 build whatever a checkpoint says
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_GPT_OSS_YARN = {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}
#: model types built with a layer the tree does not have yet: why
_NOT_BUILT = {
    "gemma3": "Gemma 3's vision-language model (Gemma3ForConditionalGeneration: a vision tower and its image-token "
              "attention bias) is not built on the tree yet; its text model (gemma3_text) is",
}


def checkpoint_refusals(path: str, config=None) -> list:
    """What a local ``--hf-model`` checkpoint carries that the tree cannot build exactly, each named with
    the setting and the family, read from its config.json (``config``, read from ``path`` when not given)
    before any rank starts (no Bridge import)."""
    cfg = local_config(path) if config is None else config
    if cfg is None:
        return []
    cfg = {**(cfg.get("text_config") or {}), **cfg}
    kind = str(cfg.get("model_type", ""))
    where = f"--hf-model {path} (model_type {kind!r})"
    out = []
    if kind in _NOT_BUILT:
        out.append(f"{where}: {_NOT_BUILT[kind]}")
    rope = _rope(cfg)
    kind_of_rope = rope.get("rope_type", rope.get("type"))
    llama3 = _differs(rope, _LLAMA3_ROPE) if kind_of_rope == "llama3" else []
    if llama3:
        out.append(f"{where}: llama3 rope scaling with {', '.join(llama3)}: Megatron-Core's llama3 scaling fixes "
                   "these values, so the model would use other positions than the checkpoint's")
    if kind == "gemma3_text":
        out += [f"{where}: {why}" for why in _gemma3_text_refusals(cfg)]
    if kind == "gemma2":
        n = int(cfg.get("num_hidden_layers", 0))
        built = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        if cfg.get("layer_types") is not None and list(cfg["layer_types"]) != built:
            out.append(f"{where}: layer_types={cfg['layer_types']} (megatron-bridge builds {built}: odd layers local)")
    if kind == "falcon_h1":
        out += [f"{where}: {why}" for why in _falcon_h1_refusals(cfg, kind_of_rope)]
    yarn = _differs(rope, _GPT_OSS_YARN) if kind == "gpt_oss" and kind_of_rope == "yarn" else []
    if yarn:
        out.append(f"{where}: YaRN with {', '.join(yarn)}: megatron-bridge's gpt-oss bridge sets gpt-oss's "
                   "published YaRN whatever the checkpoint says")
    return out


def _json_float(value) -> float:
    """A float from config.json: transformers 5 writes infinities as ``{"__float__": "Infinity"}``."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def _falcon_h1_refusals(cfg: dict, rope_type) -> list:
    """What a Falcon-H1 checkpoint can say that megatron-bridge 0.6.2's Falcon-H1 bridge does not build: it maps no
    bias (the Mamba projections, attention or MLP), clamps no time step, builds plain rope, and makes every layer
    the parallel Mamba-2 + attention + MLP layer."""
    out = [f"{key}=True (megatron-bridge's Falcon-H1 maps no such bias)"
           for key in ("mamba_proj_bias", "projectors_bias", "attention_bias", "mlp_bias") if cfg.get(key)]
    limit = cfg.get("time_step_limit")
    if limit is not None:
        low, high = (_json_float(v) for v in limit)
        if low > 0 or high != float("inf"):
            out.append(f"time_step_limit={[low, high]} (megatron-bridge's Falcon-H1 clamps no time step)")
    if rope_type not in (None, "default"):
        out.append(f"rope of type {rope_type!r} (megatron-bridge's Falcon-H1 builds plain rope)")
    if cfg.get("mamba_use_mlp") is False:
        out.append("mamba_use_mlp=False (megatron-bridge's Falcon-H1 builds an MLP in every layer)")
    return out


def _gemma3_text_refusals(cfg: dict) -> list:
    """What a Gemma 3 text checkpoint can say that megatron-bridge 0.6.2's Gemma 3 provider does not build: it
    makes every 6th layer global and the others local (``interleaved_attn_pattern`` (5, 1), whatever
    ``layer_types`` says), no attention or final logit soft-cap, causal attention, linear rope scaling only."""
    out = []
    n = int(cfg.get("num_hidden_layers", 0))
    types = cfg.get("layer_types")
    built = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    if types is not None and list(types) != built:
        out.append(f"layer_types={types} (megatron-bridge builds {built}: every 6th layer global)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            out.append(f"{key}={cfg[key]!r} (megatron-bridge's Gemma 3 builds no soft-cap)")
    if cfg.get("use_bidirectional_attention"):
        out.append("use_bidirectional_attention=True (the tree is causal)")
    params = cfg.get("rope_parameters") or {}
    for layer_type, rope in (params.items() if all(isinstance(v, dict) for v in params.values()) else ()):
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "linear") or (layer_type == "sliding_attention" and kind != "default"):
            out.append(f"rope_parameters[{layer_type!r}] of type {kind!r} (megatron-bridge builds default rope on "
                       "local layers and default or linear on global ones)")
    return out
