"""toy.project: finding and reading toy.toml, and the defaults it gives
(runs folder, training seed/device/threads/base) with their precedence."""

from __future__ import annotations

from pathlib import Path

import pytest

from toy import project
from toy.errors import ConfigError
from toy.runs import runs_dir
from toy.train import config as C


def write(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / "toy.toml"
    p.write_text(text, encoding="utf-8")
    return p


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for key in ("TOY_RUNS_DIR", "TOY_DEVICE", "TOY_THREADS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # the search stops at home: no stray toy.toml above the test


def test_find_walks_up_to_the_nearest(tmp_path):
    outer = write(tmp_path / "a", '[project]\nname = "outer"\n')
    inner = write(tmp_path / "a" / "b", '[project]\nname = "inner"\n')
    deep = tmp_path / "a" / "b" / "c" / "d"
    deep.mkdir(parents=True)
    assert project.find(deep) == inner.resolve()
    assert project.find(tmp_path / "a") == outer.resolve()
    assert project.current(deep).name == "inner"
    assert project.find(tmp_path) is None  # nothing at or below the start's parents


def test_find_stops_at_home(tmp_path, monkeypatch):
    write(tmp_path, '[project]\nname = "above home"\n')
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    assert project.find(home / "work") is None
    write(home, "[project]\n")  # home itself is checked
    assert project.find(home / "work") == (home / "toy.toml").resolve()


def test_load_resolves_paths_from_the_file(tmp_path):
    p = write(tmp_path / "proj", '[project]\nruns = "out/runs"\nmodel = "models/m.gguf"\nseed = 7\nthreads = 2\n')
    pr = project.load(p)
    root = (tmp_path / "proj").resolve()
    assert pr.root == root
    assert pr.runs == root / "out" / "runs"
    assert pr.model == str(root / "models" / "m.gguf")
    assert (pr.seed, pr.threads, pr.device) == (7, 2, None)
    # a registry name stays a name; no runs key: <root>/runs
    pr = project.load(write(tmp_path / "p2", '[project]\nmodel = "smollm2-135m"\n'))
    assert pr.model == "smollm2-135m"
    assert pr.runs == (tmp_path / "p2").resolve() / "runs"


@pytest.mark.parametrize(
    ("text", "key", "words"),
    [
        ("[project]\nbogus = 1\n", "project.bogus", "unknown key 'project.bogus'"),
        ('[project]\nseed = "zero"\n', "project.seed", "is not an integer"),
        ("[project]\nseed = true\n", "project.seed", "is not an integer"),
        ("[project]\nruns = 3\n", "project.runs", "is not a string"),
        ("[project]\nthreads = 0\n", "project.threads", "must be >= 1"),
        ('[project]\nmodel = "  "\n', "project.model", "is empty"),
        ("[train]\nsteps = 1\n", "train", "unknown key 'train'"),
        ("project = 1\n", "project", "must be a table"),
    ],
)
def test_bad_files_name_the_key_and_the_file(tmp_path, text, key, words):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        project.load(p)
    assert e.value.field == key
    assert str(p) in str(e.value) and words in str(e.value)


def test_not_toml(tmp_path):
    p = write(tmp_path, "[project\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        project.load(p)


def test_runs_dir_precedence(tmp_path, monkeypatch):
    root = tmp_path / "proj"
    write(root, '[project]\nruns = "my-runs"\n')
    (root / "sub").mkdir()
    monkeypatch.chdir(root / "sub")
    assert runs_dir() == root.resolve() / "my-runs"  # the project's, from a subfolder
    monkeypatch.setenv("TOY_RUNS_DIR", str(tmp_path / "env"))
    assert runs_dir() == tmp_path / "env"  # the environment over the project
    assert runs_dir(tmp_path / "given") == tmp_path / "given"  # the argument over both
    monkeypatch.delenv("TOY_RUNS_DIR")
    monkeypatch.chdir(tmp_path)
    assert runs_dir() == Path("runs")  # outside any project


def test_train_defaults_sit_between_the_defaults_and_the_file(tmp_path, monkeypatch):
    pr = project.load(write(tmp_path, '[project]\nseed = 5\nmodel = "base.gguf"\ndevice = "cpu"\nthreads = 3\n'))
    assert C.defaults(under=pr.train_defaults("from-scratch")).seed == 5
    assert C.defaults(under=pr.train_defaults("from-scratch")).base is None  # no base for from-scratch
    lora = C.defaults("lora", under=pr.train_defaults("lora"))
    assert lora.base == str(tmp_path.resolve() / "base.gguf") and lora.threads == 3 and lora.device == "cpu"
    cfg = tmp_path / "run.toml"
    cfg.write_text("seed = 9\nsteps = 2\n")
    assert C.load_toml(cfg, under=pr.train_defaults("from-scratch")).seed == 9  # the file over the project
    monkeypatch.setenv("TOY_THREADS", "1")
    monkeypatch.setenv("TOY_DEVICE", "cpu")
    assert "threads" not in pr.train_defaults("lora") and "device" not in pr.train_defaults("lora")
