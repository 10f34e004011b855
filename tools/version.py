#!/usr/bin/env python3
"""The packages' version, which moves in lockstep.

Every distribution under ``packages/`` has the same version, written in:

- ``[project] version`` of its ``pyproject.toml``;
- the pins on the other toy distributions in its dependencies and extras
  (``toy-core==0.1.0``): always ``==`` the same version;
- ``__version__ = "..."`` in its import package's ``__init__.py``;
- ``project(..., version: '...')`` in its ``meson.build``, where it has one.

``check`` reports every place that differs from the version most packages
have (exit status 1), ``bump NEW`` rewrites them all, ``show`` prints the
version. The packages are whatever ``packages/*/pyproject.toml`` holds.

Usage: ``python tools/version.py [check | show | bump NEW]``.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

ROOT = Path(__file__).resolve().parent.parent
VERSION_RE = r"\d+(?:\.\d+)*(?:(?:a|b|rc)\d+)?(?:\.post\d+)?(?:\.dev\d+)?"


@dataclass(frozen=True)
class Place:
    """One written copy of the version: file, a regex whose group 1 is the
    version, and what it is (for the report)."""

    path: Path
    pattern: str
    what: str

    def read(self) -> list[str]:
        return re.findall(self.pattern, self.path.read_text(encoding="utf-8"), flags=re.M)

    def write(self, new: str) -> None:
        text = self.path.read_text(encoding="utf-8")

        def repl(m: re.Match) -> str:
            return m.group(0)[: m.start(1) - m.start(0)] + new + m.group(0)[m.end(1) - m.start(0) :]

        self.path.write_text(re.sub(self.pattern, repl, text, flags=re.M), encoding="utf-8")


def _project_table(text: str) -> str:
    """The ``[project]`` table's text (up to the next table header)."""
    m = re.search(r"^\[project\]\s*$(.*?)(?=^\[(?!project\.optional-dependencies\])|\Z)", text, flags=re.M | re.S)
    return m.group(1) if m else ""


def packages(root: Path = ROOT) -> dict[str, Path]:
    """Distribution name -> its folder, for every ``packages/*/pyproject.toml``."""
    out = {}
    for pp in sorted((root / "packages").glob("*/pyproject.toml")):
        m = re.search(r'^name\s*=\s*"([^"]+)"', _project_table(pp.read_text(encoding="utf-8")), flags=re.M)
        if m:
            out[m.group(1)] = pp.parent
    return out


def places(root: Path = ROOT) -> list[Place]:
    pkgs = packages(root)
    names = "|".join(re.escape(n) for n in sorted(pkgs, key=len, reverse=True))
    out: list[Place] = []
    for folder in pkgs.values():
        pp = folder / "pyproject.toml"
        rel = pp.relative_to(root)
        out.append(Place(pp, rf'^version\s*=\s*"({VERSION_RE})"', f"{rel}: [project] version"))
        if names:
            # a pin on another toy distribution, in dependencies or an extra ("toy-core==0.1.0", "toy-serve[x]==...")
            out.append(
                Place(pp, rf'"(?:{names})(?:\[[^\]]*\])?\s*==\s*({VERSION_RE})\s*(?:;[^"]*)?"', f"{rel}: toy pin")
            )
        for init in sorted(folder.glob("src/*/__init__.py")):
            out.append(
                Place(init, rf'^__version__\s*=\s*["\']({VERSION_RE})["\']', f"{init.relative_to(root)}: __version__")
            )
        meson = folder / "meson.build"
        if meson.is_file():
            out.append(
                Place(
                    meson, rf"^project\([^)]*?version\s*:\s*'({VERSION_RE})'", f"{meson.relative_to(root)}: project()"
                )
            )
    return out


def unpinned(root: Path = ROOT) -> list[str]:
    """Requirements on a toy distribution that are not an exact ``==`` pin."""
    if tomllib is None:
        return []
    pkgs = packages(root)
    bad = []
    for folder in pkgs.values():
        pp = folder / "pyproject.toml"
        project = tomllib.loads(pp.read_text(encoding="utf-8")).get("project", {})
        reqs = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            reqs += extra
        for req in reqs:
            m = re.match(r"\s*([A-Za-z0-9._-]+)", req)
            name = m.group(1).lower().replace("_", "-") if m else ""
            if name in pkgs and not re.match(
                rf"\s*{re.escape(m.group(1))}(\[[^\]]*\])?\s*=={VERSION_RE}\s*(;.*)?$", req
            ):
                bad.append(f"{pp.relative_to(root)}: {req!r} is not an exact pin (use {name}==VERSION)")
    return bad


def current(root: Path = ROOT) -> str:
    """The version: the one most packages' ``[project] version`` has (the
    first package's on a tie), so a report names the odd ones out."""
    versions = []
    for folder in packages(root).values():
        pp = folder / "pyproject.toml"
        found = Place(pp, rf'^version\s*=\s*"({VERSION_RE})"', "").read()
        if not found:
            raise SystemExit(f"error: {pp.relative_to(root)} has no static [project] version")
        versions.append(found[0])
    if not versions:
        raise SystemExit("error: no packages/*/pyproject.toml")
    return max(versions, key=lambda v: (versions.count(v), -versions.index(v)))


def problems(root: Path = ROOT) -> list[str]:
    want = current(root)
    out = []
    for place in places(root):
        found = place.read()
        if not found and "toy pin" not in place.what:
            out.append(f"{place.what}: no version found")
        for v in found:
            if v != want:
                out.append(f"{place.what}: {v} (want {want})")
    return out + unpinned(root)


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    ap = argparse.ArgumentParser(description="check or bump the packages' lockstep version")
    sub = ap.add_subparsers(dest="cmd")
    sub.add_parser("check", help="fail if any package, pin, __version__ or meson project() differs")
    sub.add_parser("show", help="print the version")
    b = sub.add_parser("bump", help="write a new version everywhere")
    b.add_argument("new")
    args = ap.parse_args(argv)
    if args.cmd == "show":
        print(current(root))
        return 0
    if args.cmd == "bump":
        if not re.fullmatch(VERSION_RE, args.new):
            print(f"error: {args.new!r} is not a version (like 0.2.0 or 0.2.0rc1)", file=sys.stderr)
            return 1
        for place in places(root):
            place.write(args.new)
    bad = problems(root)
    if bad:
        for line in bad:
            print(f"error: {line}", file=sys.stderr)
        return 1
    print(f"version {current(root)}: every package, pin, __version__ and meson project() agrees")
    return 0


if __name__ == "__main__":
    sys.exit(main())
