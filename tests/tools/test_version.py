"""tools/version.py (the lockstep version) on synthetic trees, and the packages' metadata on the real one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("toy_version_tool", ROOT / "tools/version.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


V = _load()

PYPROJECT = """[build-system]
requires = ["setuptools>=77"]

[project]
name = "{name}"
version = "{version}"
dependencies = [{deps}]

[project.optional-dependencies]
{extras}
"""


def _tree(tmp_path: Path, *, core="0.1.0", cli="0.1.0", pin="==0.1.0", init="0.1.0", meson="0.1.0", extra="==0.1.0"):
    def pkg(folder, name, version, deps="", extras="", module=None, init_version=None):
        d = tmp_path / "packages" / folder
        d.mkdir(parents=True)
        (d / "pyproject.toml").write_text(PYPROJECT.format(name=name, version=version, deps=deps, extras=extras))
        if module:
            (d / "src" / module).mkdir(parents=True)
            (d / "src" / module / "__init__.py").write_text(f'"""doc"""\n\n__version__ = "{init_version}"\n')
        return d

    g = pkg("toy-ggml", "toy-ggml", "0.1.0", deps='"numpy>=1.26"', module="toy_ggml", init_version="0.1.0")
    (g / "meson.build").write_text(f"project('toy-ggml', 'c',\n  version: '{meson}',\n  meson_version: '>= 1.2.0')\n")
    pkg("toy-core", "toy-core", core, deps='"toy-ggml==0.1.0", "numpy>=1.26"', module="toy", init_version=init)
    pkg(
        "toy-cli",
        "toy-cli",
        cli,
        deps=f'"toy-core{pin}"',
        extras=f'serve = ["toy-serve{extra}"]',
        module="toy_cli",
        init_version="0.1.0",
    )
    pkg("toy-serve", "toy-serve", "0.1.0", deps='"toy-core==0.1.0"')
    return tmp_path


def test_a_consistent_tree_passes(tmp_path):
    root = _tree(tmp_path)
    assert set(V.packages(root)) == {"toy-ggml", "toy-core", "toy-cli", "toy-serve"}
    assert V.problems(root) == []


@pytest.mark.parametrize(
    "kw, fragment",
    [
        ({"cli": "0.1.1"}, "packages/toy-cli/pyproject.toml: [project] version: 0.1.1 (want 0.1.0)"),
        ({"pin": "==0.0.9"}, "packages/toy-cli/pyproject.toml: toy pin: 0.0.9 (want 0.1.0)"),
        ({"extra": "==0.0.9"}, "packages/toy-cli/pyproject.toml: toy pin: 0.0.9 (want 0.1.0)"),
        ({"init": "0.1.0.dev1"}, "packages/toy-core/src/toy/__init__.py: __version__: 0.1.0.dev1 (want 0.1.0)"),
        ({"meson": "0.2.0"}, "packages/toy-ggml/meson.build: project(): 0.2.0 (want 0.1.0)"),
        ({"pin": ">=0.1.0"}, "'toy-core>=0.1.0' is not an exact pin"),
        ({"extra": ""}, "'toy-serve' is not an exact pin"),
    ],
)
def test_every_place_is_checked(tmp_path, kw, fragment):
    bad = V.problems(_tree(tmp_path, **kw))
    assert any(fragment in line for line in bad), bad


def test_bump_writes_every_place(tmp_path):
    root = _tree(tmp_path)
    assert V.main(["bump", "0.2.0rc1"], root) == 0
    assert V.problems(root) == []
    assert V.current(root) == "0.2.0rc1"
    cli = (root / "packages/toy-cli/pyproject.toml").read_text()
    assert '"toy-core==0.2.0rc1"' in cli and '"toy-serve==0.2.0rc1"' in cli
    assert "version: '0.2.0rc1'" in (root / "packages/toy-ggml/meson.build").read_text()
    assert '__version__ = "0.2.0rc1"' in (root / "packages/toy-core/src/toy/__init__.py").read_text()
    assert '"numpy>=1.26"' in (root / "packages/toy-core/pyproject.toml").read_text()  # other pins untouched
    assert V.main(["bump", "not-a-version"], root) == 1


# ---------------------------------------------------------------- the real packages


def test_the_repository_versions_agree():
    assert V.problems() == []


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml")))
def test_package_metadata_is_complete(folder):
    d = ROOT / "packages" / folder
    project = tomllib.loads((d / "pyproject.toml").read_text())["project"]
    for key in (
        "name",
        "version",
        "description",
        "readme",
        "license",
        "license-files",
        "requires-python",
        "classifiers",
    ):
        assert project.get(key), f"{folder}: [project] {key} is missing"
    assert project["license"] == "MIT"
    assert (d / project["readme"]).is_file()
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # the SPDX expression says it
    assert "LICENSE" in project["license-files"]
    for name in project["license-files"]:
        assert (d / name).is_file(), f"{folder}: license file {name} is missing"
    # the package's LICENSE is the repository's (copied, because a license file must lie inside the package)
    assert (d / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()


def test_toy_cli_extras():
    extras = tomllib.loads((ROOT / "packages/toy-cli/pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("matplotlib") for r in extras["plot"])
    assert extras["serve"] == [f"toy-serve=={V.current()}"]
