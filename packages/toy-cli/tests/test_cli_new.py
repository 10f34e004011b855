"""`toy new`: project scaffolds, and the commands that read toy.toml
(real processes, as a new user runs them).

The cold start: scaffold a --lib project, train a few steps from its starter
config inside it (the run lands in the project's runs/ with the project's
seed), infer from the checkpoint, infer with the project's default model
from a subfolder, run the project's own test. Then the refusals: a
non-empty folder, a --lib name that is no identifier, a bad toy.toml.
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from toy_cli.commands import new as new_cmd

TOY = [sys.executable, "-m", "toy_cli"]
PKG = Path(__file__).resolve().parents[1]


def run(args, cwd, tmp_path, timeout=300, cmd=TOY):
    env = {k: v for k, v in os.environ.items() if k not in ("TOY_RUNS_DIR", "TOY_DEVICE", "TOY_THREADS")}
    # HOME bounds the toy.toml search (nothing above tmp_path is read)
    env |= {"TOY_HOME": str(tmp_path / "home"), "HOME": str(tmp_path)}
    return subprocess.run(cmd + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_cold_start(tmp_path):
    r = run(["new", "tale-lab", "--lib"], tmp_path, tmp_path)
    assert r.returncode == 0, r.stderr
    proj = tmp_path / "tale-lab"
    for rel in ("toy.toml", "README.md", ".gitignore", "configs/from-scratch.toml", "configs/lora.toml"):
        assert (proj / rel).is_file(), rel
    for rel in ("data/sample.txt", "data/chat.jsonl", "pyproject.toml", "src/tale_lab/__init__.py"):
        assert (proj / rel).is_file(), rel
    assert (proj / "tests" / "test_tale_lab.py").is_file() and (proj / "runs").is_dir()
    assert set(r.stdout.split()) == {
        str(Path("tale-lab") / p.relative_to(proj)) for p in proj.rglob("*") if p.is_file()
    }
    toml = tomllib.loads((proj / "toy.toml").read_text())
    assert toml["project"]["name"] == "tale_lab"  # with --lib, the package name and toml["project"]["runs"] == "runs"
    # every starter config is a valid config of its recipe (read with toy's own loader)
    from toy.train import config as C

    assert C.load_toml(proj / "configs" / "from-scratch.toml").recipe == "from-scratch"
    assert C.load_toml(proj / "configs" / "lora.toml", recipe="lora").lora.rank == 8

    (proj / "toy.toml").write_text((proj / "toy.toml").read_text().replace("seed = 0", "seed = 11"))
    fast = ["--steps", "3", "--eval-every", "0", "--save-every", "0", "--threads", "1", "--json"]
    r = run(["train", "from-scratch", "-c", "configs/from-scratch.toml", *fast], proj, tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    run_dir = Path(out["run_dir"])
    assert run_dir.parent == (proj / "runs").resolve()
    assert json.loads((run_dir / "config.json").read_text())["seed"] == 11  # the project's seed
    ckpt = run_dir / "checkpoints" / "latest"
    assert ckpt.is_file()

    gen = ["--greedy", "--ignore-eos", "-n", "6", "--json", "--threads", "1"]
    r = run(["infer", str(ckpt), "-p", "The for statement", *gen], proj, tmp_path)
    assert r.returncode == 0, r.stderr
    explicit = json.loads(r.stdout)["tokens"]
    assert len(explicit) == 6

    # the project's model, from a subfolder, without MODEL: the same tokens
    rel = ckpt.relative_to(proj.resolve())
    text = (proj / "toy.toml").read_text().replace('model = "smollm2-135m"', f'model = "{rel.as_posix()}"')
    (proj / "toy.toml").write_text(text)
    r = run(["infer", "-p", "The for statement", *gen], proj / "data", tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == explicit

    # `toy runs list` from a subfolder reads the project's runs
    r = run(["runs", "list", "--json"], proj / "src", tmp_path)
    assert r.returncode == 0, r.stderr
    assert out["run_id"] in r.stdout

    # the library project's own test, with plain pytest
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "pt")]
    r = run([], proj, tmp_path, cmd=pytest_cmd)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 passed" in r.stdout


def test_refuses_a_non_empty_folder_then_force_keeps_files(tmp_path):
    proj = tmp_path / "notes"
    proj.mkdir()
    (proj / "README.md").write_text("mine\n")
    r = run(["new", "notes"], tmp_path, tmp_path)
    assert r.returncode == 2
    assert "error: notes is not empty" in r.stderr and "hint:" in r.stderr and "--force" in r.stderr
    assert sorted(p.name for p in proj.iterdir()) == ["README.md"]

    r = run(["new", "notes", "--force"], tmp_path, tmp_path)
    assert r.returncode == 0, r.stderr
    assert (proj / "README.md").read_text() == "mine\n"  # kept as it was
    assert f"{Path('notes') / 'README.md'} (kept: it was there)" in r.stdout
    assert (proj / "toy.toml").is_file() and (proj / "data" / "sample.txt").is_file()
    assert not (proj / "pyproject.toml").exists()  # no --lib, no package


def test_lib_name_must_be_an_identifier(tmp_path):
    r = run(["new", "3d-lab", "--lib"], tmp_path, tmp_path)
    assert r.returncode == 2
    assert "error: '3d_lab' is not a Python package name" in r.stderr and "--name" in r.stderr
    assert not (tmp_path / "3d-lab").exists()
    r = run(["new", "3d-lab", "--lib", "--name", "lab3d"], tmp_path, tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "3d-lab" / "src" / "lab3d" / "__init__.py").is_file()


def test_a_file_is_not_a_folder(tmp_path):
    (tmp_path / "f").write_text("x")
    r = run(["new", "f"], tmp_path, tmp_path)
    assert r.returncode == 2 and "error: f is a file" in r.stderr


def test_bad_toy_toml_is_an_error_naming_key_and_file(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "toy.toml").write_text("[project]\nrun = 'runs'\n")
    r = run(["runs", "list"], tmp_path / "p", tmp_path)
    assert r.returncode == 2
    assert "error:" in r.stderr and "project.run" in r.stderr and "toy.toml" in r.stderr
    assert "Traceback" not in r.stderr


def test_infer_without_a_model_outside_a_project(tmp_path):
    r = run(["infer", "-p", "hi"], tmp_path, tmp_path)
    assert r.returncode == 2
    assert "error: no model" in r.stderr and "toy.toml" in r.stderr


def test_templates_are_package_data():
    """Every template the command reads is in the folder and matched by the
    package-data globs of toy-cli's pyproject (so the wheel carries it)."""
    globs = tomllib.loads((PKG / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["toy_cli"]
    templates = PKG / "src" / "toy_cli" / "templates"
    on_disk = {p.relative_to(templates.parent).as_posix() for p in templates.rglob("*") if p.is_file()}
    used = {f"templates/{t}" for t in (new_cmd.PROJECT_FILES | new_cmd.LIB_FILES)}
    assert used <= on_disk
    for f in on_disk:
        assert any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/") for g in globs), f


@pytest.mark.parametrize("lib", [False, True])
def test_scaffold_writes_what_the_table_says(tmp_path, lib):
    done = new_cmd.scaffold(tmp_path / "p", lib=lib)
    written = {p.relative_to(tmp_path / "p").as_posix() for p, w in done if w}
    want = set(new_cmd.PROJECT_FILES.values()) | {"data/sample.txt", "data/chat.jsonl"}
    if lib:
        want |= {v.replace("$name", "p") for v in new_cmd.LIB_FILES.values()}
    assert written == want
    assert "$name" not in (tmp_path / "p" / "README.md").read_text()
