"""The ViT model pieces: config validation and presets (parameter counts
from an independent formula), ``patchify`` against PyTorch's Conv2d, the
GGUF layout read back with the independent ``gguf`` package, bad files,
batch invariance, the ``Classifier``'s lifetime and input checks, and the
graph's gradients against PyTorch autograd (the forward trains)."""

from __future__ import annotations

import numpy as np
import pytest
import vit_ref

import toy_ggml
import toy_vit
from toy.errors import BadInputError
from toy.gguf import GGUFWriter
from toy.models import ParamInfo
from toy_vit.config import PRESETS, ViTConfig, ViTConfigError
from toy_vit.gguf_io import ViTFileError, metadata, read_gguf, write_gguf
from toy_vit.model import n_params, params, patchify


def _count(image, patch, C, D, L, F, n):
    """Parameters of a ViT classifier, counted by hand."""
    T = (image // patch) ** 2 + 1
    block = 4 * (D * D + D) + 2 * 2 * D + (D * F + F) + (F * D + D)
    return (D * C * patch * patch + D) + D + T * D + L * block + 2 * D + (n * D + n)


def test_preset_parameter_counts():
    tiny = ViTConfig.preset("vit-tiny")
    assert n_params(tiny) == _count(224, 16, 3, 192, 12, 768, 1000) == 5_717_416  # ~5.7M (DeiT-Tiny)
    assert n_params(ViTConfig.preset("vit-small32")) == _count(32, 4, 3, 192, 6, 384, 10) == 1_806_538
    assert n_params(ViTConfig.preset("vit-micro")) == _count(16, 4, 3, 32, 2, 64, 10) == 19_626
    assert (tiny.n_patches, tiny.n_tokens, tiny.patch_dim, tiny.head_dim) == (196, 197, 768, 64)
    # digits: the guide's recipe for the demo data (grey, 8-pixel patches), 542,090 parameters there
    assert n_params(ViTConfig.preset("digits")) == _count(32, 8, 1, 128, 4, 256, 10) == 542_090
    assert set(PRESETS) == {"vit-tiny", "vit-small32", "vit-micro", "digits"}


def test_config_defaults_overrides_and_errors():
    c = ViTConfig.preset("vit-micro", labels=["cat", "dog"], n_layer=3)
    assert (c.n_classes, c.labels, c.n_layer, c.d_model) == (2, ("cat", "dog"), 3, 32)
    assert c.norm_eps == 1e-12 and c.image_mean == (0.5,) * 3 and c.image_std == (0.5,) * 3
    assert ViTConfig.preset("vit-micro").labels == tuple(str(i) for i in range(10))
    assert ViTConfig.from_dict({"preset": "vit-tiny", "n_classes": 7}).n_classes == 7
    assert ViTConfig.from_dict(c.to_dict()) == c
    assert c.with_labels(["a", "b", "c"]).n_classes == 3
    bad = [
        (dict(image_size=30), "image_size=30 is not a multiple of patch_size=4"),
        (dict(n_head=3), "d_model=32 is not a multiple of n_head=3"),
        (dict(n_classes=3, labels=["a", "b"]), "2 labels for n_classes=3"),
        (dict(n_channels=1, image_mean=[0.1, 0.2]), "image_mean has 2 values for n_channels=1"),
        (dict(image_std=[1.0, 0.0, 1.0]), "image_std"),
        (dict(d_ff=0), "d_ff=0"),
        (dict(norm_eps=0.0), "norm_eps=0.0"),
        (dict(labels=["a", ""]), "non-empty"),
    ]
    for over, match in bad:
        with pytest.raises(ViTConfigError, match=match):
            ViTConfig.preset("vit-micro", **over)
    with pytest.raises(ViTConfigError, match="unknown ViT config key 'width'"):
        ViTConfig.from_dict({"preset": "vit-micro", "width": 3})
    with pytest.raises(ViTConfigError, match="unknown ViT preset 'vit-huge'") as e:
        ViTConfig.preset("vit-huge")
    assert "vit-tiny" in e.value.hint and isinstance(e.value, BadInputError)


def test_params_kinds_and_names():
    cfg = ViTConfig.preset("vit-micro")
    p = params(cfg)
    assert list(p)[:4] == ["v.patch_embd.weight", "v.patch_embd.bias", "v.class_embd", "v.position_embd.weight"]
    assert list(p)[-2:] == ["cls.weight", "cls.bias"]
    assert p["v.patch_embd.weight"] == ParamInfo((32, 3, 4, 4), "matrix")
    kinds = {n: i.kind for n, i in p.items()}
    assert kinds["v.class_embd"] == kinds["v.position_embd.weight"] == "position"
    assert kinds["v.blk.1.attn_out.weight"] == kinds["v.blk.1.ffn_down.weight"] == "residual"
    assert kinds["v.blk.0.ln1.weight"] == "norm" and kinds["v.post_ln.bias"] == "norm_bias"
    assert kinds["v.blk.0.attn_q.bias"] == "bias" and kinds["cls.weight"] == "matrix"
    assert all(len(n.encode()) < 64 for n in p)  # ggml's name limit


def test_patchify_is_the_convolution():
    """patchify(x) @ W.reshape(D, K).T + b equals PyTorch's Conv2d (stride p) output, flattened row-major."""
    import torch

    cfg = ViTConfig.preset("vit-micro", n_channels=2, image_mean=[0.5] * 2, image_std=[0.5] * 2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 2, 16, 16)).astype(np.float32)
    w = rng.standard_normal((32, 2, 4, 4)).astype(np.float32)
    p = patchify(x, cfg)
    assert p.shape == (2, 17, 32) and p.dtype == np.float32
    assert not p[:, 0].any()  # the class slot
    ref = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), stride=4)  # (B, D, 4, 4)
    ref = ref.flatten(2).transpose(1, 2).numpy()  # (B, 16, D) as Hugging Face's ViTPatchEmbeddings
    np.testing.assert_allclose(p[:, 1:] @ w.reshape(32, -1).T, ref, atol=1e-5)
    with pytest.raises(BadInputError, match=r"\(B, 2, 16, 16\)"):
        patchify(x[:, :1], cfg)
    with pytest.raises(BadInputError, match="NaN"):
        patchify(np.where(x > 2, np.nan, x), cfg)
    with pytest.raises(BadInputError, match="dtype uint8"):
        patchify(x.astype(np.uint8), cfg)


def _random_file(path, cfg, seed=0):
    rng = np.random.default_rng(seed)
    tensors = {n: rng.standard_normal(p.shape).astype(np.float32) for n, p in params(cfg).items()}
    write_gguf(path, cfg, tensors, name="micro")
    return tensors


def test_gguf_round_trip_read_with_the_gguf_package(tmp_path):
    import gguf

    cfg = ViTConfig.preset("vit-micro", labels=[f"l{i}" for i in range(4)], image_mean=[0.1, 0.2, 0.3])
    tensors = _random_file(tmp_path / "m.gguf", cfg)
    cfg2, back = read_gguf(tmp_path / "m.gguf")
    assert cfg2 == cfg and list(back) == list(tensors)
    for n in tensors:
        np.testing.assert_array_equal(back[n], tensors[n], err_msg=n)
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    f = {k: r.fields[k] for k in r.fields}
    assert f["general.architecture"].contents() == "vit" and f["general.name"].contents() == "micro"
    ints = {k: f[k].contents() for k in f if k.startswith("vit.") and f[k].types[0] == gguf.GGUFValueType.UINT32}
    assert ints == {
        "vit.image_size": 16, "vit.patch_size": 4, "vit.num_channels": 3, "vit.embedding_length": 32,
        "vit.block_count": 2, "vit.attention.head_count": 2, "vit.feed_forward_length": 64, "vit.num_classes": 4,
    }  # fmt: skip
    assert f["vit.attention.layer_norm_epsilon"].types == [gguf.GGUFValueType.FLOAT32]
    assert f["vit.labels"].contents() == ["l0", "l1", "l2", "l3"]
    assert f["vit.image_mean"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32]
    np.testing.assert_allclose(f["vit.image_mean"].contents(), [0.1, 0.2, 0.3], rtol=1e-6)
    by_name = {t.name: t for t in r.tensors}
    assert list(by_name) == list(tensors)
    pe = by_name["v.patch_embd.weight"]
    assert list(pe.shape) == [4, 4, 3, 32] and pe.tensor_type == gguf.GGMLQuantizationType.F32  # ggml ne order
    np.testing.assert_array_equal(np.asarray(pe.data).reshape(32, 3, 4, 4), tensors["v.patch_embd.weight"])


def _write_raw(path, cfg, drop_key=None, drop_tensor=None, reshape=None, override=None):
    """A vit file with one thing wrong, written with the plain GGUF writer."""
    w = GGUFWriter(path)
    for k, v in {**metadata(cfg, "bad"), **(override or {})}.items():
        if k != drop_key:
            w.add(k, *v) if isinstance(v, tuple) else w.add(k, v)
    rng = np.random.default_rng(0)
    for n, p in params(cfg).items():
        if n != drop_tensor:
            shape = reshape[1] if reshape and reshape[0] == n else p.shape
            w.add_tensor(n, rng.standard_normal(shape).astype(np.float32))
    return w.write()


def test_bad_files_name_what_is_wrong(tmp_path):
    cfg = ViTConfig.preset("vit-micro")
    cases = [
        (dict(drop_key="vit.patch_size"), "lacks metadata key 'vit.patch_size'"),
        (dict(drop_key="vit.labels"), "lacks metadata key 'vit.labels'"),
        (dict(drop_key="vit.attention.layer_norm_epsilon"), "layer_norm_epsilon"),
        (dict(drop_tensor="v.blk.1.attn_v.bias"), "lacks tensor 'v.blk.1.attn_v.bias'"),
        (dict(reshape=("v.position_embd.weight", (16, 32))), r"'v.position_embd.weight' has shape \(16, 32\)"),
        (dict(override={"vit.labels": ["a", "b"]}), "2 names for vit.num_classes=10"),
        (dict(override={"vit.image_std": np.ones(2, np.float32)}), "'vit.image_std' must be 3 numbers"),
        (dict(override={"vit.block_count": "two"}), "'vit.block_count' is 'two'"),
        (dict(override={"vit.patch_size": 5}), "not a multiple of patch_size=5"),
        (dict(override={"general.architecture": "gpt2"}), "'gpt2' is not vit"),
    ]
    for i, (kw, match) in enumerate(cases):
        path = _write_raw(tmp_path / f"bad{i}.gguf", cfg, **kw)
        with pytest.raises(ViTFileError, match=match) as e:
            toy_vit.load(path, threads=1)
        assert isinstance(e.value, BadInputError)
    w = GGUFWriter(tmp_path / "f16.gguf")
    for k, v in metadata(cfg).items():
        w.add(k, *v) if isinstance(v, tuple) else w.add(k, v)
    for n, p in params(cfg).items():
        w.add_tensor(n, np.zeros(p.shape, np.float16 if n == "cls.weight" else np.float32))
    with pytest.raises(ViTFileError, match="'cls.weight' is F16"):
        toy_vit.load(w.write(), threads=1)
    with pytest.raises(ValueError, match="'cls.bias' is missing"):
        write_gguf(tmp_path / "x.gguf", cfg, {n: np.zeros(p.shape) for n, p in params(cfg).items() if n != "cls.bias"})


def test_batch_invariance(hf_vit):
    """Image i's logits in a batch of 3 against a batch of 1: bit-identical
    with exact_batching; within float32 rounding (measured <= 1e-6 here) with
    the CPU's batched kernels."""
    _, _, path = hf_vit("rgb32")
    px = vit_ref.random_pixels("rgb32", 3, seed=7)
    with toy_vit.load(path, threads=2, exact_batching=True) as clf:
        three = clf.logits(px)
        ones = np.concatenate([clf.logits(px[i : i + 1]) for i in range(3)])
        np.testing.assert_array_equal(three, ones)
        np.testing.assert_array_equal(clf.logits(px[1:2]), three[1:2])  # the graph is reused
        assert clf.graph_builds == 2
    with toy_vit.load(path, threads=2) as clf:
        three = clf.logits(px)
        ones = np.concatenate([clf.logits(px[i : i + 1]) for i in range(3)])
        assert np.abs(three - ones).max() <= 1e-5 * max(1.0, np.abs(three).max())


def test_classifier_lifetime_and_checks(tmp_path):
    cfg = ViTConfig.preset("vit-micro", labels=list("abcd"))
    _random_file(tmp_path / "m.gguf", cfg)
    clf = toy_vit.load(tmp_path / "m.gguf", threads=1)
    assert clf.labels == tuple("abcd") and clf.config == cfg and "16px/4" in repr(clf)
    with pytest.raises(BadInputError, match=r"\(B, 3, 16, 16\)"):
        clf.logits(np.zeros((1, 3, 32, 32), np.float32))
    with pytest.raises(BadInputError, match="top_k=0"):
        clf.classify([np.zeros((16, 16, 3), np.uint8)], top_k=0)
    out = clf.classify(np.zeros((2, 20, 20, 3), np.uint8), top_k=2)  # a (B, H, W, C) batch
    assert len(out) == 2 and out[0] == out[1] and [lab for lab, _ in out[0]][0] in "abcd"
    clf.close()
    clf.close()  # idempotent
    with pytest.raises(toy_ggml.ClosedError):
        clf.logits(np.zeros((1, 3, 16, 16), np.float32))
    with pytest.raises(BadInputError, match="threads=0"):
        toy_vit.load(tmp_path / "m.gguf", threads=0)


def _hf_name(name: str) -> str:
    """GGUF tensor name -> Hugging Face parameter name (written here apart from convert.py)."""
    block = {"ln1": "layernorm_before", "attn_q": "attention.attention.query", "attn_k": "attention.attention.key",
             "attn_v": "attention.attention.value", "attn_out": "attention.output.dense", "ln2": "layernorm_after",
             "ffn_up": "intermediate.dense", "ffn_down": "output.dense"}  # fmt: skip
    fixed = {"v.patch_embd.weight": "vit.embeddings.patch_embeddings.projection.weight",
             "v.patch_embd.bias": "vit.embeddings.patch_embeddings.projection.bias",
             "v.class_embd": "vit.embeddings.cls_token", "v.position_embd.weight": "vit.embeddings.position_embeddings",
             "v.post_ln.weight": "vit.layernorm.weight", "v.post_ln.bias": "vit.layernorm.bias",
             "cls.weight": "classifier.weight", "cls.bias": "classifier.bias"}  # fmt: skip
    if name in fixed:
        return fixed[name]
    _, _, i, part, kind = name.split(".")
    return f"vit.encoder.layer.{i}.{block[part]}.{kind}"


@pytest.mark.skipif("GELU_ERF" not in toy_ggml.BACKWARD_UNARY_OPS, reason="toy-ggml has no GELU_ERF backward yet")
def test_gradients_equal_pytorch_autograd(hf_vit):
    """The mean cross-entropy of 3 images: every parameter's gradient from
    ggml's backward graph against PyTorch autograd on the same model."""
    import torch

    model, _, path = hf_vit("rgb32")
    cfg, arrays = read_gguf(path)
    px = vit_ref.random_pixels("rgb32", 3, seed=11)
    y = np.array([0, 3, 4])
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(pixel_values=torch.from_numpy(px)).logits, torch.from_numpy(y))
    loss.backward()
    ref = dict(model.named_parameters())

    from toy_vit.model import forward

    with toy_ggml.Runtime("cpu", threads=2) as rt:
        st = toy_ggml.Context(max_tensors=len(arrays) + 8)
        p = {n: st.tensor(toy_ggml.GGMLType.F32, a.shape, name=n).set_param() for n, a in arrays.items()}
        patches = st.tensor(toy_ggml.GGMLType.F32, (3, cfg.n_tokens, cfg.patch_dim), name="patches")
        labels = st.tensor(toy_ggml.GGMLType.F32, (3, cfg.n_classes), name="labels")
        st.allocate(rt)
        for n, a in arrays.items():
            p[n].set(a)
        patches.set(patchify(px, cfg))
        labels.set(np.eye(cfg.n_classes, dtype=np.float32)[y])
        ops = toy_ggml.Context(max_tensors=20000, graph_size=20000)
        out = ops.cross_entropy_loss(forward(ops, cfg, p, patches, 3), labels).set_loss().set_output()
        g = toy_ggml.Graph(ops, size=20000, grads=True).build_forward(out)
        g.build_backward()
        seed = g.grad(out)
        seed.set_input()
        grads = {n: ops.cont(g.grad(t)).set_output() for n, t in p.items()}
        g.build_forward(*grads.values())
        rt.allocate(g)
        seed.set(np.ones(seed.shape, np.float32))
        rt.compute(g)
        assert float(out.numpy()[0]) == pytest.approx(loss.item(), rel=1e-5)
        for n, t in grads.items():
            want = ref[_hf_name(n)].grad.numpy().reshape(arrays[n].shape)
            got = t.numpy()
            scale = max(np.abs(want).max(), 1e-3)
            err = np.abs(got - want).max()  # measured at most 9.3e-5 of the scale (AVX2 kernels)
            assert err <= 5e-4 * scale, f"{n}: {err:.3g} (scale {scale:.3g})"
        ops.close()
        st.close()


def test_toy_describe_and_the_card(hf_vit, capsys):
    """``toy describe`` on a converted ViT: the registry finds toy_vit.arch
    through the toy.architectures entry point."""
    import json

    from toy_cli.main import main

    _, _, path = hf_vit("rgb32")
    assert main(["describe", str(path)]) == 0
    out = capsys.readouterr().out
    for text in [
        "architecture   vit",
        f"parameters     {n_params(read_gguf(path)[0]) / 1e3:.1f}K",
        "layers         3",
        "attention      4 heads, head_dim 16",
        "norm           LayerNorm, eps 1e-12",
        "image          32×32 px, 3 channels",
        "patches        8×8 px: 4×4 = 16 patches + class token = 17 tokens",
        "classes        5: class_rgb32_0, class_rgb32_1, class_rgb32_2, class_rgb32_3, class_rgb32_4",
        "Algorithm: P ← vit(x | θ)",
        "P_x ∈ ℝ^{16×192}",
        "for h = 1, …, 4: A_h ← softmax(Q_h·K_hᵀ / √16)·V_h",
        "z ∈ ℝ^5, W_c ∈ ℝ^{64×5}",
        "GELU(z) = ½z(1 + erf(z/√2))",
    ]:
        assert text in out, f"{text!r} not in:\n{out}"
    for lm_only in ("vocab", "tokenizer", "output head"):
        assert lm_only not in out
    assert main(["describe", str(path), "--json"]) == 0
    extra = json.loads(capsys.readouterr().out)["summary"]["extra"]
    assert (
        extra["n_patches"] == 16 and extra["n_classes"] == 5 and extra["model_params"] == n_params(read_gguf(path)[0])
    )


def test_registry_gives_the_vit_to_toys_trainer_init():
    from toy import models
    from toy.train.model import init_params

    cfg = ViTConfig.preset("vit-micro")
    assert models.of(cfg).params(cfg) == params(cfg)
    init = init_params(cfg, seed=0)
    assert list(init) == list(params(cfg)) and all(init[n].shape == p.shape for n, p in params(cfg).items())
    assert (init["v.blk.0.ln1.weight"] == 1).all() and not init["cls.bias"].any()
