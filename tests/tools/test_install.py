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


FIVE = ["x64", "haswell", "skylakex", "icelake", "zen4"]  # packages/toy-ggml/meson.options' cpu_variants


def test_each_package_has_its_own_digest():
    """The wheel cache key of a package is its own: toy-core's does not move with toy-ggml's build options."""
    a = install.package_digest("toy-cli")
    assert a == install.package_digest("toy-cli") and len(a) == 16
    assert a != install.package_digest("toy-core")
    assert install.package_digest("toy-core", ["x64"]) == install.package_digest("toy-core", FIVE)
    assert install.package_digest("toy-ggml", ["x64"]) != install.package_digest("toy-ggml", FIVE)
    assert install.package_digest("toy-ggml") == install.package_digest("toy-ggml", FIVE)


def test_cpu_variants():
    assert install.all_cpu_variants() == FIVE
    assert install.cpu_variants(None, None) == FIVE
    assert install.cpu_variants("haswell, x64", None) == ["x64", "haswell"]  # meson.options' order
    assert install.cpu_variants(None, ["x64", "haswell"]) == ["x64", "haswell"]  # as the environment was built
    assert install.cpu_variants("all", ["x64"]) == FIVE
    for bad, msg in [("x64,avx9", "unknown CPU variant 'avx9'"), (",", "no CPU variant named")]:
        with pytest.raises(install.InstallError, match=msg):
            install.cpu_variants(bad, None)


def test_an_unknown_cpu_variant_builds_nothing(tmp_path, capsys):
    rc = install.main(["--venv", str(tmp_path / "venv"), "--cache", str(tmp_path / "c"), "--cpu-variants", "x64,avx9"])
    assert rc == 1
    err = capsys.readouterr().err
    want = "error: --cpu-variants: unknown CPU variant 'avx9' (have: x64, haswell, skylakex, icelake, zen4, or all)"
    assert want in err
    assert "building" not in err and "ggml source" not in err
    assert not (tmp_path / "venv").exists() and not (tmp_path / "c").exists()


def test_build_progress_comes_from_ninjas_lines(tmp_path):
    log = tmp_path / "toy-ggml.log"
    log.write_text("$ pip wheel ...\n  Preparing metadata (pyproject.toml): started\n")
    assert install.progress(log) == ""
    with open(log, "a") as f:  # as pip -v shows the backend's output: indented
        f.write("  [3/33] Building CXX object src/CMakeFiles/ggml-base.dir/ggml-backend.cpp.o\n")
        f.write("  [4/33] Building C object src/CMakeFiles/ggml-base.dir/ggml.c.o\n")
    assert install.progress(log) == "[4/33] compiling ggml"
    with open(log, "a") as f:
        f.write("  [7/9] Linking target src/toy_ggml/_core.cpython-311-x86_64-linux-gnu.so\n  some other line\n")
    assert install.progress(log) == "[7/9] linking the bindings"
    with open(log, "a") as f:
        f.write("  [12/12] /work/main/packages/toy-ggml/src/toy_ggml/py.typed\n")
    assert install.progress(log) == "[12/12] packing the wheel"
    assert install.progress(tmp_path / "missing.log") == ""


def test_the_record_before_per_package_digests_counts_as_installed(tmp_path):
    old = '{"digest": "ab", "packages": ["toy-ggml", "toy-core", "toy-cli", "toy-vit"]}'
    (tmp_path / ".toy-install.json").write_text(old)
    pkgs, extras, variants = install.read_stamp(tmp_path)
    assert pkgs == {"toy-ggml": None, "toy-core": None, "toy-cli": None, "toy-vit": None}
    assert extras == ["vit"] and variants is None
    assert install.read_stamp(tmp_path / "nothing") == ({}, [], None)


def test_cpu_variants_do_not_go_with_prebuilt_wheels(tmp_path, capsys):
    rc = install.main(["--venv", str(tmp_path / "venv"), "--wheels", str(tmp_path), "--cpu-variants", "x64"])
    assert rc == 1
    assert "error: --cpu-variants chooses what to build" in capsys.readouterr().err
    assert not (tmp_path / "venv").exists()


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
