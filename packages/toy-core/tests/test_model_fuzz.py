"""A seeded mutation fuzzer of whole model files: the header, the metadata
values (above all the numeric hyperparameters: 0, 1, -1, huge, off by one,
another key's value, another type, NaN) and the tensor-info fields (dims,
their count, type, offset) of a tiny model of every architecture toy writes
(``toy_testsupport.tiny_archs``: llama, qwen2, qwen3, gpt2, gemma2, gemma3,
olmoe, qwen2moe, qwen3moe) and of a toy-vit classifier.

Each mutated file goes through ``toy.load`` and, where it loads, a one-token
generation (``toy_vit.load`` and a forward for the ViT), in child processes
(many cases each) under an address-space limit (RLIMIT_AS) and a time limit.
Asserted: no child dies of a signal, none runs past its limit, none's peak
RSS passes ``RSS_BOUND``, no case takes more than ``CASE_S``, and every
failure is a ``BadInputError`` (or another ``ToyError`` the CLI exits 2
for: ``TokenizerError``), which the CLI prints as an ``error:`` line, and
whose message, when loading refused the file, names a metadata key, a
tensor or an offset (the reader names the byte). A file that loads may
still fail to generate cleanly: a tensor whose type was changed holds
garbage, which no load-time check can see, and gives NaN logits (a
``SamplingError``). The ``toy describe`` / ``toy infer`` check runs the CLI,
in a limited child, on a few of the bad files.

The reader alone is fuzzed by test_gguf_fuzz.py; this file fuzzes what the
model layers (``toy.models``, ``toy.models.validate``, toy-vit's
``gguf_io``) and the engine make of a file the reader accepts.
"""

from __future__ import annotations

import json
import resource
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from toy.gguf import GGUFFile, GGUFWriter, TypeInfo, ValueType
from toy_testsupport import tiny_archs

SEED = 42
CASES_PER_MODEL = 34  # x 10 models: ~340 cases
AS_LIMIT = 2 << 30  # RLIMIT_AS of a child: a runaway allocation fails instead of taking the machine
RSS_BOUND = 400 << 20  # peak RSS of a child (a tiny model's process peaks at ~60 MB)
CASE_S = 10.0  # one case (open, load, one token) on a busy 2-core machine; each takes ~20 ms
CHILD_TIMEOUT_S = 240

INTS = [0, 1, -1, 2, 3, 7, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 40, (1 << 63) - 1, (1 << 64) - 1]
FLOATS = [float("nan"), float("inf"), -float("inf"), -1.0, 0.0, 1e38]
DIMS = [0, 1, 2, 3, 5, 1 << 31, 1 << 40, (1 << 63) - 1]
GGML_TYPES = [1, 2, 8, 12, 30, 39, 1000, 0xFFFFFFFF]  # F16, Q4_0, Q8_0, Q4_K, BF16, unknown ones


# ---------------------------------------------------------------- the child


CHILD = r"""
import json, sys, time, resource
def vm_hwm():  # this image's own peak; ru_maxrss would include the forked pytest process's
    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM'))
import numpy as np

cases, out = json.load(open(sys.argv[1])), open(sys.argv[2], "w", buffering=1)
import toy

def run(path, arch, phase):
    if arch == "vit":
        import toy_vit
        with toy_vit.load(path, threads=1, device="cpu") as m:
            phase[0] = "run"
            c = m.config
            m.logits(np.zeros((1, c.n_channels, c.image_size, c.image_size), np.float32))
        return
    m = toy.load(path, device="cpu", threads=1)
    phase[0] = "run"
    try:
        m.generate("ab", max_tokens=1)
    finally:
        m.close()

for i, (path, arch) in enumerate(cases):
    out.write(json.dumps({"start": i}) + "\n")
    t0 = time.perf_counter()
    phase = ["load"]
    try:
        run(path, arch, phase)
        r = {"outcome": "ok"}
    except toy.ToyError as e:  # BadInputError, or another class the CLI exits 2 for (TokenizerError)
        bad = getattr(e, "exit_code", 1) == 2
        r = {"outcome": "bad_input" if bad else "internal", "type": type(e).__name__, "message": str(e)}
    except BaseException as e:  # an internal error: the test fails on it
        r = {"outcome": "internal", "type": type(e).__name__, "message": str(e)[:300]}
    r.update(i=i, phase=phase[0], seconds=time.perf_counter() - t0,
             peak_rss=vm_hwm())
    out.write(json.dumps(r) + "\n")
"""


def _limit_memory():  # in the child, before exec
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def run_children(tmp_path: Path, cases: list[tuple[str, str]], n_children: int = 2) -> list[dict]:
    """Run ``cases`` ((path, arch)) in ``n_children`` limited children, one
    after the other (the machine has two cores, shared); every result."""
    results: list[dict] = []
    chunks = [cases[k::n_children] for k in range(n_children)]
    for k, chunk in enumerate(chunks):
        spec, out = tmp_path / f"cases{k}.json", tmp_path / f"results{k}.jsonl"
        spec.write_text(json.dumps(chunk))
        try:
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, str(spec), str(out)],
                preexec_fn=_limit_memory,
                timeout=CHILD_TIMEOUT_S,
                capture_output=True,
                text=True,
            )
        except subprocess.TimeoutExpired:
            proc = None
        lines = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
        done = [x for x in lines if "outcome" in x]
        started = [x["start"] for x in lines if "start" in x]
        last = chunk[started[-1]] if started else None
        if proc is None:
            pytest.fail(f"a fuzz child ran past {CHILD_TIMEOUT_S} s; its last case: {last}")
        if proc.returncode != 0:
            pytest.fail(f"a fuzz child exited with {proc.returncode} in case {last}:\n{proc.stderr[-3000:]}")
        assert len(done) == len(chunk), proc.stderr[-3000:]
        for r in done:
            r["case"] = chunk[r["i"]]
        results += done
    return results


# ---------------------------------------------------------------- mutations


def _type_for(v) -> TypeInfo:
    if isinstance(v, float):
        return TypeInfo(ValueType.FLOAT32)
    if 0 <= v < 1 << 32:
        return TypeInfo(ValueType.UINT32)
    if -(1 << 31) <= v < 1 << 31:
        return TypeInfo(ValueType.INT32)
    if -(1 << 63) <= v < 1 << 63:
        return TypeInfo(ValueType.INT64)
    return TypeInfo(ValueType.UINT64)


def rewrite(src: Path, dst: Path, changes: dict) -> Path:
    """``src`` with metadata ``changes`` (key -> (value, TypeInfo), or None
    to drop the key); tensors copied as they are."""
    with GGUFFile(src) as f:
        w = GGUFWriter(dst)
        for k, v in f.metadata.items():
            if k in changes:
                if changes[k] is not None:
                    w.add(k, *changes[k])
            else:
                w.add(k, v, f.types[k])
        for k, c in changes.items():
            if k not in f.metadata and c is not None:
                w.add(k, *c)
        for name, t in f.tensors.items():
            w.add_tensor_bytes(name, t.shape, t.dtype, f.tensor_bytes(name))
        return w.write()


def tensor_info_offsets(data: bytes, names) -> dict[str, int]:
    """name -> the byte offset of its tensor info's n_dims field."""
    out = {}
    for name in names:
        enc = name.encode()
        p = data.rfind(struct.pack("<Q", len(enc)) + enc)
        assert p > 0, name
        out[name] = p + 8 + len(enc)
    return out


def metadata_mutations(rng, f) -> list[tuple[str, dict]]:
    """(description, changes) for the file ``f`` (an open GGUFFile)."""
    arch = f.metadata["general.architecture"]
    ints = [
        k
        for k, v in f.metadata.items()
        if (k.startswith(f"{arch}.") or k.endswith("_token_id"))
        and isinstance(v, (int, np.integer))
        and not isinstance(v, bool)
    ]
    floats = [k for k, v in f.metadata.items() if k.startswith(f"{arch}.") and isinstance(v, float)]
    out = []
    for k in ints:
        v = int(f.metadata[k])
        for new in INTS + [v + 1, v - 1, 2 * v]:
            out.append((f"{k} = {new}", {k: (new, _type_for(new))}))
        out.append((f"{k} as a float", {k: (v + 0.5, TypeInfo(ValueType.FLOAT32))}))
        out.append((f"{k} as NaN", {k: (float("nan"), TypeInfo(ValueType.FLOAT32))}))
        out.append((f"{k} as a string", {k: (str(v), TypeInfo(ValueType.STRING))}))
        out.append((f"{k} as an array", {k: (np.array([v, v + 1], np.int32), None)}))
        out.append((f"{k} dropped", {k: None}))
        other = ints[int(rng.integers(0, len(ints)))]
        if other != k:  # swapped with another count
            out.append(
                (f"{k} <-> {other}", {k: (f.metadata[other], f.types[other]), other: (f.metadata[k], f.types[k])})
            )
    for k in floats:
        for new in FLOATS:
            out.append((f"{k} = {new}", {k: (new, TypeInfo(ValueType.FLOAT32))}))
    for other in ("llama", "gpt2", "gemma2", "gemma3", "qwen3moe", "vit"):
        if other != arch:
            out.append((f"general.architecture = {other}", {"general.architecture": (other, None)}))
    return out


def byte_mutations(data: bytes, f) -> list[tuple[str, list[tuple[int, bytes]]]]:
    """(description, [(offset, bytes)]) patches of the header and the tensor infos."""
    out = []
    for v in (0, 1, 2, 4, 0xFFFFFFFF):
        out.append((f"version = {v}", [(4, struct.pack("<I", v))]))
    n_t, n_kv = len(f.tensors), len(f.metadata)
    for v in (0, n_t - 1, n_t + 1, 1 << 40, (1 << 64) - 1):
        out.append((f"n_tensors = {v}", [(8, struct.pack("<Q", v))]))
    for v in (0, n_kv - 1, n_kv + 1, 1 << 40):
        out.append((f"n_kv = {v}", [(16, struct.pack("<Q", v))]))
    at = tensor_info_offsets(data, f.tensors)
    for name, t in f.tensors.items():
        p = at[name]
        n = len(t.shape)
        for v in (0, 1, 3, 5, 0xFFFFFFFF):
            if v != n:
                out.append((f"{name}: n_dims = {v}", [(p, struct.pack("<I", v))]))
        for i in range(n):
            for v in DIMS:
                out.append((f"{name}: ne[{i}] = {v}", [(p + 4 + 8 * i, struct.pack("<Q", v))]))
        if n == 2:  # the two dims swapped (ggml order)
            a, b = data[p + 4 : p + 12], data[p + 12 : p + 20]
            out.append((f"{name}: dims swapped", [(p + 4, b + a)]))
        tp = p + 4 + 8 * n
        for v in GGML_TYPES:
            out.append((f"{name}: type = {v}", [(tp, struct.pack("<I", v))]))
        off = struct.unpack_from("<Q", data, tp + 4)[0]
        for v in (off + 1, off + 32, max(off - 32, 0), 1 << 40, (1 << 64) - 1):
            if v != off:
                out.append((f"{name}: offset = {v}", [(tp + 4, struct.pack("<Q", v))]))
    return out


def base_models(tmp_path: Path) -> dict[str, Path]:
    out = {name: tiny_archs.write(tmp_path / f"base-{name}.gguf", name, seed=1) for name in tiny_archs.NAMES}
    from toy_vit.config import ViTConfig
    from toy_vit.gguf_io import write_gguf
    from toy_vit.train import init_params

    cfg = ViTConfig.preset("vit-micro", labels=("a", "b", "c"))
    out["vit"] = write_gguf(tmp_path / "base-vit.gguf", cfg, init_params(cfg, 1))
    return out


def build_cases(tmp_path: Path, n_per_model: int, seed: int = SEED) -> list[tuple[str, str, str, list[str]]]:
    """Mutated files: (path, arch, description, the names a message may cite)."""
    rng = np.random.default_rng(seed)
    cases = []
    for arch, base in base_models(tmp_path).items():
        data = base.read_bytes()
        with GGUFFile(base) as f:
            meta = metadata_mutations(rng, f)
            raw = byte_mutations(data, f)
            names = sorted(set(f.metadata) | set(f.tensors))
        # half from each family of mutations, drawn without replacement
        picks = [("meta", meta[int(j)]) for j in rng.permutation(len(meta))[: n_per_model // 2]]
        picks += [("raw", raw[int(j)]) for j in rng.permutation(len(raw))[: n_per_model - len(picks)]]
        for kind, (desc, change) in picks:
            p = tmp_path / f"m{len(cases):04d}.gguf"
            if kind == "meta":
                try:
                    rewrite(base, p, change)
                except ValueError:  # a value the writer cannot store in that type: not a file
                    continue
            else:
                b = bytearray(data)
                for off, patch in change:
                    b[off : off + len(patch)] = patch
                p.write_bytes(bytes(b))
            cases.append((str(p), arch, f"{arch}: {desc}", names))
    return cases


def names_something(message: str, names: list[str]) -> bool:
    """The message cites a metadata key, a tensor, an offset, or the header
    field (the reader names the byte or the version)."""
    return any(w in message for w in ("offset", "at byte", "GGUF version")) or any(n in message for n in names)


# ---------------------------------------------------------------- the tests


def test_mutated_model_files_fail_cleanly(tmp_path):
    cases = build_cases(tmp_path, CASES_PER_MODEL)
    assert len(cases) >= 300
    results = run_children(tmp_path, [(p, a) for p, a, _, _ in cases])
    by_path = {c[0]: c for c in cases}
    problems = []
    for r in results:
        path, arch, desc, names = by_path[r["case"][0]]
        if r["outcome"] == "internal":
            problems.append(f"{desc}: internal {r['type']}: {r['message']}")
        elif r["outcome"] == "bad_input" and r["phase"] == "load" and not names_something(r["message"], names):
            # a file that loads may still fail to run (garbage weights give NaN logits: a SamplingError)
            problems.append(f"{desc}: the message names no key, tensor or offset: {r['message']}")
        if r["seconds"] > CASE_S:
            problems.append(f"{desc}: took {r['seconds']:.1f} s")
    peak = max(r["peak_rss"] for r in results)
    assert not problems, "\n".join(problems[:40]) + f"\n({len(problems)} problems in {len(results)} cases)"
    assert peak <= RSS_BOUND, f"a fuzz child peaked at {peak / 2**20:.0f} MiB"
    outcomes = [r["outcome"] for r in results]
    # the mutations bite: most cases are refused, some still load
    assert outcomes.count("bad_input") > len(outcomes) // 2, outcomes.count("bad_input")
    assert outcomes.count("ok") > 0


BAD_FOR_CLI = [
    ("llama", {"llama.block_count": ((1 << 31) - 1, TypeInfo(ValueType.UINT32))}, "llama.block_count = 2147483647"),
    ("gpt2", {"gpt2.block_count": (0, TypeInfo(ValueType.UINT32))}, "gpt2.block_count = 0"),
    ("gemma2", {"gemma2.feed_forward_length": (48, TypeInfo(ValueType.UINT32))}, "gemma2.feed_forward_length = 48"),
    ("qwen3moe", {"qwen3moe.expert_count": (1 << 40, TypeInfo(ValueType.UINT64))}, "qwen3moe.expert_count"),
]


def toy_cli(*args) -> subprocess.CompletedProcess:
    """``toy ARGS`` in a child under RLIMIT_AS and a timeout (a regression
    must fail the test, not hang it or exhaust the machine)."""
    main = "import sys; from toy_cli.main import main; sys.exit(main(sys.argv[1:]))"
    try:
        return subprocess.run([sys.executable, "-c", main, *map(str, args)], preexec_fn=_limit_memory,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"toy {' '.join(map(str, args))} ran past 120 s")


@pytest.mark.parametrize("arch,change,fragment", BAD_FOR_CLI, ids=[c[0] for c in BAD_FOR_CLI])
def test_the_cli_prints_an_error_line_for_bad_model_files(tmp_path, arch, change, fragment):
    from toy_testsupport.cli_helpers import assert_clean_error

    bad = rewrite(tiny_archs.write(tmp_path / "base.gguf", arch), tmp_path / "bad.gguf", change)
    p = toy_cli("infer", bad, "-p", "ab", "-n", "1", "--threads", "1", "--device", "cpu")
    assert_clean_error(p.returncode, p.stderr, 2, fragment, hint=True)
    p = toy_cli("describe", bad)  # describe reads the metadata only: it shows the file, or says what it cannot
    assert p.returncode in (0, 2) and "Traceback" not in p.stderr, p.stderr
