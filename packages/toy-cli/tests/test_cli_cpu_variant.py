"""`toy devices` reports the CPU backend variant the process loaded and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import toy_ggml


def _toy(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "toy_cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_devices_json_names_the_loaded_variant_and_every_candidate():
    p = _toy("devices", "--json")
    assert p.returncode == 0, p.stderr
    var = json.loads(p.stdout)["build"]["cpu_variant"]
    choice = toy_ggml.cpu_variant()
    assert var["tag"] == choice.tag and var["score"] == choice.score
    assert [c["tag"] for c in var["candidates"]] == [c.tag for c in choice.candidates]
    assert max(c["score"] for c in var["candidates"]) == var["score"]


def test_devices_text_says_why_and_follows_the_override():
    p = _toy("devices")
    assert p.returncode == 0, p.stderr
    assert f"cpu variant: {toy_ggml.cpu_variant().tag} (" in p.stderr
    floor = toy_ggml.cpu_variant().candidates[0].tag  # the lowest level the build carries
    p = _toy("devices", env=dict(os.environ, TOY_GGML_CPU_VARIANT=floor))
    assert p.returncode == 0, p.stderr
    assert f"cpu variant: {floor} (chosen by TOY_GGML_CPU_VARIANT)" in p.stderr


def test_an_unknown_variant_is_one_error_line():
    p = _toy("devices", env=dict(os.environ, TOY_GGML_CPU_VARIANT="no-such-level"))
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    assert "TOY_GGML_CPU_VARIANT='no-such-level' is not a CPU variant of this build" in p.stderr
