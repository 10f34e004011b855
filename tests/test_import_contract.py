"""The import contract of docs/concepts/architecture.md, checked over the sources.

- toy-core's layers (errors < gguf, runs, corpus < tokenizer, models, store <
  adapters < engine < eval, train < merge): the ``.importlinter`` file at the
  repository root, run by import-linter's ``lint-imports``. Its graph (grimp)
  holds every import statement, function-level ones included, and the
  contract is exhaustive: a new child of ``toy`` must be given a layer.
- The facade: no module of ``toy`` imports the ``toy`` package itself for a
  name (``import toy``, ``from toy import load``). import-linter cannot say
  this: a layers contract does not cover its container's own ``__init__``,
  and a forbidden contract on ``toy`` would forbid every submodule too. The
  ast walk below does.
- Distributions: the import package of each ``packages/*/pyproject.toml``
  imports only the toy distributions that file declares in ``[project]
  dependencies`` (an extra may be absent, so it grants nothing), and no
  ``_private`` module or name of another distribution; an ast walk of the
  ``src`` trees (function-level and relative imports included) reads the
  declarations from the pyproject files.
- ``toy.reference`` (test-only NumPy references) is not in toy-core's wheel.

Each check also runs against a planted violation and must report it, so a
check that silently sees nothing fails here.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import grimp  # import-linter's graph builder (requirements/dev.txt)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "packages"
CORE_SRC = PACKAGES / "toy-core" / "src"
CONFIG = ROOT / ".importlinter"


# -- toy-core's layers (import-linter) -------------------------------------------------------------


def lint_imports(src: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with the repository's ``.importlinter`` over the ``toy`` package found in ``src``
    (first on the path, so a planted copy is the one analysed), without a cache."""
    env = {**os.environ, "PYTHONPATH": str(src), "NO_COLOR": "1", "COLUMNS": "250"}
    cmd = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"]
    return subprocess.run(
        [*cmd, str(CONFIG), "--no-cache", "--no-logo"],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_toy_core_keeps_its_layers():
    r = lint_imports(CORE_SRC)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 kept, 0 broken" in r.stdout


def test_grimp_sees_function_level_imports():
    """The graph import-linter checks holds imports made inside functions: the facade's lazy
    ``toy.load`` (``toy/__init__.py`` imports the engine in ``__getattr__`` only)."""
    graph = grimp.build_graph("toy", cache_dir=None)
    assert graph.direct_import_exists(importer="toy", imported="toy.engine.generate")


def test_the_layer_contract_reports_a_planted_back_import(tmp_path):
    """A copy of toy-core where toy.gguf (layer 1) imports the engine (layer 4) inside a function,
    plus a top-level module no layer names: both are reported."""
    src = tmp_path / "src"
    shutil.copytree(CORE_SRC / "toy", src / "toy", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    (src / "toy" / "gguf" / "planted.py").write_text(
        "def f():\n    from toy.engine import generate\n\n    return generate\n"
    )
    (src / "toy" / "unplaced.py").write_text('"""In no layer."""\n')
    r = lint_imports(src)
    assert r.returncode != 0
    assert "toy.gguf is not allowed to import toy.engine" in r.stdout, r.stdout
    assert "toy.gguf.planted -> toy.engine.generate (l.2)" in r.stdout
    assert "- toy.unplaced" in r.stdout


def test_toy_reference_is_not_in_toy_core():
    assert not list((CORE_SRC / "toy").glob("reference/**/*.py"))


# -- distributions and the facade (ast walk) ------------------------------------------------------


@dataclass(frozen=True)
class Distribution:
    name: str  # normalized: toy-core
    src: Path
    packages: tuple[str, ...]  # the import packages under src: ("toy",)
    declared: frozenset[str]  # normalized names of [project] dependencies


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    assert m, f"cannot read a distribution name from {req!r}"
    return normalize(m.group(1))


def distributions(packages: Path) -> list[Distribution]:
    """Every ``<packages>/*/pyproject.toml`` with its import packages and declared dependencies."""
    out = []
    for pyproject in sorted(packages.glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        src = pyproject.parent / "src"
        names = tuple(sorted(p.name for p in src.iterdir() if (p / "__init__.py").is_file()))
        deps = frozenset(requirement_name(r) for r in project.get("dependencies", []))
        out.append(Distribution(normalize(project["name"]), src, names, deps))
    return out


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, src: Path):
    """(line, absolute module, names imported from it or None) of every import in ``path``: nested
    ones included, relative ones resolved."""
    here = module_name(path, src)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module, [a.name for a in node.names]


def contract_violations(packages: Path) -> list[str]:
    """What breaks the distribution rules and the facade rule, one line each."""
    dists = distributions(packages)
    owner = {pkg: d for d in dists for pkg in d.packages}
    problems = []
    for d in dists:
        for pkg in d.packages:
            for path in sorted((d.src / pkg).rglob("*.py")):
                where = path.relative_to(packages.parent)
                for line, module, names in imports(path, d.src):
                    top = module.split(".")[0]
                    other = owner.get(top)
                    if other is not None and other is not d:
                        if other.name not in d.declared:
                            problems.append(
                                f"{where}:{line}: imports {module} ({other.name}), not declared by {d.name}"
                            )
                        private = [p for p in module.split(".")[1:] + (names or []) if p.startswith("_")]
                        private = [p for p in private if not (p.startswith("__") and p.endswith("__"))]
                        if private:
                            problems.append(f"{where}:{line}: uses {other.name}'s private {', '.join(private)}")
                    if d.name == "toy-core" and module == "toy":
                        if names is None:
                            problems.append(f"{where}:{line}: imports the facade toy")
                        elif facade := [n for n in names if not is_submodule(d.src, n)]:
                            problems.append(f"{where}:{line}: imports {', '.join(facade)} from the facade toy")
    return problems


def is_submodule(src: Path, name: str) -> bool:
    return (src / "toy" / f"{name}.py").is_file() or (src / "toy" / name / "__init__.py").is_file()


def test_distributions_import_only_what_they_declare():
    dists = {d.name: d for d in distributions(PACKAGES)}
    assert {"toy-ggml", "toy-core", "toy-cli", "toy-serve", "toy-vit"} <= set(dists)
    assert dists["toy-core"].packages == ("toy",)
    assert contract_violations(PACKAGES) == []


def test_the_walk_reports_planted_violations(tmp_path):
    """The real pyproject files, with planted sources: an undeclared distribution imported inside a
    function, another distribution's private module, the facade imported for a name. Declared
    imports and submodule imports through ``from toy import ...`` pass."""
    packages = tmp_path / "packages"
    for name in ("toy-ggml", "toy-core", "toy-cli"):
        (packages / name).mkdir(parents=True)
        shutil.copy(PACKAGES / name / "pyproject.toml", packages / name / "pyproject.toml")
    files = {
        "toy-ggml/src/toy_ggml/__init__.py": "",
        "toy-core/src/toy/__init__.py": "",
        "toy-core/src/toy/models/__init__.py": "",
        "toy-core/src/toy/gguf/__init__.py": """
            import numpy
            import toy_ggml
            from toy import models
            from .. import models as again


            def late():
                import toy_cli

                return toy_cli
            """,
        "toy-core/src/toy/engine.py": """
            import toy
            from toy import load, models
            from toy_ggml import _core
            """,
        "toy-cli/src/toy_cli/__init__.py": """
            from toy.gguf import GGUFFile
            import toy_ggml.dtypes
            """,
    }
    for rel, text in files.items():
        path = packages / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    found = contract_violations(packages)
    gguf, engine = "packages/toy-core/src/toy/gguf/__init__.py", "packages/toy-core/src/toy/engine.py"
    assert found == [
        f"{engine}:2: imports the facade toy",
        f"{engine}:3: imports load from the facade toy",
        f"{engine}:4: uses toy-ggml's private _core",
        f"{gguf}:9: imports toy_cli (toy-cli), not declared by toy-core",
    ]


# -- the architecture page draws the contract ------------------------------------------------------


def contract_layers(config: str) -> list[set[str]]:
    """The layers of ``.importlinter``'s toy-core contract, top first, each a set of module names."""
    block = config.split("layers =", 1)[1].split("\n")
    layers: list[set[str]] = []
    for line in block[1:]:
        if not line.startswith((" ", "\t")) or not line.strip():
            break
        layers.append({m.strip() for m in line.split(":")})
    return layers


def page_layers(page: str) -> list[set[str]]:
    """The layers the architecture page's diagram shows (its rows ``N  toy.a  toy.b  description``), top first."""
    section = page.split("## Layers inside toy-core", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    rows = []
    for line in section.strip("\n").split("\n"):
        m = re.match(r"\s*(\d+)\s+(.*)", line)
        assert m, f"unexpected diagram row {line!r}"
        rows.append((int(m.group(1)), {w.removeprefix("toy.") for w in m.group(2).split() if w.startswith("toy.")}))
    assert [n for n, _ in rows] == sorted((n for n, _ in rows), reverse=True), "diagram rows must go top-down"
    return [mods for _, mods in rows]


def test_the_architecture_page_shows_the_contract():
    page = (ROOT / "docs/concepts/architecture.md").read_text(encoding="utf-8")
    assert page_layers(page) == contract_layers(CONFIG.read_text(encoding="utf-8"))


def test_a_diagram_that_drifts_from_the_contract_is_reported():
    page = (ROOT / "docs/concepts/architecture.md").read_text(encoding="utf-8")
    drifted = page.replace(" 3  toy.adapters ", " 3  toy.plugins  ", 1)
    assert drifted != page
    assert page_layers(drifted) != contract_layers(CONFIG.read_text(encoding="utf-8"))
