"""Tiny random Hugging Face models of the families Megatron-Bridge imports, made by `transformers` itself
(``save_pretrained``) for the bridge tests. Weights are perturbed away from the HF init (norms near 1
plus noise, biases and gates nonzero), so that every parameter the mapping moves changes the output."""
from __future__ import annotations

import torch

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_next", "nemotron_h", "deepseek_v3", "glm5", "gpt_oss", "olmoe", "gemma3", "gemma2",
            "falcon_h1")

_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
               head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)


def config(family: str, **overrides):
    cfg = _config(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def _config(family: str):
    import transformers as tf

    if family == "qwen3":
        return tf.Qwen3Config(**_COMMON, num_hidden_layers=2)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**_COMMON, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if family == "qwen3_next":
        return tf.Qwen3NextConfig(**_COMMON, num_hidden_layers=4,
                                  layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                                  linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                  linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=16, shared_expert_intermediate_size=16, decoder_sparse_step=1,
                                  mlp_only_layers=[], norm_topk_prob=True)
    if family == "nemotron_h":
        return tf.NemotronHConfig(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  max_position_embeddings=128, tie_word_embeddings=False, intermediate_size=48,
                                  layers_block_type=["mamba", "attention", "mlp", "mamba"], ssm_state_size=8,
                                  mamba_num_heads=4, mamba_head_dim=8, n_groups=2, conv_kernel=4, expand=1,
                                  chunk_size=32, use_mamba_kernels=False)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4,
                  num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                  topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8,
                  max_position_embeddings=128, tie_word_embeddings=False, routed_scaling_factor=1.5)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(**common, num_hidden_layers=2, first_k_dense_replace=1)
    if family == "glm5":
        return tf.GlmMoeDsaConfig(**common, num_hidden_layers=2, first_k_dense_replace=1, head_dim=8,
                                  index_topk=4, index_head_dim=16, index_n_heads=2,
                                  indexer_rope_interleave=False)  # transformers: half-split rope in the indexer
    if family == "olmoe":  # q / k norms over all heads at once (not per head): the Bridge's own attention class
        return tf.OlmoeConfig(vocab_size=96, hidden_size=32, intermediate_size=16, num_attention_heads=4,
                              num_key_value_heads=4, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                              max_position_embeddings=128, tie_word_embeddings=False)
    if family == "llama":
        # Llama 3's rope scaling as published (at head_dim 8 and theta 500000 one frequency is divided by 8 and
        # one smoothed); not in FAMILIES: the checkpoint tests' save / load source
        return tf.LlamaConfig(**_COMMON, num_hidden_layers=2,
                              rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                   high_freq_factor=4.0, original_max_position_embeddings=8192,
                                                   rope_theta=500000.0))
    if family == "qwen2":  # q/k/v biases (the base of `remote_code_mimo`)
        return tf.Qwen2Config(**_COMMON, num_hidden_layers=2)
    if family == "gpt_oss":
        # its features all matter on SAMPLES (up to 14 tokens): YaRN as published (factor 32 over 4096
        # positions: at head_dim 8 and theta 150000 one frequency is interpolated, one ramped, and the
        # attention factor is 1.35), a 4-token window on every other layer, learned sinks, biased experts
        # with the clamped GLU
        return tf.GptOssConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, num_hidden_layers=2, num_local_experts=4,
                               num_experts_per_tok=2, sliding_window=4, max_position_embeddings=131072,
                               layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                               rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                                    truncate=False, original_max_position_embeddings=4096,
                                                    rope_theta=150000.0))
    if family == "gemma3":
        # Gemma 3 as the Bridge builds it: 5 local layers (a 4-token window) then a global one, local / global
        # rotary bases, zero-centred norms incl. q / k and the post-attention / post-MLP norms, a scaled
        # embedding, query_pre_attn_scalar != head_dim, tied embeddings
        return tf.Gemma3TextConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, num_hidden_layers=6, sliding_window=4,
                                   query_pre_attn_scalar=6, max_position_embeddings=128, tie_word_embeddings=True,
                                   rope_parameters={"full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
                                                    "sliding_attention": {"rope_theta": 10000.0,
                                                                          "rope_type": "default"}})
    if family == "gemma2":
        # Gemma 2: a 4-token window on odd layers, attention and final logit soft-caps small enough to matter on
        # a tiny random model (published: 50 and 30), query_pre_attn_scalar != head_dim, post-norms, tied embeddings
        return tf.Gemma2Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, num_hidden_layers=4, sliding_window=4,
                               query_pre_attn_scalar=6, attn_logit_softcapping=0.5, final_logit_softcapping=2.0,
                               max_position_embeddings=128, tie_word_embeddings=True)
    if family == "falcon_h1":
        # Falcon-H1: every layer Mamba-2 and attention side by side on one norm, then a SwiGLU MLP; every MuP
        # multiplier away from 1 (published values are of this size), the mixer's gated RMSNorm over 2 groups
        return tf.FalconH1Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_d_ssm=32,
                                 mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=2,
                                 mamba_chunk_size=16, mamba_rms_norm=True, mamba_norm_before_gate=False,
                                 max_position_embeddings=128, tie_word_embeddings=False, rope_theta=1e11,
                                 embedding_multiplier=2.0, lm_head_multiplier=0.5, key_multiplier=0.7,
                                 attention_in_multiplier=1.3, attention_out_multiplier=0.8, ssm_in_multiplier=0.6,
                                 ssm_out_multiplier=1.4, mlp_multipliers=[0.9, 1.2],
                                 ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 0.8])
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


@torch.no_grad()
def make(family: str, path, seed: int = 0, nvidia_names: bool = True, **overrides):
    """Save a tiny random ``family`` model (float32, config ``overrides``) to ``path``; returns the HF
    model. ``nvidia_names``: Nemotron-H's embedding under NVIDIA's tensor name (see below)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config(family, **overrides))
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    model.save_pretrained(str(path))
    if family == "nemotron_h" and nvidia_names:
        _nvidia_embedding_name(path)
    return model


def _nvidia_embedding_name(path) -> None:
    """transformers 5.x saves Nemotron-H's embedding as ``backbone.embedding.weight``; NVIDIA's
    checkpoints (and megatron-bridge 0.6.2's mapping) name it ``backbone.embeddings.weight``, and
    transformers loads both. The tests use NVIDIA's name (the other is tested as refused by name)."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    f = Path(path) / "model.safetensors"
    tensors = load_file(str(f))
    tensors["backbone.embeddings.weight"] = tensors.pop("backbone.embedding.weight")
    save_file(tensors, str(f), metadata={"format": "pt"})


def hf_logprobs(path, samples, dtype=torch.float64, stable_dsa_ties: bool = False, trust_remote_code: bool = False) -> dict:
    """{(i, t): log p(tokens[t] | tokens[:t])} of `transformers`' model at ``path``, each sample alone.

    ``stable_dsa_ties``: GLM-5's DSA indexer picks its top-k keys with ``torch.topk``, whose order among
    equal scores is implementation-defined; index scores tie exactly wherever ReLU zeroes every head's
    score. With this flag equal scores go to the lowest key index (a stable sort), the rule of our tree
    DSA (and of tests' stock DSA oracle)."""
    import contextlib

    import transformers as tf

    # eager experts: transformers' default grouped-GEMM experts take no float64; eager attention: the reference
    # (the default SDPA path drops Gemma 2's attention logit soft-cap, 9e-3 on its tiny model here)
    model = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, experts_implementation="eager",
                                                    attn_implementation="eager", trust_remote_code=trust_remote_code)
    model.eval()
    out = {}
    with torch.no_grad(), (_stable_dsa_topk() if stable_dsa_ties else contextlib.nullcontext()):
        for i, toks in enumerate(samples):
            logits = model(torch.tensor([toks])).logits[0].double()
            lp = torch.log_softmax(logits, -1)
            for t in range(1, len(toks)):
                out[(i, t)] = float(lp[t - 1, toks[t]])
    return out


class _stable_dsa_topk:
    """While active, GLM-5's DSA indexer breaks top-k ties by the lowest key index."""

    def __enter__(self):
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

        self._cls, self._forward = glm.GlmMoeDsaIndexer, glm.GlmMoeDsaIndexer.forward
        forward = self._forward

        def stable_forward(module, *args, **kwargs):
            topk = torch.Tensor.topk

            def stable_topk(t, k, dim=-1, largest=True, sorted=True):
                values, indices = torch.sort(t, dim=dim, descending=largest, stable=True)
                return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

            torch.Tensor.topk = stable_topk
            try:
                return forward(module, *args, **kwargs)
            finally:
                torch.Tensor.topk = topk

        self._cls.forward = stable_forward
        return self

    def __exit__(self, *exc):
        self._cls.forward = self._forward
        return False


_MIMO_CONFIG = """from transformers import Qwen2Config


class MiMoConfig(Qwen2Config):
    model_type = "mimo"

    def __init__(self, num_nextn_predict_layers=0, **kwargs):
        self.num_nextn_predict_layers = num_nextn_predict_layers
        super().__init__(**kwargs)
"""

_MIMO_MODEL = """from transformers import Qwen2ForCausalLM

from .configuration_mimo import MiMoConfig


class MiMoForCausalLM(Qwen2ForCausalLM):
    config_class = MiMoConfig
"""


@torch.no_grad()
def remote_code_mimo(path, seed: int = 0, mtp: bool = False):
    """A tiny checkpoint laid out as Xiaomi's MiMo is published: ``model_type`` "mimo", which transformers
    does not know, its config and model classes in the checkpoint's own ``configuration_mimo.py`` /
    ``modeling_mimo.py`` named by ``auto_map`` (here Qwen2 underneath), so that loading it needs
    ``trust_remote_code``. ``mtp``: with its MTP layer, ``model.mtp_layers.0.*`` (a decoder layer made by
    transformers as a third layer, plus ``token_layernorm`` / ``hidden_layernorm`` / ``input_proj`` /
    ``final_layernorm``, random), which the Qwen2 model underneath ignores. Returns the path."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    make("qwen2", path, seed=seed, **({"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3} if mtp else {}))
    p = Path(path)
    cfg = json.loads((p / "config.json").read_text())
    cfg.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=int(mtp),
               num_hidden_layers=2, layer_types=["full_attention"] * 2,
               auto_map={"AutoConfig": "configuration_mimo.MiMoConfig",
                         "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"})
    if mtp:
        f = p / "model.safetensors"
        tensors = load_file(str(f))
        tensors = {k.replace("model.layers.2.", "model.mtp_layers.0."): v for k, v in tensors.items()}
        gen = torch.Generator().manual_seed(seed + 2)
        h = cfg["hidden_size"]
        for name in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
            tensors[f"model.mtp_layers.0.{name}.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
        tensors["model.mtp_layers.0.input_proj.weight"] = torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5
        save_file(tensors, str(f), metadata={"format": "pt"})
    (p / "config.json").write_text(json.dumps(cfg, indent=1))
    (p / "configuration_mimo.py").write_text(_MIMO_CONFIG)
    (p / "modeling_mimo.py").write_text(_MIMO_MODEL)
    return path


@torch.no_grad()
def deepseek_v3_with_mtp(path, seed: int = 0):
    """A tiny DeepSeek-V3 laid out as published with its MTP layer: ``num_nextn_predict_layers`` 1, the MTP
    layer's tensors under ``model.layers.{num_hidden_layers}.*`` (a decoder layer's, made by transformers as a
    third layer, plus its ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.norm``, random). transformers
    itself ignores that layer (its DeepSeek-V3 has no MTP): its log-probs are the two-layer model's."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    make("deepseek_v3", path, seed=seed, num_hidden_layers=3)
    p = Path(path)
    cfg = json.loads((p / "config.json").read_text())
    cfg.update(num_hidden_layers=2, num_nextn_predict_layers=1)
    (p / "config.json").write_text(json.dumps(cfg, indent=1))
    f = p / "model.safetensors"
    tensors = load_file(str(f))
    gen = torch.Generator().manual_seed(seed + 2)
    h = cfg["hidden_size"]
    extra = {"enorm.weight": 1 + 0.1 * torch.randn(h, generator=gen), "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
             "eh_proj.weight": torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5,
             "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=gen)}
    for name, t in extra.items():
        tensors[f"model.layers.2.{name}"] = t.float()
    save_file(tensors, str(f), metadata={"format": "pt"})
    return path
