"""A ViT file whose metadata lies (issue 42, items 1, 5 and 6): the declared
block count is checked against the ``v.blk.N`` tensors before
``toy_vit.model.params`` builds a list per block (a block count of
2147483647 grew memory without bound in ``toy_vit.load`` and ``toy
describe``: it runs in a child under an address-space limit and a timeout),
the other counts against sane bounds, every dimension against the tensors
that use it, and each failure is a ``ViTFileError`` (a ``BadInputError``)
naming the key, and the tensor with both shapes (``toy.models.validate``)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import numpy as np
import pytest

import toy_vit
from toy.errors import BadInputError
from toy.gguf import GGUFWriter, TypeInfo, ValueType
from toy_vit.config import ViTConfig
from toy_vit.gguf_io import ViTFileError, metadata
from toy_vit.model import params

U32, U64, F32 = (TypeInfo(ValueType[t]) for t in ("UINT32", "UINT64", "FLOAT32"))
AS_LIMIT = 1 << 30
RSS_BOUND = 300 << 20


def write(path, override=None, reshape=None):
    """A vit-micro file (3 classes) with metadata ``override`` (key ->
    (value, TypeInfo)) and tensor shapes ``reshape`` (name -> shape)."""
    cfg = ViTConfig.preset("vit-micro", labels=("a", "b", "c"))
    w = GGUFWriter(path)
    for k, v in {**metadata(cfg, "bad"), **(override or {})}.items():
        w.add(k, *v) if isinstance(v, tuple) else w.add(k, v)
    rng = np.random.default_rng(0)
    for n, p in params(cfg).items():
        w.add_tensor(n, rng.standard_normal((reshape or {}).get(n, p.shape)).astype(np.float32))
    return w.write()


CHILD = r"""
import json, sys, time, resource
def vm_hwm():  # this image's own peak; ru_maxrss would include the forked pytest process's
    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM'))
t0 = time.perf_counter()
import toy_vit
from toy.errors import BadInputError
from toy.models import card
from toy.gguf import GGUFFile
try:
    with GGUFFile(sys.argv[1]) as f:  # what `toy describe` reads
        problem = card.summary_from(f.metadata, f.tensors).extra.get("problem")
    toy_vit.load(sys.argv[1], threads=1, device="cpu").close()
    r = {"outcome": "loaded"}
except BadInputError as e:
    r = {"outcome": type(e).__name__, "message": str(e), "describe": problem}
except MemoryError:
    r = {"outcome": "MemoryError"}
r.update(seconds=time.perf_counter() - t0, peak_rss=vm_hwm())
print(json.dumps(r))
"""


def test_a_huge_block_count_is_refused_at_once(tmp_path):
    bad = write(tmp_path / "huge.gguf", {"vit.block_count": (2147483647, U32)})

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))

    try:
        p = subprocess.run([sys.executable, "-c", CHILD, str(bad)], preexec_fn=limit, capture_output=True, text=True,
                           timeout=60)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("loading a vit file with block_count 2147483647 ran past 60 s")
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    want = "vit.block_count = 2147483647, but the file has tensors for 2 blocks (v.blk.0 … v.blk.1)"
    assert r["outcome"] == "ViTFileError" and want in r["message"], r
    assert want in r["describe"], r  # toy describe's problem row says the same
    assert r["seconds"] < 20 and r["peak_rss"] < RSS_BOUND, r


@pytest.mark.parametrize(
    "override,reshape,fragment",
    [
        ({"vit.block_count": (0, U32)}, None, "vit.block_count = 0: a model needs at least one block"),
        ({"vit.block_count": (1, U32)}, None, "vit.block_count = 1, but the file has tensors for 2 blocks"),
        ({"vit.image_size": (1 << 40, U64)}, None, "vit.image_size = 1099511627776 is out of range"),
        ({"vit.num_channels": (1 << 33, U64)}, None, "vit.num_channels = 8589934592 is out of range"),
        ({"vit.attention.layer_norm_epsilon": (float("nan"), F32)}, None, "(vit.attention.layer_norm_epsilon)"),
        ({"vit.image_size": (17, U32)}, None, "(vit.image_size, vit.patch_size)"),
        # item 6: a dimension that disagrees with the tensors names the key, the tensor and both shapes
        ({"vit.feed_forward_length": (48, U32)}, None,
         "tensor 'v.blk.0.ffn_up.weight' has shape (64, 32), but vit.feed_forward_length = 48 implies (48, 32)"),
        ({"vit.image_size": (32, U32)}, None,
         "tensor 'v.position_embd.weight' has shape (17, 32), but (vit.image_size / vit.patch_size)² + 1 = 65"),
        (None, {"cls.weight": (4, 32)},
         "tensor 'cls.weight' has shape (4, 32), but vit.num_classes = 3 implies (3, 32)"),
    ],
)  # fmt: skip
def test_bad_counts_and_dimensions_name_the_key(tmp_path, override, reshape, fragment):
    bad = write(tmp_path / "bad.gguf", override, reshape)
    with pytest.raises(ViTFileError) as e:
        toy_vit.load(bad, threads=1)
    assert isinstance(e.value, BadInputError)
    assert fragment in str(e.value), str(e.value)
