"""Test doubles for vision-language records: a processor with the HF image processor's call signature and a
tiny patch encoder with an HF Qwen-VL vision tower's signature (the real ones come from a checkpoint)."""
from __future__ import annotations

import io

import numpy as np
import torch

IMG, VS, VE, VID = 7, 5, 6, 9
PATCH, MERGE = 4, 2


class PatchProcessor:
    """``(images=[PIL], return_tensors="pt")`` -> ``pixel_values`` [h * w, 2 * 3 * PATCH**2] (temporal patch 2,
    as Qwen's: the frame twice) and ``image_grid_thw`` [[1, h, w]] with h, w = H / PATCH, W / PATCH; patches
    ordered so that each MERGE x MERGE block is consecutive (as Qwen's processor orders them). Counts calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, images, return_tensors="pt"):
        self.calls += 1
        (im,) = images
        a = np.asarray(im, np.float64) / 255.0
        H, W = a.shape[0] // PATCH, a.shape[1] // PATCH
        if H < MERGE or W < MERGE or H % MERGE or W % MERGE:
            raise ValueError(f"image {im.size} does not patch into {MERGE} x {MERGE} blocks of {PATCH}-pixel patches")
        p = a[: H * PATCH, : W * PATCH].reshape(H // MERGE, MERGE, PATCH, W // MERGE, MERGE, PATCH, 3)
        p = p.transpose(0, 3, 1, 4, 6, 2, 5).reshape(H * W, -1)
        return {"pixel_values": torch.from_numpy(np.concatenate([p, p], 1)), "image_grid_thw": torch.tensor([[1, H, W]])}


class PatchEncoder(torch.nn.Module):
    """``encoder(pixel_values [P, D], grid_thw [I, 3]) -> [P / MERGE**2, hidden]``: a patch MLP, then each
    MERGE x MERGE block of consecutive patches merged into one token (an HF Qwen-VL tower's output shape)."""

    def __init__(self, patch_dim: int, hidden: int, dtype=torch.float64):
        super().__init__()
        self.patch = torch.nn.Linear(patch_dim, 2 * hidden, dtype=dtype)
        self.merge = torch.nn.Linear(MERGE * MERGE * 2 * hidden, hidden, dtype=dtype)
        self.calls = []

    def forward(self, pixel_values, grid_thw):
        self.calls.append(int(grid_thw.shape[0]))
        h = torch.nn.functional.gelu(self.patch(pixel_values.to(self.patch.weight.dtype)))
        return self.merge(h.reshape(-1, MERGE * MERGE * h.shape[-1]))


def png_bytes(seed: int, w: int, h: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def expand(parts) -> list:
    """Text ints and images ``(seed, w, h)`` -> tokens with each image's placeholders, as a processor expands
    them (vision start, (w / PATCH) * (h / PATCH) / MERGE**2 placeholders, vision end)."""
    toks = []
    for p in parts:
        if isinstance(p, tuple):
            _, w, h = p
            toks += [VS] + [IMG] * ((w // PATCH) * (h // PATCH) // MERGE ** 2) + [VE]
        else:
            toks.append(p)
    return toks


def vlm_samples(vision, seed: int = 0):
    """A forest of image records: a screenshot in a prompt shared by a group, branch screenshots (one shared by
    two branches behind different text), two screenshots behind identical text, a text-only record."""
    from megatron_tree.data.io import sample_from_record

    rng = np.random.default_rng(seed)
    text = lambda n: [int(x) for x in rng.integers(10, 40, n)]
    recs = []
    prompt = [1, 2, (100, 16, 16), 3]
    for r in range(4):
        branch = (200 + (r % 3 == 0), 16, 24)
        recs.append(prompt + text(2) + [branch] + text(3))
    recs += [[1, 2, (101, 16, 16), 3, 11], [1, 2, (102, 16, 16), 3, 11], [1, 41, 42, 43]]
    out = []
    for k, parts in enumerate(recs):
        images = [png_bytes(*p) for p in parts if isinstance(p, tuple)]
        out.append(sample_from_record({"tokens": expand(parts), "images": images}, f"record {k}", vision=vision))
    return out
