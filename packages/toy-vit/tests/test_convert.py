"""Converting Hugging Face ViTForImageClassification folders: logits equal
transformers' (float32, eager attention) within 1e-4 on random pixels, the
metadata read from config.json / preprocessor_config.json, the
pytorch_model.bin path, ``classify`` against the processor + model pipeline,
and every refusal (a BadInputError naming the key)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import vit_ref

import toy_vit
from toy.errors import BadInputError
from toy_vit.convert import ConvertError, convert_hf, hf_config
from toy_vit.gguf_io import read_gguf

TOL = 1e-4


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("variant", list(vit_ref.VARIANTS))
def test_logits_equal_transformers(hf_vit, variant, batch):
    model, _, path = hf_vit(variant)
    pixels = vit_ref.random_pixels(variant, batch, seed=batch)
    ref = vit_ref.hf_logits(model, pixels)
    with toy_vit.load(path, threads=2) as clf:
        got = clf.logits(pixels)
    assert got.shape == ref.shape == (batch, model.config.num_labels) and got.dtype == np.float32
    assert np.abs(ref).max() > 1.0  # the random model's logits are not all near zero
    assert np.abs(got - ref).max() <= TOL, f"max abs diff {np.abs(got - ref).max():.3g}"


def test_metadata_from_the_folder(hf_vit):
    model, folder, path = hf_vit("rgb32")
    cfg, _ = read_gguf(path)
    assert cfg.labels == tuple(f"class_rgb32_{i}" for i in range(5))
    assert (cfg.image_size, cfg.patch_size, cfg.n_channels, cfg.d_model, cfg.n_layer, cfg.n_head, cfg.d_ff) == (
        32, 8, 3, 64, 3, 4, 128,
    )  # fmt: skip
    assert cfg.norm_eps == pytest.approx(1e-12)
    assert cfg.image_mean == pytest.approx((0.485, 0.456, 0.406)) and cfg.image_std == pytest.approx(
        (0.229, 0.224, 0.225)
    )
    g, _ = read_gguf(hf_vit("gray24")[2])
    assert g.n_channels == 1 and g.image_mean == pytest.approx((0.485,))
    e, _ = read_gguf(hf_vit("eps16")[2])
    assert e.norm_eps == pytest.approx(1e-6)


def test_labels_override_and_processor_defaults(hf_vit, tmp_path):
    _, folder, _ = hf_vit("eps16")
    hf = tmp_path / "hf"
    shutil.copytree(folder, hf)
    (hf / "preprocessor_config.json").unlink()
    cfg, _ = read_gguf(convert_hf(hf, tmp_path / "a.gguf", labels=["w", "x", "y", "z"]))
    assert cfg.labels == ("w", "x", "y", "z")
    assert cfg.image_mean == (0.5,) * 3 and cfg.image_std == (0.5,) * 3  # ViTImageProcessor's defaults
    (hf / "preprocessor_config.json").write_text(
        json.dumps({"do_normalize": False, "size": {"height": 16, "width": 16}})
    )
    assert hf_config(hf).image_mean == (0.0,) * 3 and hf_config(hf).image_std == (1.0,) * 3
    with pytest.raises(ConvertError, match="4 rows for 2 labels"):
        convert_hf(hf, tmp_path / "b.gguf", labels=["a", "b"])  # the head has 4 rows
    assert not (tmp_path / "b.gguf").exists()


def test_pytorch_bin_gives_the_same_file(hf_vit, tmp_path):
    model, folder, path = hf_vit("gray24")
    hf = tmp_path / "bin"
    model.save_pretrained(hf, safe_serialization=False)
    shutil.copy(folder / "preprocessor_config.json", hf)
    assert (hf / "pytorch_model.bin").is_file() and not (hf / "model.safetensors").exists()
    a_cfg, a = read_gguf(path)
    b_cfg, b = read_gguf(convert_hf(hf, tmp_path / "b.gguf"))
    assert a_cfg == b_cfg and a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert not b["v.blk.0.attn_q.bias"].any()  # qkv_bias: false -> zero biases


def test_classify_matches_the_transformers_pipeline(hf_vit, tmp_path):
    """Images through ViTImageProcessor + the PyTorch model vs toy_vit's
    classify: the same top-3 labels with probabilities within 1e-5."""
    from PIL import Image
    from transformers import ViTImageProcessor

    model, folder, path = hf_vit("rgb32")
    rng = np.random.default_rng(3)
    files = []
    for i, (h, w) in enumerate([(40, 32), (32, 32), (17, 50), (64, 64)]):
        f = tmp_path / f"im{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(f)
        files.append(f)
    proc = ViTImageProcessor.from_pretrained(folder)
    pixels = proc([Image.open(f).convert("RGB") for f in files], return_tensors="np")["pixel_values"]
    logits = vit_ref.hf_logits(model, pixels).astype(np.float64)
    prob = np.exp(logits - logits.max(1, keepdims=True))
    prob /= prob.sum(1, keepdims=True)
    with toy_vit.load(path, threads=2) as clf:
        out = clf.classify(files, top_k=3, batch_size=3)  # two batches: 3 + 1
        one = clf.classify(files[1], top_k=10)
    assert len(out) == 4 and all(len(r) == 3 for r in out)
    for r, p in zip(out, prob):
        order = np.argsort(-p)[:3]
        assert [lab for lab, _ in r] == [f"class_rgb32_{j}" for j in order]
        np.testing.assert_allclose([q for _, q in r], p[order], atol=1e-5)
    assert len(one) == 1 and len(one[0]) == 5  # top_k capped at the class count
    assert sum(q for _, q in one[0]) == pytest.approx(1.0)


def _edit(folder, tmp_path, **changes):
    hf = tmp_path / "edited"
    shutil.copytree(folder, hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    (hf / "config.json").write_text(json.dumps(cfg))
    return hf


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
        ({"model_type": "deit"}, "model_type='deit'"),
        ({"image_size": [32, 48]}, "image_size=\\[32, 48\\]"),
        ({"num_channels": 1}, "num_channels=1"),
        ({"num_attention_heads": 5}, "not a multiple of n_head=5"),
        ({"hidden_size": 32}, "embeddings.cls_token' has shape \\(1, 1, 64\\)"),
        ({"patch_size": 4}, "position_embeddings' has shape \\(1, 17, 64\\), config.json implies \\(1, 65, 64\\)"),
    ],
)
def test_refusals_name_the_key(hf_vit, tmp_path, changes, match):
    _, folder, _ = hf_vit("rgb32")
    hf = _edit(folder, tmp_path, **changes)
    if "num_channels" in changes:  # keep the processor consistent: the weights must be what disagrees
        pc = json.loads((hf / "preprocessor_config.json").read_text())
        pc.update(image_mean=[0.5], image_std=[0.5])
        (hf / "preprocessor_config.json").write_text(json.dumps(pc))
        match = "v.patch_embd.weight"
    with pytest.raises(ConvertError, match=match) as e:
        convert_hf(hf, tmp_path / "x.gguf")
    assert isinstance(e.value, BadInputError)
    assert not (tmp_path / "x.gguf").exists()


def test_a_checkpoint_without_a_head_is_refused_with_a_hint(tmp_path):
    from transformers import ViTConfig, ViTModel

    kw = {k: v for k, v in vit_ref.VARIANTS["eps16"].items() if k != "num_labels"}
    ViTModel(ViTConfig(**kw), add_pooling_layer=True).save_pretrained(tmp_path / "bare")
    with pytest.raises(ConvertError, match="no classifier.weight") as e:
        convert_hf(tmp_path / "bare", tmp_path / "x.gguf")
    assert "ViTForImageClassification" in e.value.hint


def test_missing_files_and_processor_mismatch(hf_vit, tmp_path):
    _, folder, _ = hf_vit("rgb32")
    with pytest.raises(ConvertError, match="not a folder"):
        convert_hf(tmp_path / "nope", tmp_path / "x.gguf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConvertError, match="no config.json"):
        convert_hf(tmp_path / "empty", tmp_path / "x.gguf")
    hf = _edit(folder, tmp_path)
    (hf / "model.safetensors").unlink()
    with pytest.raises(ConvertError, match="no model.safetensors"):
        convert_hf(hf, tmp_path / "x.gguf")
    shutil.copy(folder / "model.safetensors", hf)
    (hf / "preprocessor_config.json").write_text(json.dumps({"size": {"height": 224, "width": 224}}))
    with pytest.raises(ConvertError, match="size=.*image_size 32"):
        convert_hf(hf, tmp_path / "x.gguf")
    (hf / "preprocessor_config.json").write_text(json.dumps({"rescale_factor": 1.0}))
    with pytest.raises(ConvertError, match="rescale_factor"):
        convert_hf(hf, tmp_path / "x.gguf")


@pytest.mark.slow
def test_full_size_vit_tiny_equals_transformers(hf_vit):
    """The vit-tiny shape (224 px, 196 patches, 12 layers, 1000 classes,
    weights of a trained model's scale): logits within 1e-4 of transformers' for 2 images."""
    model, _, path = hf_vit("tiny224")
    pixels = vit_ref.random_pixels("tiny224", 2, seed=5)
    ref = vit_ref.hf_logits(model, pixels)
    with toy_vit.load(path, threads=2) as clf:
        assert clf.config == toy_vit.ViTConfig.preset("vit-tiny", labels=clf.labels, image_mean=clf.config.image_mean,
                                                      image_std=clf.config.image_std)  # fmt: skip
        got = clf.logits(pixels)
    assert np.abs(ref).max() > 1.0 and np.abs(ref[0] - ref[1]).max() > 0.1  # not a degenerate model
    assert np.abs(got - ref).max() <= TOL, f"max abs diff {np.abs(got - ref).max():.3g}"
