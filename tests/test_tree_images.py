"""Images on a tree (`megatron_tree.tree.images`): prefix identity covers image content, multimodal
RoPE positions by path, and each distinct image occurrence encoded once. Oracles: hand-computed
positions, and per-record sets of prefixes (a row is a distinct (tokens, images) prefix)."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from megatron_tree.tree import pack
from megatron_tree.tree.images import ImageRef, image_refs, image_stats, mrope_positions, placeholder_runs
from megatron_tree.tree.sample import Sample

IMG, VS, VE = 7, 5, 6  # image placeholder, vision start, vision end
MERGE = 2


def key(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


def record(parts, where="rec") -> Sample:
    """``parts``: ints (text tokens) and ``(name, (t, h, w))`` images, expanded as the processor does:
    vision start, t*h*w/merge**2 placeholders, vision end."""
    toks, keys, grids = [], [], []
    for p in parts:
        if isinstance(p, tuple):
            name, grid = p
            toks += [VS] + [IMG] * (int(np.prod(grid)) // MERGE ** 2) + [VE]
            keys.append(key(name))
            grids.append(grid)
        else:
            toks.append(p)
    toks = np.array(toks, np.int64)
    return Sample(tokens=toks, images=image_refs(where, toks, IMG, keys, grids, MERGE, sources=[k.hex() for k in keys]))


def test_mrope_positions_by_hand():
    s = record([10, 11, ("a", (1, 4, 4)), 12])  # tokens: 10 11 VS I I I I VE 12
    pos = mrope_positions(len(s.tokens), s.images)
    # image at p = 3, token grid 1 x 2 x 2 (row-major); text resumes at 3 + max(2, 2) = 5
    assert pos.tolist() == [[0, 1, 2, 3, 3, 3, 3, 5, 6],
                            [0, 1, 2, 3, 3, 4, 4, 5, 6],
                            [0, 1, 2, 3, 4, 3, 4, 5, 6]]
    wide = record([("b", (1, 2, 6))])  # token grid 1 x 1 x 3: VS I I I VE
    assert mrope_positions(len(wide.tokens), wide.images).tolist() == [[0, 1, 1, 1, 4], [0, 1, 1, 1, 4],
                                                                       [0, 1, 2, 3, 4]]


def test_image_refs_name_the_record_and_rule():
    toks = np.array([1, VS, IMG, IMG, IMG, IMG, VE, 2])
    with pytest.raises(ValueError, match=r"f.jsonl:3: 2 image\(s\) but 1 run"):
        image_refs("f.jsonl:3", toks, IMG, [key("a"), key("b")], [(1, 4, 4)] * 2, MERGE)
    with pytest.raises(ValueError, match=r"f.jsonl:3: image 0 .* 16 placeholder tokens .* has 4"):
        image_refs("f.jsonl:3", toks, IMG, [key("a")], [(1, 8, 8)], MERGE)
    with pytest.raises(ValueError, match="not divisible by the spatial merge size"):
        image_refs("f.jsonl:3", toks, IMG, [key("a")], [(1, 3, 4)], MERGE)
    starts, lengths = placeholder_runs(np.array([IMG, 1, IMG, IMG, 2, IMG]), IMG)
    assert starts.tolist() == [0, 2, 5] and lengths.tolist() == [1, 2, 1]


def _forest(rng):
    """Records where images sit in shared prompts and in branches; the same screenshot behind two texts,
    two screenshots behind identical text, and text-only records beside them."""
    out = []
    for g in range(3):
        prompt = [100 + g, ("shot%d" % g, (1, 4, 4)), 101]
        for r in range(4):
            turn = [int(x) for x in rng.integers(20, 30, rng.integers(1, 4))]
            img = ("same", (1, 4, 8)) if r % 2 else ("branch%d_%d" % (g, r), (1, 4, 8))
            out.append(record(prompt + turn + [img] + [int(x) for x in rng.integers(20, 30, 3)]))
    out.append(record([100, ("x", (1, 4, 4)), 101, 40]))  # identical text to group 0, other screenshot
    out.append(record([100, ("y", (1, 4, 4)), 101, 40]))
    out.append(record([100, 41, 42]))  # text only, shares the first token
    out.append(record([100, ("x", (1, 4, 4)), 101, 40]))  # a duplicate
    return out


def _prefix_key(s: Sample, p: int):
    """The identity of row p of a record: its tokens up to p and the images those tokens hold."""
    ims = tuple(im.key for im in s.images if im.start <= p)
    return tuple(s.tokens[: p + 1].tolist()), ims


@pytest.mark.parametrize("carry,budget", [(False, 32), (False, 4096), (True, 16), (True, 48), (True, 4096)])
def test_rows_positions_and_encoder_work_on_a_forest(carry, budget):
    rng = np.random.default_rng(0)
    samples = _forest(rng)
    mbs = pack(samples, budget, carry=carry)
    if carry and budget == 16:  # the budget cuts an image's run: each owner of a slice encodes the image
        assert any(n < ref.length for mb in mbs for n, ref in zip(mb.image_slots.lengths, mb.image_slots.refs))
    # rows: every distinct (tokens, images) prefix once (carry, or one microbatch); never two images merged
    distinct = {_prefix_key(s, p) for s in samples for p in range(len(s))}
    computed = sum(mb.stats.tree_tokens for mb in mbs)
    if carry or len(mbs) == 1:
        assert computed == len(distinct)
    for mb in mbs:
        ids = mb.sample_ids if mb._path_ids is None else mb._path_ids
        for i in ids:
            rows = mb.sample_rows(i).numpy()
            s = samples[i]
            # positions by path equal the record's own (hand-checked function above)
            assert np.array_equal(mb.rope_positions[:, rows].numpy(), mrope_positions(len(s), s.images)[:, :len(rows)])
    # encoder work: every (image prefix) occurrence a microbatch owns, once; with carry, each image of the
    # forest once unless a budget cut its run (then each owner of a slice encodes it)
    slot_tokens = sum(mb.image_slots.num_tokens for mb in mbs)
    img_rows = {_prefix_key(s, p) for s in samples for im in s.images for p in range(im.start, im.start + im.length)}
    if carry or len(mbs) == 1:
        assert slot_tokens == len(img_rows)
    distinct_images = {_prefix_key(s, im.start + im.length - 1) for s in samples for im in s.images}
    st = image_stats(mbs, samples)
    assert st["images_flat"] == sum(len(s.images) for s in samples) == 27
    if len(mbs) == 1:
        assert st["images_tree"] == len(distinct_images)
    assert st["images_tree"] >= len(distinct_images) and st["image_tokens_tree"] == slot_tokens
    # slots: rows hold the image placeholder token, and every owned image row is in exactly one slot
    for mb in mbs:
        sl = mb.image_slots
        ids = mb.layout.input_ids.numpy()
        covered = np.concatenate([np.arange(r, r + n) for r, n in zip(sl.rows, sl.lengths)]) if sl.num_images else []
        assert len(set(np.asarray(covered).tolist())) == len(covered)
        own = np.ones(mb.layout.num_rows, bool)
        if mb.carry is not None:
            own[mb.carry.carried] = False
        assert set(np.flatnonzero((ids == IMG) & own).tolist()) == set(np.asarray(covered).tolist())
        for r, n, o, ref in zip(sl.rows, sl.lengths, sl.offsets, sl.refs):
            assert 0 <= o and o + n <= ref.length


def test_same_tokens_different_images_never_share():
    a = record([1, ("a", (1, 4, 4)), 2])
    b = record([1, ("b", (1, 4, 4)), 2])
    c = record([1, ("a", (1, 4, 4)), 3])
    (mb,) = pack([a, b, c], 64)
    # a and c share 1 VS I I I I VE (7 rows); b shares 1 VS with them (the image differs from its first token)
    assert mb.stats.tree_tokens == len(a) + (len(b) - 2) + 1
    ra, rb, rc = (mb.sample_rows(i).numpy() for i in range(3))
    assert np.array_equal(ra[:7], rc[:7]) and ra[7] != rc[7]
    assert np.array_equal(ra[:2], rb[:2]) and not set(ra[2:]) & set(rb[2:])
    assert mb.image_slots.num_images == 2


def test_images_validated_against_tokens():
    s = Sample(tokens=np.array([1, IMG, IMG, 2]), images=[ImageRef(key("a"), 2, 4, (1, 4, 4), MERGE)])
    with pytest.raises(ValueError, match=r"sample 0: images\[0\] covers tokens 2:6"):
        pack([s], 16)
