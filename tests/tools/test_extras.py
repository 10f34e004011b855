"""toy.extras.install_command: the install hint for each way toy can be installed.

The distributions are fakes (``importlib.metadata.distribution`` patched in
``toy.extras``) with the ``direct_url.json`` pip writes (PEP 610), and the
environment, ``PATH`` and working folder are temporary ones, so every case runs
whatever the dev environment is. The hinted commands themselves are run in
real environments by test_install_e2e.py.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata

import pytest

from toy import extras


class FakeDist:
    def __init__(self, direct_url: dict | None):
        self.direct_url = direct_url

    def read_text(self, name):
        assert name == "direct_url.json"
        return None if self.direct_url is None else json.dumps(self.direct_url)


def wheel_url(path) -> dict:
    return {"url": path.as_uri(), "archive_info": {"hash": "sha256=00"}}


@pytest.fixture
def checkout(tmp_path):
    """A checkout as toy.extras recognises one: tools/install.py, a justfile, requirements/dev.txt."""
    root = tmp_path / "checkout"
    (root / "tools").mkdir(parents=True)
    (root / "tools" / "install.py").write_text("")
    (root / "justfile").write_text("")
    (root / "requirements").mkdir()
    (root / "requirements" / "dev.txt").write_text("pytest>=8\n# plotting\nmatplotlib>=3.8\n")
    (root / "packages" / "toy-core").mkdir(parents=True)
    return root


@pytest.fixture
def env(monkeypatch, tmp_path):
    """Set up the fake installation: ``env(prefix, {dist: direct_url or None}, path_first=bool)``."""

    def make(prefix, dists, path_first=True):
        prefix.mkdir(parents=True, exist_ok=True)
        monkeypatch.setattr(sys, "prefix", str(prefix))
        other = str(tmp_path / "elsewhere-bin")
        monkeypatch.setenv("PATH", f"{prefix / 'bin'}:{other}" if path_first else f"{other}:{prefix / 'bin'}")

        def distribution(name):
            if name not in dists:
                raise metadata.PackageNotFoundError(name)
            return FakeDist(dists[name])

        monkeypatch.setattr(extras.metadata, "distribution", distribution)

    return make


def stamp(prefix, **rec):
    (prefix / ".toy-install.json").write_text(json.dumps(rec))


def test_a_checkout_install_asks_the_installer_again_keeping_the_extras_it_has(checkout, env, monkeypatch, tmp_path):
    prefix = checkout / ".venv"
    cache_wheel = tmp_path / "cache" / "toy-core" / "0123456789abcdef" / "toy_core-0.1.0-py3-none-any.whl"
    env(prefix, {"toy-core": wheel_url(cache_wheel), "toy-cli": wheel_url(cache_wheel), "toy-serve": None})
    stamp(prefix, source="checkout", checkout=str(checkout), extras=["serve"])
    monkeypatch.chdir(checkout)
    assert extras.install_command("vit") == "just install --serve --vit"
    assert extras.install_command("serve") == "just install --serve"
    assert extras.install_command("plot") == "just install --serve --plot"
    monkeypatch.chdir(tmp_path)
    assert extras.install_command("vit") == f"cd {checkout} && just install --serve --vit"


def test_a_checkout_install_into_another_venv_names_it(checkout, env, monkeypatch, tmp_path):
    prefix = tmp_path / "other venv"
    w = checkout / "build" / "wheels" / "toy-core" / "0123456789abcdef" / "toy_core-0.1.0-py3-none-any.whl"
    env(prefix, {"toy-core": wheel_url(w), "toy-vit": None, "matplotlib": None})
    stamp(prefix, source="checkout", checkout=str(checkout))
    monkeypatch.chdir(checkout)
    assert extras.install_command("serve") == f"just install --venv '{prefix}' --serve --vit --plot"
    inside = checkout / "build" / "venv"
    env(inside, {"toy-core": wheel_url(w)})
    assert extras.install_command("serve") == "just install --venv build/venv --serve"


def test_a_wheel_from_the_checkout_cache_without_a_record_is_still_a_checkout(checkout, env, monkeypatch):
    w = checkout / "build" / "wheels" / "toy-core" / "0123456789abcdef" / "toy_core-0.1.0-py3-none-any.whl"
    env(checkout / ".venv", {"toy-core": wheel_url(w)})
    monkeypatch.chdir(checkout)
    assert extras.install_command("plot") == "just install --plot"


def test_an_editable_install_is_the_dev_environment(checkout, env, monkeypatch, tmp_path):
    url = {"url": (checkout / "packages" / "toy-core").as_uri(), "dir_info": {"editable": True}}
    env(checkout / ".venv", {"toy-core": url})
    monkeypatch.chdir(checkout)
    assert extras.install_command("serve") == "just setup"
    assert extras.install_command("vit") == "just setup"
    assert extras.install_command("plot") == "just setup"  # matplotlib is a dev requirement
    monkeypatch.chdir(tmp_path)
    assert extras.install_command("serve") == f"cd {checkout} && just setup"
    # a dev environment whose requirements lack matplotlib: `just setup` would not bring it
    (checkout / "requirements" / "dev.txt").write_text("pytest>=8\nmatplotlib-inline\n")
    assert extras.install_command("plot") == "pip install 'toy-cli[plot]'"


def test_wheels_from_a_folder_are_found_there_again(env, monkeypatch, tmp_path):
    dist = tmp_path / "proj" / "dist"
    dist.mkdir(parents=True)
    w = dist / "toy_core-0.1.0-cp311-cp311-linux_x86_64.whl"
    env(tmp_path / "venv", {"toy-core": wheel_url(w)})
    stamp(tmp_path / "venv", source="wheels", checkout=str(tmp_path / "gone"), wheels=str(dist))
    monkeypatch.chdir(tmp_path / "venv")
    assert extras.install_command("serve") == "pip install --find-links ../proj/dist 'toy-cli[serve]'"
    monkeypatch.chdir(tmp_path / "proj")
    assert extras.install_command("vit") == "pip install --find-links dist 'toy-cli[vit]'"


def test_an_index_install_names_the_pip_extra(env, monkeypatch, tmp_path):
    env(tmp_path / "venv", {"toy-core": None, "toy-cli": None})
    monkeypatch.chdir(tmp_path)
    assert extras.install_command("serve") == "pip install 'toy-cli[serve]'"
    assert extras.install_command("vit") == "pip install 'toy-cli[vit]'"
    assert extras.install_command("plot") == "pip install 'toy-cli[plot]'"
    # toy-core's metadata missing: toy-cli's answers (here a plain index install too)
    env(tmp_path / "venv", {"toy-cli": None})
    assert extras.install_command("plot") == "pip install 'toy-cli[plot]'"


def test_pip_is_this_environments_when_another_comes_first_on_path(env, monkeypatch, tmp_path):
    prefix = tmp_path / "a" / "venv"
    env(prefix, {"toy-core": None}, path_first=False)
    monkeypatch.chdir(tmp_path / "a")
    assert extras.install_command("serve") == "venv/bin/pip install 'toy-cli[serve]'"
    deep = tmp_path / "b"
    while 3 * len(deep.relative_to(tmp_path).parts) + len("a/venv/bin/pip") <= len(f"{prefix}/bin/pip"):
        deep = deep / "c"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)  # ../../(...)/a/venv/bin/pip is longer than the absolute path
    assert extras.install_command("serve") == f"{prefix}/bin/pip install 'toy-cli[serve]'"


def test_an_unknown_extra_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown extra 'gpu'"):
        extras.install_command("gpu")
