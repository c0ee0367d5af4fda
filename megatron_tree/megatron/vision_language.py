"""`TreeVisionLanguageModel`: a vision encoder and a tree language model, each image occurrence encoded
once per microbatch.

A vision-language record holds each image as a run of placeholder tokens (`tree.images`). Per record,
a Qwen-VL style model embeds the tokens, replaces the placeholder rows with the vision encoder's
output for the record's images, and runs the language model with multimodal RoPE positions. On a
tree the same happens once per distinct occurrence: the microbatch's `ImageSlots` (its own rows'
distinct placeholder runs, with their pixels) go through the encoder, and each slot's output rows are
scattered into the rows the slot names. A screenshot shared by 16 rollouts is encoded once, and its
gradient (when the encoder trains) is the sum of the 16 records' gradients, as in per-record training.

Views: under tree CP (or carry) a rank holds some rows only (``packed_seq_params.local_rows``); it
encodes the images that have rows there and scatters those rows (the encoder's output of an image is
the same on every rank). Under sequence parallelism the language model's embedding does not scatter
(``scatter_embedding_sequence_parallel=False``): the images go into the whole local sequence, then
it is scattered, as Megatron's LLaVA does. Pipeline parallelism: the encoder lives on the first stage.

The encoder is any module ``encoder(pixel_values [P, D], grid_thw [I, 3]) -> [sum_i tokens_i, hidden]``
with the image's tokens in placeholder order (an HF Qwen-VL vision tower's merged output), or a tuple
``(that tensor, deepstack)``: Qwen3-VL's DeepStack features, a list of K tensors of the same shape that the
language model adds to the image rows' hidden states after its first K layers (forward hooks on those
layers read them from ``packed_seq_params.deepstack``, so a recomputation or a later 1F1B backward of this
microbatch reads this microbatch's).
"""
from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import torch
from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule

__all__ = ["TreeVisionLanguageModel", "scatter_image_rows", "PatchMergeEncoder"]


def scatter_image_rows(embeddings: torch.Tensor, psp, encoder) -> tuple[torch.Tensor, list]:
    """``(embeddings, deepstack)``: ``embeddings`` [n, 1, h] of this rank's rows with every image row it holds
    replaced by the encoder's output (`tree.images.ImageSlots` in ``psp.images``; rows local, ``psp.local_index``),
    and the encoder's DeepStack features placed the same way in zeros ([n, 1, h] each; [] for an encoder without)."""
    slots = getattr(psp, "images", None)
    if slots is None or slots.num_images == 0:
        return embeddings, []
    if slots.pixel_values is None:
        raise ValueError("the microbatch's image slots carry no pixels: attach them with "
                         "megatron_tree.data.images.VisionInput.attach(mb) before the forward")
    dev = embeddings.device
    starts = torch.as_tensor(slots.rows, device=dev)
    lengths, offsets = slots.lengths, slots.offsets
    # which entries have rows on this rank: encode only those
    rows_of = [torch.arange(int(r), int(r) + int(n), device=dev) for r, n in zip(starts.tolist(), lengths.tolist())]
    held = [psp.local_index(r) for r in rows_of]
    need = [e for e, (keep, _) in enumerate(held) if bool(keep.any())]
    if not need:
        return embeddings, []
    patches = np.array([int(np.prod(r.grid)) for r in slots.refs], np.int64)
    p_off = np.concatenate([[0], np.cumsum(patches)])
    pix = torch.cat([slots.pixel_values[p_off[e]: p_off[e + 1]] for e in need])
    out = encoder(pix, slots.grid_thw[need])
    out, deep = (out[0], list(out[1] or [])) if isinstance(out, tuple) else (out, [])
    tok = slots.tokens_per_image[need]
    if out.shape[0] != int(tok.sum()):
        raise ValueError(f"the vision encoder gave {out.shape[0]} rows for {len(need)} images holding {int(tok.sum())} "
                         "placeholder tokens: its merge size must match the records' (the processor's)")
    t_off = np.concatenate([[0], np.cumsum(tok)])
    idx, take = [], []
    for j, e in enumerate(need):
        keep, local = held[e]
        first = t_off[j] + int(offsets[e])
        idx.append(local)
        take.append(torch.arange(first, first + int(lengths[e]), device=dev)[keep])
    idx, take = torch.cat(idx), torch.cat(take)
    flat = embeddings[:, 0].index_put((idx,), out[take].to(embeddings.dtype))  # out of place: a replaced row's
    # text embedding gets no gradient
    zeros = embeddings.new_zeros(embeddings.shape[0], embeddings.shape[2])
    return flat.unsqueeze(1), [zeros.index_put((idx,), d[take].to(embeddings.dtype)).unsqueeze(1) for d in deep]


def _add_deepstack(k: int, module, args, kwargs, output):
    """Forward hook of language-model layer ``k``: its output plus the k-th DeepStack feature rows."""
    psp = kwargs.get("packed_seq_params")
    deep = getattr(psp, "deepstack", None)
    if not deep or k >= len(deep):
        return output
    hidden = output[0] if isinstance(output, tuple) else output
    hidden = hidden + deep[k].to(hidden.dtype)
    return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden


class TreeVisionLanguageModel(MegatronModule):
    """``vision_model`` + ``language_model`` (a `TreeGPTModel` / `TreeMambaModel` with ``mrope`` positions,
    built with ``scatter_embedding_sequence_parallel=False`` under sequence parallelism) on tree microbatches.

    ``forward(input_ids, position_ids, attention_mask, packed_seq_params=psp)`` as the language model's:
    the first stage embeds the tokens, scatters the encoded images (`scatter_image_rows`), and hands the
    result to the language model as ``decoder_input``; every stage gives it the rows' multimodal positions.
    ``freeze_vision``: the encoder runs without grad (its parameters get none)."""

    def __init__(self, config, language_model, vision_model=None, *, freeze_vision: bool = False,
                 deepstack_layers: int = 0):
        super().__init__(config=config)
        self.language_model = language_model
        self.model_type = language_model.model_type
        self.pre_process = language_model.pre_process
        self.post_process = language_model.post_process
        self.vision_model = vision_model if self.pre_process else None
        self.freeze_vision = freeze_vision
        self.share_embeddings_and_output_weights = getattr(language_model, "share_embeddings_and_output_weights",
                                                           False)
        if self.vision_model is not None and freeze_vision:
            for p in self.vision_model.parameters():
                p.requires_grad_(False)
        if deepstack_layers and self.pre_process:  # DeepStack: added after each of the first K layers (this stage's)
            layers = language_model.decoder.layers
            if deepstack_layers > len(layers):
                raise ValueError(f"{deepstack_layers} DeepStack layers but {len(layers)} language-model layers on the "
                                 "first pipeline stage: they must all be there")
            for k in range(deepstack_layers):
                layers[k].register_forward_hook(partial(_add_deepstack, k), with_kwargs=True)
        emb = getattr(language_model, "embedding", None)
        if config.sequence_parallel and emb is not None and getattr(emb, "scatter_to_sequence_parallel", False):
            raise ValueError("TreeVisionLanguageModel under sequence parallelism needs the language model built with "
                             "scatter_embedding_sequence_parallel=False: images go into the whole local sequence, "
                             "which is scattered after")

    # what the forward step, carry and CP read from "the model" (`model.unwrap_model`) are the language model's
    decoder = property(lambda self: self.language_model.decoder)
    pg_collection = property(lambda self: getattr(self.language_model, "pg_collection", None))
    gdn_islands = property(lambda self: getattr(self.language_model, "gdn_islands", False))
    gdn_island_spans = property(lambda self: getattr(self.language_model, "gdn_island_spans", None))
    gdn_island_geometry = property(lambda self: getattr(self.language_model, "gdn_island_geometry", None))
    _tree_routing_replay = property(lambda self: getattr(self.language_model, "_tree_routing_replay", None))
    _tree_moe_balancing = property(lambda self: getattr(self.language_model, "_tree_moe_balancing", None))
    _tree_moe_mtp_layers = property(lambda self: getattr(self.language_model, "_tree_moe_mtp_layers", None))

    def freeze(self, freeze_language_model: bool = False, freeze_vision_model: bool = False,
               freeze_vision_projection: bool = False) -> None:
        """Megatron-Bridge's ``Qwen3VLModel.freeze``: parameters of the language model, of the vision tower (its
        projection, the patch mergers, stays trainable unless ``freeze_vision_projection``) or of the projection
        alone made non-trainable. An encoder with nothing left to train runs without autograd."""
        vision = self.vision_model
        projection = [m for name, m in (vision.named_modules() if vision is not None else ())
                      if name.split(".")[-1] in ("merger", "deepstack_merger_list")]
        frozen = ([self.language_model] if freeze_language_model else []) + (
            [vision] if freeze_vision_model and vision is not None else []) + (
            projection if freeze_vision_projection else [])
        for module in frozen:
            for p in module.parameters():
                p.requires_grad_(False)
        if freeze_vision_model and not freeze_vision_projection:
            for module in projection:
                for p in module.parameters():
                    p.requires_grad_(True)
        self.freeze_vision = vision is not None and not any(p.requires_grad for p in vision.parameters())

    def _encode(self, pixel_values, grid_thw):
        if self.freeze_vision:  # the text rows keep their graph: only the encoder runs without one
            with torch.no_grad():
                return self.vision_model(pixel_values, grid_thw)
        return self.vision_model(pixel_values, grid_thw)

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self):
        return self.language_model.shared_embedding_or_output_weight()

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                packed_seq_params=None, **kwargs):
        psp = packed_seq_params
        if self.pre_process and decoder_input is None:
            emb = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [n, 1, h]
            deep = []
            if self.vision_model is not None:
                emb, deep = scatter_image_rows(emb, psp, self._encode)
            if self.config.sequence_parallel:
                emb = scatter_to_sequence_parallel_region(emb)
                deep = [scatter_to_sequence_parallel_region(d) for d in deep]
            decoder_input = emb
            if deep:
                psp = dataclasses.replace(psp, deepstack=deep)
        return self.language_model(input_ids, position_ids, attention_mask, decoder_input=decoder_input,
                                   labels=labels, packed_seq_params=psp, **kwargs)


class PatchMergeEncoder(MegatronModule):
    """A small vision encoder with a Qwen-VL tower's interface, for `verify` and the demos (a real model
    brings its checkpoint's tower): a patch MLP, then each ``merge x merge`` block of consecutive patches
    (Qwen's processor orders them so) merged into one token. ``(pixel_values [P, patch_dim], grid_thw) ->
    [P / merge**2, hidden]``. Replicated on every TP rank (its parameters are not sharded)."""

    def __init__(self, config, patch_dim: int, merge: int = 2):
        super().__init__(config=config)
        h, dt = config.hidden_size, config.params_dtype
        self.merge = merge
        self.patch = torch.nn.Linear(patch_dim, 2 * h, dtype=dt)
        self.merger = torch.nn.Linear(merge * merge * 2 * h, h, dtype=dt)

    def forward(self, pixel_values, grid_thw):
        x = torch.nn.functional.gelu(self.patch(pixel_values.to(self.patch.weight.dtype)))
        return self.merger(x.reshape(-1, self.merge * self.merge * x.shape[-1]))
