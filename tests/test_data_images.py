"""Vision-language records through the readers (`megatron_tree.data.images`): images read by path
(JSONL) or bytes (Parquet), keyed by decoded content, matched with placeholder runs; bad input named
with file:line before anything runs. The processor here is a test double with the HF image
processor's call signature (tests/vlm_parts.py; the real one, from a checkpoint directory, runs in
test_vlm_hf.py)."""
from __future__ import annotations

import json

import numpy as np
import torch
import pytest

from megatron_tree.data.images import VisionInput, content_key
from megatron_tree.data.io import DataError, read_jsonl, write_jsonl
from megatron_tree.data.parquet import read_parquet, write_parquet
from megatron_tree.tree import pack
from megatron_tree.tree.images import image_stats

PIL = pytest.importorskip("PIL.Image")

from vlm_parts import IMG, MERGE, PATCH, VE, VID, VS, PatchProcessor  # noqa: E402  tests/vlm_parts.py


def _png(path, seed, size=(16, 8)):
    rng = np.random.default_rng(seed)
    PIL.fromarray((rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)).save(path)
    return path


def _expand(parts):
    """Text ints and image sizes (w, h) -> tokens with each image's placeholders, as a processor expands them."""
    toks = []
    for p in parts:
        if isinstance(p, tuple):
            w, h = p
            toks += [VS] + [IMG] * ((w // PATCH) * (h // PATCH) // MERGE ** 2) + [VE]
        else:
            toks.append(p)
    return toks


@pytest.fixture
def shots(tmp_path):
    d = tmp_path / "shots"
    d.mkdir()
    a = _png(d / "a.png", 0)
    _png(d / "a_again.png", 0)  # the same pixels in another file: one image
    b = _png(d / "b.png", 1)
    return tmp_path, a, b


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_records_with_images_share_by_content(shots):
    root, a, b = shots
    prompt = _expand([1, 2, (16, 8), 3])
    recs = [{"tokens": prompt + [10, 11], "images": ["shots/a.png"]},
            {"tokens": prompt + [10, 12], "images": ["shots/a_again.png"]},  # same content, other file
            {"tokens": prompt + [10, 11], "images": ["shots/b.png"]},  # identical tokens, other screenshot
            {"tokens": _expand([1, 2, (16, 8), 3, 4, (16, 8), 5]), "images": [str(a), "shots/b.png"]}]
    f = _write(root / "data.jsonl", recs)
    proc = PatchProcessor()
    vis = VisionInput(image_token_id=IMG, merge=MERGE, processor=proc)
    samples = read_jsonl(f, vision=vis)
    assert proc.calls == vis.num_images == 2  # two contents among five image references
    assert samples[0].images[0].key == samples[1].images[0].key == content_key(PIL.open(a).convert("RGB"))
    assert samples[0].images[0].key != samples[2].images[0].key
    assert samples[3].images[1].start == len(prompt) + 1 + 1 and samples[3].images[1].length == 2
    (mb,) = pack(samples, 256)
    # records 0, 1, 3 share 1 2 VS I I VE 3 (7 rows); record 2 shares 1 2 VS only
    L = len(prompt)
    assert mb.stats.tree_tokens == 3 + (L - 3) + 2 + 1 + (L + 2 - 3) + (len(recs[3]["tokens"]) - L)
    st = image_stats([mb], samples)
    assert (st["images_flat"], st["images_tree"], st["distinct_images"]) == (5, 3, 2)
    pv, grid = vis.pixels([samples[0].images[0].key, samples[2].images[0].key])
    assert grid.tolist() == [[1, 2, 4], [1, 2, 4]] and pv.shape == (16, 2 * 3 * PATCH * PATCH)
    # Parquet: the same records with the images as bytes give the same samples
    write_parquet(samples, root / "data.parquet")
    again = read_parquet(root / "data.parquet", vision=VisionInput(image_token_id=IMG, merge=MERGE,
                                                                   processor=PatchProcessor()))
    assert [[im.key for im in s.images] for s in again] == [[im.key for im in s.images] for s in samples]
    assert [[(im.start, im.length, im.grid) for im in s.images] for s in again] == \
           [[(im.start, im.length, im.grid) for im in s.images] for s in samples]
    # JSONL written back names the files
    write_jsonl(samples, root / "out.jsonl")
    back = read_jsonl(root / "out.jsonl", vision=VisionInput(image_token_id=IMG, merge=MERGE, processor=PatchProcessor()))
    assert [[im.key for im in s.images] for s in back] == [[im.key for im in s.images] for s in samples]


@pytest.mark.parametrize("rec,match", [
    ({"tokens": _expand([1, (16, 8)]), "images": ["shots/missing.png"]}, r"data.jsonl:2: images\[0\]: cannot read"),
    ({"tokens": _expand([1, (16, 8)]), "images": ["shots/garbage.png"]}, r"data.jsonl:2: images\[0\] .*not a decodable"),
    ({"tokens": _expand([1, (16, 8), 2, (16, 8)]), "images": ["shots/a.png"]},
     r"data.jsonl:2: 1 image\(s\) but 2 run\(s\) of image placeholder token 7"),
    ({"tokens": _expand([1, (16, 16)]), "images": ["shots/a.png"]}, r"data.jsonl:2: image 0 .* has 4"),
    ({"tokens": _expand([1, (16, 8)]) + [VID], "images": ["shots/a.png"]}, r"data.jsonl:2: holds video placeholder"),
    ({"tokens": _expand([1, (16, 8)]), "images": "shots/a.png"}, r"data.jsonl:2: images must be a list"),
    ({"tokens": _expand([1, (16, 8)]), "images": ["shots/tiny.png"]}, r"data.jsonl:2: images\[0\] .*processor refused"),
])
def test_bad_image_records_are_named(shots, rec, match):
    root, a, b = shots
    (root / "shots" / "garbage.png").write_bytes(b"\x89PNG not really")
    _png(root / "shots" / "tiny.png", 2, size=(4, 4))
    good = {"tokens": _expand([1, (16, 8)]), "images": ["shots/a.png"]}
    f = _write(root / "data.jsonl", [good, rec])
    vis = VisionInput(image_token_id=IMG, merge=MERGE, processor=PatchProcessor(), video_token_id=VID)
    with pytest.raises(DataError, match=match):
        read_jsonl(f, vision=vis)
    # skip policy: the bad record is recorded, the good one kept
    from megatron_tree.data.io import ReadReport

    rep = ReadReport()
    kept = read_jsonl(f, vision=vis, bad_sample="skip", report=rep)
    assert len(kept) == 1 and rep.skipped[0][0].endswith("data.jsonl:2")


def test_images_without_a_vision_model_are_refused(shots):
    root, a, b = shots
    f = _write(root / "data.jsonl", [{"tokens": _expand([1, (16, 8)]), "images": ["shots/a.png"]}])
    with pytest.raises(DataError, match="data.jsonl:1: has images, but no vision-language model"):
        read_jsonl(f)
    # placeholders without images are refused under a vision model
    g = _write(root / "text.jsonl", [{"tokens": _expand([1, (16, 8)])}])
    with pytest.raises(DataError, match=r"text.jsonl:1: 0 image\(s\) but 1 run"):
        read_jsonl(g, vision=VisionInput(image_token_id=IMG, merge=MERGE, processor=PatchProcessor()))


def test_pixel_table_holds_sources_not_pixels(shots):
    """The table that travels to the ranks keeps each image's grid and path (or bytes), and a step's pixels are
    processed again from them (equal to the processor's own output); a file changed since its records were read is
    an error, never other pixels under the old key."""
    import pickle

    root, a, b = shots
    f = _write(root / "data.jsonl", [{"tokens": _expand([1, (16, 8), 2, (16, 8)]), "images": ["shots/a.png",
                                                                                          "shots/b.png"]}])
    vis = VisionInput(image_token_id=IMG, merge=MERGE, processor=PatchProcessor(), cache_images=1)
    (s,) = read_jsonl(f, vision=vis)
    keys = [im.key for im in s.images]
    assert all(entry[1] is None for entry in vis._store.values())  # no pixels kept, only grid and source
    want = torch.cat([PatchProcessor()(images=[PIL.open(p).convert("RGB")])["pixel_values"] for p in (a, b)])
    again = pickle.loads(pickle.dumps(vis))  # as args carry it to spawned ranks
    for table in (vis, again):
        pv, grid = table.pixels(keys)
        assert torch.equal(pv, want) and grid.tolist() == [[1, 2, 4], [1, 2, 4]]
    _png(a, 9)  # the file changes under the table (its pixels left the one-image cache when b's came in)
    with pytest.raises(ValueError, match="changed after its records were read"):
        again.pixels(keys[:1])
