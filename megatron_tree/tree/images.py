"""Images in token sequences: what a vision-language record adds to the tree.

A VLM record's tokens hold each image as a run of placeholder tokens (the HF processor expands one
image into ``t * h * w / merge**2`` copies of the image token). Three facts follow, and this module
holds each once:

* **Prefix identity** (`image_identity`): two records may share a row only where their tokens *and*
  the images behind their placeholders so far are equal. Every position gets two extra int64
  symbols, the 128-bit content key of the image it belongs to (0, 0 on text); packing sorts and
  shares on (token, key) (`prefix.sort_and_lcp` over `routes.route_symbols`), so the trie never
  merges two screenshots behind identical placeholder tokens.
* **Multimodal RoPE** (`mrope_positions`): the 3-D ``(t, h, w)`` position of every token of a record,
  as HF's Qwen2-VL / Qwen3-VL / Qwen3.5 ``get_rope_index`` gives it to the record alone. A row's
  position depends only on its prefix (tokens and image grids), so every record through a shared row
  agrees on it (`row_rope_positions` asserts it).
* **Encoder work** (`image_slots`): the placeholder runs a microbatch's own rows hold, one entry per
  distinct occurrence in the tree: a screenshot shared by 16 rollouts is encoded once.

Pixels never enter the tree layer: an `ImageRef` names its image by content key; the data layer keeps
the pixel values (`megatron_tree.data.images`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

__all__ = ["ImageRef", "placeholder_runs", "image_refs", "image_identity", "mrope_positions",
           "row_rope_positions", "ImageSlots", "image_slots", "image_stats"]


@dataclass(frozen=True)
class ImageRef:
    """One image of a record.

    key     16-byte content digest: equal iff the decoded images are equal (`data.images.content_key`)
    start   index of its first placeholder token in the record
    length  placeholder tokens: ``t * h * w // merge**2``
    grid    ``(t, h, w)`` in vision patches, as the processor's ``image_grid_thw`` gives it
    merge   the vision tower's spatial merge size (patches per token side)
    source  where it came from (a path, or ``file:line images[k]``), for messages
    """

    key: bytes
    start: int
    length: int
    grid: tuple
    merge: int
    source: str = ""

    @property
    def key_words(self) -> tuple[int, int]:
        """The key as two signed int64 words (the symbols packing sorts on)."""
        a, b = np.frombuffer(self.key[:16].ljust(16, b"\0"), dtype="<i8")
        return int(a), int(b)

    @property
    def llm_grid(self) -> tuple[int, int, int]:
        """``(t, h / merge, w / merge)``: the image's token grid in the language model."""
        t, h, w = self.grid
        return int(t), int(h) // self.merge, int(w) // self.merge


def placeholder_runs(tokens: np.ndarray, image_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` of the maximal runs of ``image_token_id`` in ``tokens`` (vectorised)."""
    is_img = np.asarray(tokens) == image_token_id
    edge = np.diff(np.concatenate([[False], is_img, [False]]).astype(np.int8))
    starts = np.flatnonzero(edge == 1)
    return starts.astype(np.int64), (np.flatnonzero(edge == -1) - starts).astype(np.int64)


def image_refs(where: str, tokens: np.ndarray, image_token_id: int, keys: Sequence[bytes], grids: Sequence,
               merge: int, sources: Sequence[str] | None = None) -> list[ImageRef]:
    """The `ImageRef`s of one record: its placeholder runs matched, in order, with its images.

    Raises ValueError naming ``where`` when the number of placeholder runs differs from the number of
    images (two images with no token between them read as one run: the processor always separates
    them), or when a run's length is not its image's ``t * h * w // merge**2``."""
    starts, lengths = placeholder_runs(tokens, image_token_id)
    if len(starts) != len(keys):
        raise ValueError(f"{where}: {len(keys)} image(s) but {len(starts)} run(s) of image placeholder token "
                         f"{image_token_id} in tokens: each image needs its own run of placeholders, as the "
                         "processor expands them")
    out = []
    for k, (s, n, key, grid) in enumerate(zip(starts.tolist(), lengths.tolist(), keys, grids)):
        t, h, w = (int(x) for x in grid)
        if h % merge or w % merge:
            raise ValueError(f"{where}: image {k} has grid (t, h, w) = {(t, h, w)}, not divisible by the spatial "
                             f"merge size {merge}")
        want = t * h * w // (merge * merge)
        if n != want:
            raise ValueError(f"{where}: image {k} ({sources[k] if sources else 'no source'}) has grid (t, h, w) = "
                             f"{(t, h, w)}, i.e. {want} placeholder tokens at merge size {merge}, but its run at "
                             f"token {s} has {n}")
        out.append(ImageRef(key=bytes(key), start=s, length=n, grid=(t, h, w), merge=merge,
                            source=sources[k] if sources else ""))
    return out


def image_identity(length: int, images: Sequence[ImageRef] | None) -> np.ndarray:
    """``[length, 2]`` int64: the content key of the image each position belongs to, 0 on text.

    Appended to the token as sort symbols, so rows are shared only where images agree too. A key of
    (0, 0) on an image is impossible in practice (a 128-bit digest), and would only merge that image
    with text of the same token id, which the placeholder token never is."""
    out = np.zeros((length, 2), np.int64)
    for im in images or ():
        out[im.start: im.start + im.length] = im.key_words
    return out


def mrope_positions(length: int, images: Sequence[ImageRef] | None) -> np.ndarray:
    """``[3, length]`` int64 ``(t, h, w)`` RoPE positions of one record alone.

    Text continues one past the previous position on all three axes. An image starting at position
    ``p`` with token grid ``(T, H, W)`` gives its token ``(i, j, k)`` (row-major) the position
    ``(p + i, p + j, p + k)``; the text after it starts at ``p + max(H, W)``. (HF's ``get_rope_index``
    for Qwen2-VL / Qwen3-VL / Qwen3.5 images; videos are not supported.) Vectorised per image."""
    pos = np.zeros((3, length), np.int64)
    cur_idx, cur_pos = 0, 0
    for im in images or ():
        T, H, W = im.llm_grid
        n = im.length
        pos[:, cur_idx: im.start] = cur_pos + np.arange(im.start - cur_idx)
        p = cur_pos + (im.start - cur_idx)
        ii, jj, kk = np.unravel_index(np.arange(n), (T, H, W))
        pos[0, im.start: im.start + n] = p + ii
        pos[1, im.start: im.start + n] = p + jj
        pos[2, im.start: im.start + n] = p + kk
        cur_idx, cur_pos = im.start + n, p + max(H, W)
    pos[:, cur_idx:] = cur_pos + np.arange(length - cur_idx)
    return pos


def row_rope_positions(mb, samples: Sequence) -> torch.Tensor:
    """``[3, N]`` int64 multimodal RoPE position of every physical row of ``mb`` (0 on padding rows).

    Each record through a row writes the position it gives that row (`mrope_positions`; a record
    without images gives its depth on all three axes); packing shares a row only where tokens and
    images agree, so every writer agrees, which an assertion guards. Under carry the carried rows get
    theirs from the paths that reach them (``mb.sample_rows`` covers the ancestors)."""
    n = mb.layout.num_rows
    out = np.zeros((3, n), np.int64)
    ids = mb.sample_ids if mb._path_ids is None else mb._path_ids
    rows, vals = [], []
    for i in ids:
        r = mb.sample_rows(i).numpy()
        s = samples[i]
        rows.append(r)
        vals.append(mrope_positions(len(s.tokens), s.images)[:, : len(r)])
    if rows:
        r, v = np.concatenate(rows), np.concatenate(vals, 1)
        out[:, r] = v
        assert np.array_equal(out[:, r], v), "two records share a row but disagree on its multimodal position"
    return torch.from_numpy(out)


@dataclass(frozen=True)
class ImageSlots:
    """The image placeholder runs a microbatch computes, one entry per distinct occurrence.

    rows      [I] int64 first physical row of the slice this microbatch owns
    lengths   [I] int64 rows of the slice
    offsets   [I] int64 index of the slice's first token inside its image's ``length`` tokens (0 unless
              carry cut the run: each owning microbatch then encodes the image and keeps its slice)
    image     [I] int64 index into ``refs``
    refs      tuple of `ImageRef`, one per entry (``key``, ``grid`` name the pixels to encode)
    pixel_values  [sum patches, D] the entries' pixels in entry order, or None until the data layer
              attaches them (`data.images.VisionInput.attach`); ``grid_thw`` [I, 3] their grids

    Scattering the encoder output of ``refs[e]``, tokens ``offsets[e]:offsets[e]+lengths[e]``, into rows
    ``rows[e]:rows[e]+lengths[e]`` for every e fills every image row the microbatch owns exactly once."""

    rows: np.ndarray
    lengths: np.ndarray
    offsets: np.ndarray
    refs: tuple
    pixel_values: torch.Tensor | None = None
    grid_thw: torch.Tensor | None = None

    def to(self, device) -> "ImageSlots":
        move = lambda t: None if t is None else t.to(device)
        return replace(self, pixel_values=move(self.pixel_values), grid_thw=move(self.grid_thw))

    @property
    def tokens_per_image(self) -> np.ndarray:
        """[I] placeholder tokens of each entry's whole image (the encoder's output rows for it)."""
        return np.array([r.length for r in self.refs], np.int64)

    @property
    def num_images(self) -> int:
        return len(self.refs)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def num_patches(self) -> int:
        """Vision-encoder patches to run: the whole image for every entry, sliced or not."""
        return int(sum(int(np.prod(r.grid)) for r in self.refs))


def image_slots(mb, samples: Sequence) -> ImageSlots:
    """The distinct image occurrences among ``mb``'s own rows (carried rows excluded: their owner
    encodes them). Two records sharing an image's rows give one entry; a loop per image, never per
    token."""
    n = mb.layout.num_rows
    own = np.ones(n, bool)
    if mb.carry is not None:
        own[mb.carry.carried] = False
    ids = mb.sample_ids if mb._path_ids is None else mb._path_ids
    seen: dict = {}
    for i in ids:
        path = mb.sample_rows(i).numpy()
        for im in samples[i].images or ():
            if im.start >= len(path):
                break
            r = path[im.start: im.start + im.length]
            keep = np.flatnonzero(own[r])
            if not len(keep):
                continue
            a, b = int(keep[0]), int(keep[-1]) + 1
            # an image's own rows are one contiguous physical run (a segment boundary can only fall where
            # records diverge, which never happens inside an image they share up to its end)
            assert b - a == len(keep) and np.array_equal(np.diff(r[a:b]), np.ones(b - a - 1, np.int64))
            seen.setdefault(int(r[a]), (b - a, a, im))
    starts = np.array(sorted(seen), np.int64)
    vals = [seen[int(s)] for s in starts]
    return ImageSlots(rows=starts, lengths=np.array([v[0] for v in vals], np.int64),
                      offsets=np.array([v[1] for v in vals], np.int64), refs=tuple(v[2] for v in vals))


def image_stats(microbatches: Sequence, samples: Sequence) -> dict:
    """Image work of a step: per-record (every record encodes its own images) vs the tree's.

    ``images_flat`` / ``image_tokens_flat`` / ``patches_flat``: summed over records; ``images_tree`` /
    ``image_tokens_tree`` / ``patches_tree``: the encoder calls, image rows and encoder patches the
    microbatches run (`image_slots`); ``distinct_images``: different contents in the step."""
    recs = [samples[i] for mb in microbatches for i in mb.sample_ids]
    flat = [im for s in recs for im in (s.images or ())]
    slots = [mb.image_slots if getattr(mb, "image_slots", None) is not None else image_slots(mb, samples)
             for mb in microbatches]
    return dict(images_flat=len(flat), images_tree=sum(s.num_images for s in slots),
                image_tokens_flat=sum(im.length for im in flat), image_tokens_tree=sum(s.num_tokens for s in slots),
                patches_flat=sum(int(np.prod(im.grid)) for im in flat),
                patches_tree=sum(s.num_patches for s in slots), distinct_images=len({im.key for im in flat}))
