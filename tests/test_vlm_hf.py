"""Vision-language records against transformers itself: a tiny Qwen3-VL / Qwen3.5 checkpoint directory
made by transformers (config + its own image processor), read through `VisionInput.from_hf`; the
multimodal RoPE position of every tree row equals HF's ``get_rope_index`` of each record alone, on a
forest where images sit in shared prompts and in branches."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

tf = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from megatron_tree.data.images import VisionInput  # noqa: E402
from megatron_tree.data.io import read_jsonl  # noqa: E402
from megatron_tree.tree import pack  # noqa: E402

PATCH, MERGE = 16, 2


def _checkpoint(family: str, path):
    """Config and image processor of a tiny VLM (no weights: positions and images need none)."""
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=64)
    ids = dict(image_token_id=100, video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
    gdn = dict(layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4, linear_key_head_dim=8,
               linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
    if family == "qwen3_vl":
        cfg = tf.Qwen3VLConfig(text_config=text, vision_config={**vision, "deepstack_visual_indexes": [0]}, **ids)
        model_cls = tf.Qwen3VLModel
    elif family == "qwen3_5":
        cfg = tf.Qwen3_5Config(text_config={**text, **gdn}, vision_config=vision, **ids)
        model_cls = tf.Qwen3_5Model
    else:  # Qwen3.5 MoE: GDN + gated attention, every layer's MLP a routed MoE with a gated shared expert
        cfg = tf.Qwen3_5MoeConfig(text_config={**text, **gdn, "num_experts": 4, "num_experts_per_tok": 2,
                                               "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16},
                                  vision_config=vision, **ids)
        model_cls = tf.Qwen3_5MoeModel
    cfg.save_pretrained(path)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(size={"shortest_edge": 32 * 32, "longest_edge": 96 * 96}, patch_size=PATCH,
                             merge_size=MERGE, temporal_patch_size=2).save_pretrained(path)
    return cfg, model_cls


def _png(path, seed, w, h):
    rng = np.random.default_rng(seed)
    PIL.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(path)
    return str(path)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_tree_positions_equal_hf_get_rope_index(family, tmp_path):
    cfg, model_cls = _checkpoint(family, tmp_path / "ckpt")
    vis = VisionInput.from_hf(tmp_path / "ckpt")
    assert (vis.image_token_id, vis.merge, vis.video_token_id) == (100, MERGE, 101)
    shots = [_png(tmp_path / f"s{k}.png", k, w, h) for k, (w, h) in enumerate([(64, 48), (40, 90), (64, 48), (70, 33)])]
    proc = vis.processor
    n_tokens = {}
    for s in shots:
        grid = proc(images=[PIL.open(s).convert("RGB")], return_tensors="pt")["image_grid_thw"][0]
        n_tokens[s] = int(grid.prod()) // MERGE ** 2

    def expand(parts):
        toks, ims = [], []
        for p in parts:
            if isinstance(p, str):
                toks += [102] + [100] * n_tokens[p] + [103]
                ims.append(p)
            else:
                toks.append(p)
        return {"tokens": toks, "images": ims}

    rng = np.random.default_rng(0)
    text = lambda n: [int(x) for x in rng.integers(1, 90, n)]
    prompt = [1, 2, shots[0], 3, 4]
    recs = [expand(prompt + text(3) + ([shots[1]] if r % 2 else [shots[3]]) + text(4)) for r in range(4)]
    recs += [expand([1, 2, shots[2], 3, 4, 9]),  # other pixels, same size: same placeholders as the prompt
             expand([5, 6, 7]), expand([1, 2, shots[1], shots[3], 8])]
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    samples = read_jsonl(f, vision=vis)

    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    for budget, carry in ((1024, False), (24, True)):
        mbs = pack(samples, budget, carry=carry)
        for i, s in enumerate(samples):
            ids = torch.as_tensor(s.tokens)[None]
            keys = [im.key for im in s.images]
            _, grid = vis.pixels(keys)
            want, _ = model.get_rope_index(ids, mm_token_type_ids=(ids == 100).int(),
                                           image_grid_thw=grid if len(keys) else None)
            want = want[:, 0].numpy()
            seen = 0
            for mb in mbs:
                known = mb.sample_ids if mb._path_ids is None else mb._path_ids
                if i in known:
                    rows = mb.sample_rows(i).numpy()
                    np.testing.assert_array_equal(mb.rope_positions[:, rows].numpy(), want[:, :len(rows)])
                    seen = max(seen, len(rows))
            assert seen == len(s)
    # the placeholder runs match the processor's grids; the encoder runs once per distinct occurrence
    (mb,) = pack(samples, 1024)
    occurrences = {(tuple(s.tokens[: im.start + im.length].tolist()), tuple(j.key for j in s.images[: k + 1]))
                   for s in samples for k, im in enumerate(s.images)}
    assert mb.image_slots.num_images == len(occurrences) == 8  # the prompt's image once for its 4 records


def test_stats_reports_image_work(tmp_path, capsys):
    """``stats --hf-model``: images read with the checkpoint's processor; a screenshot in a prompt shared by 4
    records is encoded once."""
    import re

    from megatron_tree.cli import main

    _checkpoint("qwen3_vl", tmp_path / "ckpt")
    shot = _png(tmp_path / "shot.png", 0, 64, 48)
    vis = VisionInput.from_hf(tmp_path / "ckpt")
    grid = vis.processor(images=[PIL.open(shot).convert("RGB")], return_tensors="pt")["image_grid_thw"][0]
    n = int(grid.prod()) // MERGE ** 2
    prompt = [1, 102] + [100] * n + [103, 2]
    recs = [{"tokens": prompt + [10 + r, 11], "images": ["shot.png"]} for r in range(4)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["stats", "--data", str(tmp_path / "d.jsonl"), "--hf-model", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    p = int(grid.prod())
    assert re.search(r"images \(records / encoded / distinct\)\s+4 / 1 / 1\n", out)
    assert re.search(rf"image tokens flat / tree\s+{4 * n} / {n} \(75.0% saved\)\n", out)
    assert re.search(rf"encoder patches flat / tree\s+{4 * p} / {p} \(75.0% saved\)\n", out)


def _weights(family: str, path, cfg, model_cls):
    """A tiny random checkpoint with weights (perturbed away from the init) beside its processor."""
    torch.manual_seed(0)
    cls = {"qwen3_vl": tf.Qwen3VLForConditionalGeneration, "qwen3_5": tf.Qwen3_5ForConditionalGeneration,
           "qwen3_5_moe": tf.Qwen3_5MoeForConditionalGeneration}[family]
    full = cls(cfg)
    with torch.no_grad():
        for p in full.parameters():
            p.add_(0.05 * torch.randn_like(p))
    full.save_pretrained(path)
    # the float64 reference: eager experts (transformers' grouped-GEMM ones take no float64)
    return cls.from_pretrained(path, dtype=torch.float64, experts_implementation="eager")


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5_moe"])
def test_score_hf_model_vlm_equals_transformers_per_record(tmp_path, family):
    """``megatron-tree score --hf-model`` (CLI, float64) on tiny Qwen3-VL (ViT with DeepStack, interleaved multimodal
    RoPE) and Qwen3.5-MoE (Gated DeltaNet + gated attention + MoE) checkpoints made by transformers (dense Qwen3.5:
    the layouts test below): every record's per-target log-probs equal transformers' own forward of the record alone,
    on a
    forest where a screenshot sits in a prompt shared by three records and in their branches, the same screenshot
    behind two different texts and two different screenshots behind identical text. The images of the tree's rows
    are encoded once each (counted)."""
    import subprocess
    import sys

    import pyarrow.parquet as pq

    ckpt = tmp_path / "ckpt"
    cfg, model_cls = _checkpoint(family, ckpt)
    hf = _weights(family, ckpt, cfg, model_cls).eval()
    vis = VisionInput.from_hf(ckpt)
    shots = [_png(tmp_path / f"s{k}.png", k, w, h) for k, (w, h) in enumerate([(64, 48), (40, 90), (64, 48)])]
    n = {s: int(vis.processor(images=[PIL.open(s).convert("RGB")], return_tensors="pt")["image_grid_thw"][0].prod())
         // MERGE ** 2 for s in shots}

    def expand(parts):
        toks, ims = [], []
        for p in parts:
            if isinstance(p, str):
                toks += [102] + [100] * n[p] + [103]
                ims.append(p)
            else:
                toks.append(p)
        return {"tokens": toks, "images": ims, "loss_mask": [0] * 3 + [1] * (len(toks) - 3)}

    recs = [expand([1, 2, shots[0], 3, 4, 5 + r, 6, shots[1], 7, 8]) for r in range(3)]  # shared prompt, branches
    recs += [expand([1, 2, shots[2], 3, 4, 5]),  # other pixels behind the prompt's exact tokens
             expand([9, 9, shots[1], 10]), expand([5, 6, 7, 8])]  # the branch screenshot behind other text; text only
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "scores.parquet"
    r = subprocess.run([sys.executable, "-m", "megatron_tree", "score", "--hf-model", str(ckpt), "--data", str(data),
                        "--out", str(out), "--dtype", "float64", "--nproc", "1"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rows = pq.read_table(out).to_pylist()
    samples = read_jsonl(data, vision=vis)
    worst = 0.0
    for row, ref in zip(rows, _hf_logprobs(hf, vis, samples)):
        got = np.asarray(row["logprobs"])
        worst = max(worst, float(np.max(np.abs(got - ref) / np.maximum(1.0, np.abs(ref)))))
    print(f"\nscore --hf-model ({family}) vs transformers per record: max rel {worst:.1e}")
    # transformers' float64 models still run their RMSNorms and text rotary tables in float32 (1e-8 here)
    assert worst <= 1e-6, worst
    (mb,) = pack(samples, 1024)
    occurrences = {(tuple(s.tokens[: im.start + im.length].tolist()), tuple(j.key for j in s.images[: k + 1]))
                   for s in samples for k, im in enumerate(s.images)}
    assert mb.image_slots.num_images == len(occurrences) == 6  # of 9 image references


def _branching_traces(family: str, tmp_path, last):
    """``(checkpoint, data file, records)``: a tiny ``family`` checkpoint with weights, and three records sharing a
    prompt screenshot that branch before a second screenshot, plus ``last(img, shots) -> (tokens, images)``."""
    ckpt = tmp_path / "ckpt"
    cfg, model_cls = _checkpoint(family, ckpt)
    _weights(family, ckpt, cfg, model_cls)
    vis = VisionInput.from_hf(ckpt)
    shots = [_png(tmp_path / f"s{k}.png", k, w, h) for k, (w, h) in enumerate([(64, 48), (40, 90)])]
    n = {s: int(vis.processor(images=[PIL.open(s).convert("RGB")], return_tensors="pt")["image_grid_thw"][0].prod())
         // MERGE ** 2 for s in shots}
    img = lambda s: [102] + [100] * n[s] + [103]  # noqa: E731
    recs = [{"tokens": [1, 2] + img(shots[0]) + [3, 4 + r] + img(shots[1]) + [5, 6], "images": [shots[0], shots[1]]}
            for r in range(3)]
    toks, ims = last(img, shots)
    recs.append({"tokens": toks, "images": ims})
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return ckpt, data, recs


def test_train_hf_model_vlm_tree_step_equals_flat_step_and_reloads(tmp_path):
    """``megatron-tree train --hf-model`` (a tiny Qwen3-VL, images in a shared prompt and in branches) for one SGD step
    on prefix trees and on the same records packed flat (every record its own chain, its images encoded alone): every
    tensor's update, read back from ``--save-hf``, agrees (vision tower, DeepStack mergers and language model), and
    transformers loads the saved directory, whose log-probs moved."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    ckpt, data, recs = _branching_traces("qwen3_vl", tmp_path, last=lambda img, shots: ([1, 2] + img(shots[0]) + [7, 8],
                                                                                 [shots[0]]))

    def weights(path):
        out = {}
        for f in sorted(path.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    before = weights(ckpt)
    updates = {}
    # no gradient clipping: the frozen run's language-model update is then the trained tower's run's
    for packing, extra in (("tree", []), ("flat", []), ("frozen", ["--freeze-vision"])):
        out = tmp_path / packing
        r = subprocess.run([sys.executable, "-m", "megatron_tree", "train", "--hf-model", str(ckpt), "--tree-data-path",
                            str(data), "--tree-global-batch-samples", str(len(recs)), "--train-iters", "1", "--lr",
                            "0.05", "--optimizer", "sgd", "--nproc", "1", "--packing", "flat" if packing == "flat"
                            else "tree", "--tree-max-tokens-per-mb", "256", "--clip-grad", "0", "--save-hf", str(out), "--quiet",
                            *extra],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        after = weights(out)
        assert set(after) == set(before)
        updates[packing] = {k: after[k].double() - before[k].double() for k in before}
    rel = {k: float((updates["tree"][k] - updates["flat"][k]).abs().max() / updates["flat"][k].abs().max())
           for k in before if updates["flat"][k].abs().max() > 0}
    worst = max(rel.values())
    print(f"\ntrain --hf-model (Qwen3-VL): tree vs flat step, max rel. update difference {worst:.1e}",
          sorted(rel.items(), key=lambda kv: -kv[1])[:4])
    assert any("visual" in k for k in rel) and any("deepstack" in k for k in rel), sorted(rel)[:8]
    # float32 runs: a small update summed over many rows (a merger's norm gain) differs by ~1e-4 of itself in rounding
    # order; a tree fault (an image row shared wrongly, a slot missed) moves updates by O(1)
    assert worst <= 1e-3, worst
    tf.Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "tree")  # transformers reloads what was saved
    # --freeze-vision: the tower (and its mergers) unchanged, the language model's update the trained tower's
    frozen = updates["frozen"]
    assert all(float(frozen[k].abs().max()) == 0.0 for k in before if "visual" in k)
    lm = [k for k in before if "language_model" in k or k.startswith("lm_head")]
    assert max(float((frozen[k] - updates["tree"][k]).abs().max() / updates["tree"][k].abs().max().clamp(min=1e-30))
               for k in lm) <= 1e-5


def _hf_logprobs(hf, vis, samples) -> list:
    """transformers' per-target log-probs of each record alone (float64)."""
    out = []
    for s in samples:
        ids = torch.as_tensor(s.tokens)[None]
        kw = {}
        if s.images:
            pv, grid = vis.pixels([im.key for im in s.images])
            kw = dict(pixel_values=pv.double(), image_grid_thw=grid)
        with torch.no_grad():
            lp = torch.log_softmax(hf(input_ids=ids, mm_token_type_ids=(ids == 100).int(), **kw).logits[0], -1)
        targets = np.flatnonzero(s.target_mask())
        out.append(lp[targets - 1, torch.as_tensor(s.tokens[targets])].numpy())
    return out


def test_score_hf_model_qwen3_5_equals_transformers_on_every_layout(tmp_path):
    """``score --hf-model`` of a tiny Qwen3.5 (GDN + gated attention + vision) on one rank, under TP 2 + SP (the tower
    replicated, the images scattered into the whole sequence before SP splits it) and under CP 2 (each rank encodes
    the images holding its rows) equals transformers per record (float64), and the layouts equal one rank. (PP 2,
    the tower on the first stage, is `verify --model vlm --pp 2`'s; the Bridge model under PP 2 matched one rank
    exactly when run by hand.)"""
    import subprocess
    import sys

    import pyarrow.parquet as pq

    ckpt, data, _ = _branching_traces("qwen3_5", tmp_path, last=lambda img, shots: ([1, 2] + img(shots[1]) + [7],
                                                                                [shots[1]]))
    hf = tf.Qwen3_5ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float64).eval()
    vis = VisionInput.from_hf(ckpt)
    ref = np.concatenate(_hf_logprobs(hf, vis, read_jsonl(data, vision=vis)))
    scores = {}
    for name, layout in (("one", ["--nproc", "1"]),
                         ("tp2", ["--nproc", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                         ("cp2", ["--nproc", "2", "--context-parallel-size", "2"])):
        out = tmp_path / f"{name}.parquet"
        r = subprocess.run([sys.executable, "-m", "megatron_tree", "score", "--hf-model", str(ckpt), "--data", str(data),
                            "--out", str(out), "--dtype", "float64", "--quiet", *layout],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (name, (r.stdout + r.stderr)[-4000:])
        scores[name] = np.concatenate([row["logprobs"] for row in pq.read_table(out).to_pylist()])
        err = float(np.max(np.abs(scores[name] - ref) / np.maximum(1.0, np.abs(ref))))
        print(f"\nscore --hf-model (Qwen3.5) {name} vs transformers per record: max rel {err:.1e}")
        assert err <= 1e-6, (name, err)  # (transformers' float32 norms and rotary table)
    for name in ("tp2", "cp2"):
        assert float(np.max(np.abs(scores[name] - scores["one"]) / np.maximum(1.0, np.abs(scores["one"])))) <= 1e-12
