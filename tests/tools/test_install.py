"""tools/install.py and tools/dist.py: the pieces that need no build (what a wheel is built from, wheel lookup, argument errors)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"toy_tool_{name}", ROOT / f"tools/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


install = _load("install")
dist = _load("dist")


def test_package_files_are_the_sources_without_tests():
    files = [p.relative_to(ROOT).as_posix() for p in install.package_files(["toy-ggml", "toy-core", "toy-cli"])]
    assert "packages/toy-core/pyproject.toml" in files
    assert "packages/toy-ggml/meson.build" in files
    assert "packages/toy-cli/src/toy_cli/main.py" in files
    assert not [f for f in files if f.split("/")[2] in ("tests", "benchmarks")]
    assert not [f for f in files if "/subprojects/ggml/" in f or f.endswith((".so", ".pyc"))]  # ignored: not inputs
    assert not [f for f in files if f.startswith("packages/toy-serve/")]


def test_no_wheel_carries_test_only_code(capsys):
    """The reference implementations and test helpers are the test-support package (tests/support/,
    ``toy_testsupport``): toy-core's wheel has no ``toy/reference``, and no wheel is built from tests/support."""
    from setuptools import find_namespace_packages

    every = sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))
    assert "toy-core" in every and (ROOT / "tests/support/pyproject.toml").is_file()
    files = [p.relative_to(ROOT).as_posix() for p in install.package_files(every)]
    assert "packages/toy-core/src/toy/__init__.py" in files
    assert not [f for f in files if "/toy/reference/" in f or "toy_testsupport" in f]
    # what setuptools packs into toy-core's wheel ([tool.setuptools.packages.find] where = ["src"]; pyproject
    # configuration finds namespace packages too, so a leftover folder without __init__.py would count)
    found = find_namespace_packages(str(ROOT / "packages/toy-core/src"))
    assert "toy" in found and "toy.models" in found
    assert not [p for p in found if p == "toy.reference" or p.startswith("toy.reference.")], found
    # tools/dist.py builds the folders under packages/ only: tests/support is not one of them
    assert dist.main(["--out", "build/never", "support"]) == 1
    err = capsys.readouterr().err
    assert f"(have: {', '.join(every)})" in err and "support" not in err.split("(have:")[1]
    assert not (ROOT / "build/never").exists()


def test_digest_follows_the_files():
    a = install.digest(["toy-cli"])
    assert a == install.digest(["toy-cli"])
    assert a != install.digest(["toy-cli", "toy-core"])


def test_find_wheels(tmp_path):
    for name in ("toy_ggml-0.1.0-cp311-cp311-linux_x86_64.whl", "toy_core-0.1.0-cp311-cp311-linux_x86_64.whl"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "toy_core-0.1.0.tar.gz").write_bytes(b"")
    got = install.find_wheels(tmp_path, ["toy-ggml", "toy-core"])
    assert [p.name.split("-")[0] for p in got] == ["toy_ggml", "toy_core"]
    with pytest.raises(install.InstallError, match="no wheel for toy-cli"):
        install.find_wheels(tmp_path, ["toy-cli"])
    (tmp_path / "toy_core-0.0.9-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
    with pytest.raises(install.InstallError, match="2 wheels for toy-core"):
        install.find_wheels(tmp_path, ["toy-core"])


def test_install_from_a_folder_without_wheels_fails_cleanly(tmp_path, capsys):
    rc = install.main(["--venv", str(tmp_path / "venv"), "--wheels", str(tmp_path)])
    assert rc == 1
    assert "error: no wheel for toy-ggml" in capsys.readouterr().err


def test_dist_refuses_an_unknown_package(capsys):
    assert dist.main(["--out", "build/never", "toy-nothing"]) == 1
    assert "error: no such package under packages/: toy-nothing" in capsys.readouterr().err
    assert not (ROOT / "build/never").exists()


def test_vit_and_serve_ask_for_their_wheels(tmp_path, capsys):
    for name in ("toy_ggml", "toy_core", "toy_cli", "toy_serve"):
        (tmp_path / f"{name}-0.1.0-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
    rc = install.main(["--venv", str(tmp_path / "venv"), "--wheels", str(tmp_path), "--serve", "--vit"])
    assert rc == 1
    assert "error: no wheel for toy-vit" in capsys.readouterr().err
    assert not (tmp_path / "venv").exists()  # the wheels are looked up before anything is created
