"""The docs runner's own parts (tests/docs/test_docs.py): parsing, annotations and the loose comparison."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("docs_runner", Path(__file__).with_name("test_docs.py"))
dr = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = dr
spec.loader.exec_module(dr)


def test_stale_and_fresh_output():
    out = "training a 1024-token tokenizer\nstep 1/8 loss 6.9335 lr 1.00e-04 494 tok/s\nrun: runs/eval-20261202-020736-e359\n"
    assert (
        dr.compare_output(
            "step 1/8 loss 6.93 lr 1.0e-04 900 tok/s\n…\nrun: runs/eval-20261130-044520-7d75", out, "figures"
        )
        is None
    )
    assert "not found" in dr.compare_output("step 1/8 loss 5.1 lr 1.0e-04 1 tok/s", out, "figures")
    assert dr.compare_output("step 1/8 loss 5.1 lr 1.0e-04 1 tok/s", out, "shape") is None
    assert "not found" in dr.compare_output("step 1/8 loss 6.9 lr 1.0e-04 1 tok/s", out[::-1], "shape")


def test_json_keys_and_figures():
    assert dr.compare_output('{"a": 1, "b": {"c": "x"}}', '{"a": 1.01, "b": {"c": "x"}}', "figures") is None
    assert "missing key" in dr.compare_output('{"a": 1, "d": 2}', '{"a": 1}', "figures")
    assert "shown" in dr.compare_output('{"a": "x"}', '{"a": "y"}', "figures")
    assert dr.compare_output('{"a": 1, …}', '{"a": 2, "b": 3}', "keys") is None


def test_comment_checks(tmp_path):
    page = dr.Page("x.md", tmp_path, {})
    block = dr.Block("x.md", 1, "python", "")
    page.run_python(block, "x = [1, 2]\nprint(len(x))   # 2\nx    # [1, 2]\nprint(x)   # explains nothing\n")
    assert page.failures == []
    page.run_python(block, "print(3)   # 2\nx   # [1, 3]: a comment\n")
    assert len(page.failures) == 2, page.failures


def test_annotations_and_console(tmp_path):
    md = tmp_path / "p.md"
    md.write_text(
        "<!-- docs-test: replace: 8000 => {port} -->\n\n<!-- docs-test: skip: needs the Hub -->\n"
        "```bash\ntoy fetch a/b c\n```\n\n```console\n$ echo hi &&\\\n  echo there\nhi\nthere\n```\n"
    )
    blocks, replaces = dr.parse_page(md)
    assert replaces == [("8000", "{port}")]
    assert blocks[0].notes == {"skip": "needs the Hub"}
    assert dr.split_console(blocks[1].text) == [("echo hi &&\\\n  echo there", "hi\nthere")]


def test_setup_steps_are_user_commands():
    """A page's example files are made by commands a user can run, not by the test suite's helpers."""
    helpers = ("toy_testsupport", "tests/", "DOCS_FIXTURES", "conftest")
    bad = []
    for rel in dr.PAGES:
        blocks, _ = dr.parse_page(dr.ROOT / rel)
        bad += [f"{b.where}: {b.notes['setup']}" for b in blocks if any(h in b.notes.get("setup", "") for h in helpers)]
    assert not bad, "setup steps that use test helpers:\n" + "\n".join(bad)
