"""tools/install.py end to end, and every install hint toy prints, run as printed.

One slow test (several minutes: it compiles ggml once, one CPU variant). A
wheel cache under the test's temporary folder (``TOY_INSTALL_CACHE``) keeps
build/wheels out of it. The steps are a user's: install, add ``--serve
--vit``, go back to the plain install, then follow the hints that ``toy
serve`` / ``toy vit`` / the plot error print, in that environment (a checkout
install), in one installed from a wheel folder (``--wheels``) and in one
installed by name from an index (toy's wheels found through ``PIP_FIND_LINKS``,
the dependencies from the real index: no ``direct_url.json``, as from PyPI).

The bound on the steps after the first: a step that reuses the built wheels
is a few seconds of pip (about 25 s measured on a loaded 2-core box); a ggml
compile, even of one CPU variant, is minutes (2 to 4 min measured there). A
step over LATER_STEP_S means something was rebuilt; the build log says what.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LATER_STEP_S = 90.0
GGML_BUILD = "building the toy-ggml wheel"

pytestmark = pytest.mark.slow


def sh(cmd, cwd, env, timeout=1200):
    """Run a command (a list, or a shell line); its exit status, stdout + stderr and seconds."""
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        env=env,
        shell=isinstance(cmd, str),
        executable="/bin/bash" if isinstance(cmd, str) else None,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def installed(venv: Path) -> set[str]:
    """The toy distributions and matplotlib in ``venv``."""
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    names = {d["name"].lower().replace("_", "-") for d in json.loads(out)}
    return {n for n in names if n.startswith("toy-") or n == "matplotlib"}


def hint_of(output: str) -> str:
    found = re.findall(r"^hint: (.*)$", output, re.M)
    assert len(found) == 1, output
    return found[0]


def plot_hint(venv: Path, cwd: Path, env) -> str:
    """The hint a plot without matplotlib prints (toy runs plot and toy vit eval --plot share it)."""
    code, out, _ = sh(
        [str(venv / "bin" / "python"), "-c", "import toy.runs.plot as p; print(p.install_hint())"], cwd, env
    )
    assert code == 0, out
    return out.strip()


def test_install_extras_without_a_rebuild_and_every_hint_works(tmp_path):
    python3 = shutil.which("python3")  # what `just install` runs, so the hinted `just install` builds the same
    assert python3 and shutil.which("just"), "python3 and just are needed (CI has both)"
    cache = tmp_path / "cache" / "wheels"
    env = {**os.environ, "TOY_INSTALL_CACHE": str(cache)}
    env.pop("VIRTUAL_ENV", None)
    venv = tmp_path / "venv"
    outputs = []

    def step(*flags):
        code, out, secs = sh([python3, str(ROOT / "tools" / "install.py"), "--venv", str(venv), *flags], tmp_path, env)
        assert code == 0, out
        outputs.append(out)
        print(f"install {' '.join(flags) or '(plain)'}: {secs:.1f} s")  # the figures, with -s
        return out, secs

    out, first = step("--cpu-variants", "x64")
    assert GGML_BUILD in out and "CPU variants x64" in out
    # a first install: the environment and the dependencies come while ggml compiles
    assert "installing the runtime dependencies while ggml compiles" in out
    assert (cache.parent / "install-logs" / "toy-ggml.log").is_file()
    assert installed(venv) == {"toy-ggml", "toy-core", "toy-cli"}

    out, secs = step("--serve", "--vit")
    assert secs < LATER_STEP_S, (secs, out)
    assert installed(venv) == {"toy-ggml", "toy-core", "toy-cli", "toy-serve", "toy-vit"}
    assert "reusing the built toy-ggml wheel" in out and "reusing the built wheels of toy-core, toy-cli" in out

    out, secs = step()
    assert secs < LATER_STEP_S, (secs, out)
    assert installed(venv) == {"toy-ggml", "toy-core", "toy-cli"}
    assert "removing toy-serve (not asked for; `just install --serve` keeps it)" in out
    assert "removing toy-vit (not asked for; `just install --vit` keeps it)" in out

    out, secs = step()  # nothing asked changed: nothing to do
    assert "is up to date" in out and "installing" not in out

    # the checkout install's hints: run each as printed, from outside the checkout
    hint = plot_hint(venv, tmp_path, env)
    assert hint == f"cd {ROOT} && just install --venv {venv} --plot"
    code, out, secs = sh(hint, tmp_path, env)
    assert code == 0 and secs < LATER_STEP_S, (secs, out)
    outputs.append(out)
    assert installed(venv) == {"toy-ggml", "toy-core", "toy-cli", "matplotlib"}

    toy = str(venv / "bin" / "toy")
    for name, want in [("serve", "--serve --plot"), ("vit", "--serve --vit --plot")]:
        code, out, _ = sh([toy, name], tmp_path, env)
        assert code == 2 and f"error: 'toy {name}' is not installed" in out, out
        hint = hint_of(out)
        assert hint == f"cd {ROOT} && just install --venv {venv} {want}"
        code, out, secs = sh(hint, tmp_path, env)
        assert code == 0 and secs < LATER_STEP_S, (secs, out)
        outputs.append(out)
        code, out, _ = sh([toy, name, "--help"], tmp_path, env)
        assert code == 0, out
    assert installed(venv) == {"toy-ggml", "toy-core", "toy-cli", "toy-serve", "toy-vit", "matplotlib"}

    # ggml was compiled once, in the first step, and the cache holds that one build
    assert sum(o.count(GGML_BUILD) for o in outputs) == 1, "\n---\n".join(outputs)
    assert len([d for d in (cache / "toy-ggml").iterdir() if not d.name.startswith(".")]) == 1

    # the wheels as a folder (what `just dist` writes), for the two installs that are not a checkout's
    record = json.loads((venv / ".toy-install.json").read_text())
    folder = tmp_path / "wheelhouse"
    folder.mkdir()
    for pkg, dig in record["packages"].items():
        (wheel,) = (cache / pkg / dig).glob("*.whl")
        shutil.copy(wheel, folder)

    # installed from the folder (tools/install.py --wheels): pip finds the extras there
    wvenv = tmp_path / "wheels-venv"
    code, out, _ = sh(
        [python3, str(ROOT / "tools" / "install.py"), "--venv", str(wvenv), "--wheels", str(folder)], tmp_path, env
    )
    assert code == 0, out
    code, out, _ = sh([str(wvenv / "bin" / "toy"), "serve"], tmp_path, env)
    hint = hint_of(out)
    assert hint == "wheels-venv/bin/pip install --find-links wheelhouse 'toy-cli[serve]'"
    code, out, _ = sh(hint, tmp_path, env)
    assert code == 0, out
    code, out, _ = sh([str(wvenv / "bin" / "toy"), "serve", "--help"], tmp_path, env)
    assert code == 0, out

    # installed by name from an index: toy's wheels through PIP_FIND_LINKS, the rest from the real index
    ienv = {**env, "PIP_FIND_LINKS": " ".join(filter(None, [str(folder), os.environ.get("PIP_FIND_LINKS")]))}
    ivenv = tmp_path / "index-venv"
    code, out, _ = sh([python3, "-m", "venv", str(ivenv)], tmp_path, ienv)
    assert code == 0, out
    code, out, _ = sh([str(ivenv / "bin" / "python"), "-m", "pip", "install", "-q", "toy-cli==0.1.0"], tmp_path, ienv)
    assert code == 0, out
    toy = str(ivenv / "bin" / "toy")
    for name in ("serve", "vit"):
        code, out, _ = sh([toy, name], tmp_path, ienv)
        assert code == 2, out
        hint = hint_of(out)
        assert hint == f"index-venv/bin/pip install 'toy-cli[{name}]'"
        code, out, _ = sh(hint, tmp_path, ienv)
        assert code == 0, out
        code, out, _ = sh([toy, name, "--help"], tmp_path, ienv)
        assert code == 0, out
    hint = plot_hint(ivenv, tmp_path, ienv)
    assert hint == "index-venv/bin/pip install 'toy-cli[plot]'"
    code, out, _ = sh(hint, tmp_path, ienv)
    assert code == 0, out
    assert installed(ivenv) == {"toy-ggml", "toy-core", "toy-cli", "toy-serve", "toy-vit", "matplotlib"}
