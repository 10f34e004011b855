"""Fuzzing the GGUF reader: thousands of seeded mutations of a synthetic file
and of a file carrying the real SmolLM2 metadata (vocabulary, merges, chat
template). Every case must either parse or raise GGUFError - never another
exception, a crash, a hang or a large allocation. Mutations target the header
(where lengths, counts, types and offsets live): byte flips, forged u64/u32
values at random positions, truncations, insertions and deletions."""

from __future__ import annotations

import resource
import struct
import time

import numpy as np
import pytest

from toy.gguf import GGUFError, GGUFFile, GGUFWriter, copy_metadata

N_SYNTHETIC = 3000
N_REAL = 300
FORGED = [0, 1, 7, 0xFF, 0xFFFF, 0xFFFFFFFF, 1 << 31, 1 << 40, 1 << 62, (1 << 64) - 1]


def synthetic(tmp_path) -> bytes:
    p = tmp_path / "s.gguf"
    w = GGUFWriter(p)
    w.add("general.architecture", "llama")
    w.add("llama.block_count", 2)
    w.add("tokenizer.ggml.tokens", ["a", "b", "cd", "é"])
    w.add("tokenizer.ggml.scores", np.array([0.0, -1.0, -2.0, -3.0], np.float32))
    w.add("nested", [np.array([1, 2], np.int32), np.array([3], np.int32)])
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32), dtype="Q8_0")
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    w.write()
    return p.read_bytes()


def mutate(rng: np.random.Generator, data: bytes, head_len: int) -> bytes:
    b = bytearray(data)
    kind = rng.integers(0, 6)
    pos = int(rng.integers(0, max(1, head_len)))
    if kind == 0:  # flip some bytes
        for _ in range(int(rng.integers(1, 8))):
            q = int(rng.integers(0, head_len))
            b[q] ^= 1 << int(rng.integers(0, 8))
    elif kind == 1:  # forged u64
        b[pos : pos + 8] = struct.pack("<Q", FORGED[int(rng.integers(0, len(FORGED)))])
    elif kind == 2:  # forged u32 (types, dims count, alignment)
        b[pos : pos + 4] = struct.pack("<I", FORGED[int(rng.integers(0, 6))] & 0xFFFFFFFF)
    elif kind == 3:  # truncate
        del b[int(rng.integers(0, len(b))) :]
    elif kind == 4:  # insert junk
        b[pos:pos] = rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8).tobytes()
    else:  # delete a run
        del b[pos : pos + int(rng.integers(1, 16))]
    return bytes(b)


def run_cases(tmp_path, base: bytes, head_len: int, n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    p = tmp_path / "fuzz.gguf"
    outcome = {"parsed": 0, "rejected": 0}
    slowest = 0.0
    for _ in range(n):
        p.write_bytes(mutate(rng, base, head_len))
        t0 = time.perf_counter()
        try:
            f = GGUFFile(p)
        except GGUFError:
            outcome["rejected"] += 1
        else:
            # a file that parses must be fully usable
            for name in f.tensors:
                f.tensor_bytes(name).tobytes()
            f.close()
            outcome["parsed"] += 1
        slowest = max(slowest, time.perf_counter() - t0)
    outcome["slowest_s"] = slowest
    return outcome


def test_fuzz_synthetic(tmp_path):
    base = synthetic(tmp_path)
    with GGUFFile(tmp_path / "s.gguf") as f:
        head = f.data_offset
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = run_cases(tmp_path, base, head, N_SYNTHETIC, seed=20261129)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert out["parsed"] + out["rejected"] == N_SYNTHETIC
    assert out["rejected"] > N_SYNTHETIC // 3  # the mutations do hit the checks
    assert out["slowest_s"] < 1.0, out
    assert grown_mb < 64, f"RSS grew {grown_mb:.0f} MB while fuzzing"


@pytest.mark.model
def test_fuzz_real_metadata(tmp_path, smollm2_path):
    small = tmp_path / "real-meta.gguf"
    with GGUFFile(smollm2_path) as src:
        w = GGUFWriter(small)
        copy_metadata(src, w)
        for name in ("output_norm.weight", "blk.0.attn_norm.weight"):
            info = src.tensors[name]
            w.add_tensor_bytes(name, info.shape, info.dtype, src.tensor_bytes(name))
        w.write()
    base = small.read_bytes()
    with GGUFFile(small) as f:
        head = f.data_offset
    # aim half of the mutations at the first 4 KiB (counts, small keys), the rest anywhere in the header
    out1 = run_cases(tmp_path, base, 4096, N_REAL // 2, seed=1)
    out2 = run_cases(tmp_path, base, head, N_REAL - N_REAL // 2, seed=2)
    assert out1["rejected"] + out2["rejected"] > 0
    assert max(out1["slowest_s"], out2["slowest_s"]) < 2.0
