"""Images of vision-language records: decoding, content keys, the checkpoint's image processor, and the
one table of pixel values a step's encoder reads.

A record names its images (JSONL: paths, absolute or relative to the file; Parquet: encoded bytes);
`VisionInput.refs` decodes each, keys it by content (`content_key`: the decoded pixels, so the same
screenshot saved twice is one image), runs the processor once per distinct content to learn its grid,
and matches the images with the record's placeholder runs (`tree.images.image_refs`). The `ImageRef`s go
on the `Sample`. The table here keeps, per content key, the grid and where the image is (its path, or its
encoded bytes), not its pixels: `VisionInput.pixels` decodes and processes the step's images again when a
microbatch needs them (`attach`, on the data pipeline's lookahead thread; the last few are cached), so the
table that travels to every rank stays the size of the encoded images. Images handed over as processed
pixels (`put`: a rollout engine's) are kept as they are. Every failure names the record (``file:line``)
and the image (``images[k]``) before any rank starts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from ..tree.images import ImageRef, image_refs

__all__ = ["content_key", "VisionInput", "decode_image"]


def decode_image(data: bytes, what: str):
    """The RGB `PIL.Image` of encoded image bytes; ValueError naming ``what`` when they do not decode."""
    from PIL import Image, UnidentifiedImageError

    try:
        im = Image.open(io.BytesIO(data))
        im.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"{what}: not a decodable image ({type(e).__name__}: {e})") from None
    return im.convert("RGB")


def content_key(image) -> bytes:
    """16-byte BLAKE2b digest of a decoded RGB image (size and pixels): equal iff the pixels are."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"RGB{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.digest()


@dataclass
class VisionInput:
    """What turns a record's image references into `ImageRef`s, and keeps their pixels.

    image_token_id  the placeholder token the processor expands an image into
    merge           the vision tower's spatial merge size
    processor       callable like an HF image processor: ``processor(images=[PIL.Image], return_tensors="pt")``
                    gives ``pixel_values`` [patches, C * temporal_patch * patch**2] and ``image_grid_thw`` [1, 3]
    video_token_id  refused where a record holds it (videos are not supported yet)
    """

    image_token_id: int
    merge: int
    processor: object
    video_token_id: int | None = None
    cache_images: int = 64  # processed images kept for reuse by `pixels`
    _store: dict = field(default_factory=dict, repr=False)  # key -> (grid, pixel_values or None, path or bytes)
    _recent: OrderedDict = field(default_factory=OrderedDict, repr=False)  # key -> pixel_values (LRU)
    _lock: object = field(default_factory=threading.Lock, repr=False)

    def __getstate__(self):  # (a lock does not pickle: args carry this table to spawned ranks)
        state = dict(self.__dict__)
        state.pop("_lock", None)
        state["_recent"] = OrderedDict()
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @classmethod
    def from_hf(cls, hf_dir) -> "VisionInput":
        """From a Hugging Face VLM checkpoint directory: its config's image / video token ids and merge size,
        and its own image processor (``AutoImageProcessor``; the PIL backend where torchvision is absent)."""
        from transformers import AutoConfig
        from transformers.models.auto.image_processing_auto import AutoImageProcessor

        cfg = AutoConfig.from_pretrained(hf_dir)
        image_token_id = getattr(cfg, "image_token_id", None)
        vision = getattr(cfg, "vision_config", None)
        if image_token_id is None or vision is None:
            raise ValueError(f"{hf_dir}: config {type(cfg).__name__} has no image_token_id / vision_config: records "
                             "with images need a vision-language checkpoint")
        try:
            proc = AutoImageProcessor.from_pretrained(hf_dir)
        except ImportError:  # the torchvision backend is the default; the PIL one needs nothing more
            proc = AutoImageProcessor.from_pretrained(hf_dir, backend="pil")
        merge = int(getattr(vision, "spatial_merge_size", getattr(proc, "merge_size", 2)))
        if int(getattr(proc, "merge_size", merge)) != merge:
            raise ValueError(f"{hf_dir}: the image processor merges {proc.merge_size} patches per side, the vision "
                             f"config {merge}: tokens would not match the encoder's output")
        return cls(image_token_id=int(image_token_id), merge=merge, processor=proc,
                   video_token_id=getattr(cfg, "video_token_id", None))

    def add(self, image, what: str, source=None) -> tuple[bytes, tuple]:
        """``(key, grid)`` of a decoded image, processed once per distinct content (its grid kept, and ``source``,
        its path or encoded bytes, to process it again when a step needs its pixels)."""
        key = content_key(image)
        if key not in self._store:
            pv, grid = self._process(image, what)
            self._store[key] = (grid, None, source)
            self._remember(key, pv)
        return key, self._store[key][0]

    def _process(self, image, what: str):
        try:
            out = self.processor(images=[image], return_tensors="pt")
        except Exception as e:  # the processor's own refusal (e.g. an image too small to patch)
            raise ValueError(f"{what}: the image processor refused it ({type(e).__name__}: {e})") from None
        grid = tuple(int(x) for x in torch.as_tensor(out["image_grid_thw"]).reshape(-1, 3)[0].tolist())
        return torch.as_tensor(out["pixel_values"]), grid

    def _remember(self, key: bytes, pv) -> None:
        with self._lock:
            self._recent[key] = pv
            self._recent.move_to_end(key)
            while len(self._recent) > self.cache_images:
                self._recent.popitem(last=False)

    def put(self, pixel_values: torch.Tensor, grid_thw) -> tuple[bytes, tuple]:
        """``(key, grid)`` of an image given as processed pixels (``pixel_values`` [t * h * w, D] and its
        ``(t, h, w)``, as a rollout engine that ran the processor holds them): keyed by those pixels."""
        grid = tuple(int(x) for x in torch.as_tensor(grid_thw).reshape(-1)[:3].tolist())
        pv = torch.as_tensor(pixel_values)
        if pv.ndim != 2 or pv.shape[0] != int(np.prod(grid)):
            raise ValueError(f"pixel_values of shape {tuple(pv.shape)} do not hold the {int(np.prod(grid))} patches of "
                             f"grid (t, h, w) = {grid}")
        h = hashlib.blake2b(digest_size=16)
        h.update(f"PIX{grid}{pv.dtype}{tuple(pv.shape)}:".encode())
        h.update(pv.detach().cpu().contiguous().numpy().tobytes())
        key = h.digest()
        self._store.setdefault(key, (grid, pv, None))
        return key, grid

    def refs(self, where: str, tokens: np.ndarray, images, base_dir: str | None) -> list[ImageRef]:
        """The `ImageRef`s of one record. ``images``: a list of paths (str; relative ones from ``base_dir``),
        encoded bytes, or ``(pixel_values, grid_thw)`` pairs already processed (`put`), in order of appearance."""
        if not isinstance(images, (list, tuple)):
            raise ValueError(f"{where}: images must be a list of image paths (or encoded bytes), got "
                             f"{type(images).__name__}")
        if self.video_token_id is not None and bool((np.asarray(tokens) == self.video_token_id).any()):
            raise ValueError(f"{where}: holds video placeholder token {self.video_token_id}: videos are not "
                             "supported (images only)")
        keys, grids, sources = [], [], []
        for k, ref in enumerate(images):
            what = f"{where}: images[{k}]"
            if isinstance(ref, tuple) and len(ref) == 2:
                key, grid = self.put(*ref)
                keys.append(key)
                grids.append(grid)
                sources.append(f"{where} images[{k}]")
                continue
            if isinstance(ref, str):
                path = ref if os.path.isabs(ref) or base_dir is None else os.path.join(base_dir, ref)
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                except OSError as e:
                    raise ValueError(f"{what}: cannot read {path!r} ({e.strerror or e})") from None
                source = path
            elif isinstance(ref, (bytes, bytearray, memoryview)):
                data, source = bytes(ref), f"{where} images[{k}]"
            else:
                raise ValueError(f"{what}: must be a path (string), encoded image bytes or a (pixel_values, grid_thw) "
                                 f"pair, got {type(ref).__name__}")
            key, grid = self.add(decode_image(data, f"{what} ({source})"), f"{what} ({source})",
                                 source=path if isinstance(ref, str) else data)
            keys.append(key)
            grids.append(grid)
            sources.append(source)
        return image_refs(where, np.asarray(tokens), self.image_token_id, keys, grids, self.merge, sources)

    def pixels(self, keys) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values [sum patches, D], grid_thw [n, 3])`` of the images ``keys``, concatenated in order
        (what an HF vision tower takes for n images)."""
        keys = [bytes(k) for k in keys]
        if not keys:
            return torch.zeros(0), torch.zeros(0, 3, dtype=torch.int64)
        return torch.cat([self._pixels_of(k) for k in keys]), torch.tensor([self._store[k][0] for k in keys],
                                                                             dtype=torch.int64)

    def _pixels_of(self, key: bytes) -> torch.Tensor:
        grid, pv, source = self._store[key]
        if pv is not None:
            return pv
        with self._lock:
            hit = self._recent.get(key)
            if hit is not None:
                self._recent.move_to_end(key)
                return hit
        if isinstance(source, str):
            with open(source, "rb") as f:
                data = f.read()
        else:
            data = source
        image = decode_image(data, str(source if isinstance(source, str) else "an image"))
        if content_key(image) != key:  # the file was changed after the records were read
            raise ValueError(f"image {source!r} changed after its records were read (its pixels no longer match)")
        pv, _ = self._process(image, str(source))
        self._remember(key, pv)
        return pv

    def attach(self, mb):
        """``mb`` with the pixels of its image slots (`tree.images.ImageSlots.pixel_values` / ``grid_thw``):
        what the model's vision encoder runs on for this microbatch."""
        slots = getattr(mb, "image_slots", None)
        if slots is None:
            return mb
        pv, grid = self.pixels([r.key for r in slots.refs])
        return dataclasses.replace(mb, image_slots=dataclasses.replace(slots, pixel_values=pv, grid_thw=grid))

    @property
    def num_images(self) -> int:
        """Distinct image contents read so far."""
        return len(self._store)
