"""QLoRA on the real SmolLM2-135M-Instruct Q4_1 file, through `toy train lora`
in a child process (so its peak RSS is its own).

The data is the bundled generated chat set (`toy data demo-chat`, 160
conversations, seed 0; examples over 65 tokens dropped), trained 20 steps of
2 rows x 64 tokens at lr 2e-3 (LoRA rank 8 on q, k, v, o). Figures seen when
this test was written (2 threads): validation loss 3.11 at step 0 (the base
model), 0.56 at step 10, 0.29 at step 20; peak RSS 443 MB.
The test asks for what the issue asks, with margin: the validation loss at
the end at most half the base's, and peak RSS well below the size of an F32
copy of the model (the weights alone: 135M x 4 bytes = 540 MB; the bound is
500 MB, the file's own Q4_1 bytes are 98 MB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.model


def test_qlora_learns_and_stays_small(smollm2_path, tmp_path):
    from toy.adapters import load_adapter
    from toy.train.demodata import write_demo_chat

    data = tmp_path / "chat.jsonl"
    write_demo_chat(data, n=160, seed=0)
    before = os.stat(smollm2_path).st_mtime_ns
    # the child reports its own peak (VmHWM, reset by exec); getrusage's
    # ru_maxrss would include the forked pytest process's memory before exec
    probe = (
        "import atexit, sys\n"
        "atexit.register(lambda: print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1],"
        " file=sys.stderr))\n"
        "from toy_cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    cmd = [
        sys.executable, "-c", probe, "train", "lora", str(data), "-m", str(smollm2_path), "--steps", "20",
        "-b", "2", "--context", "64", "--max-length", "65", "--overflow", "drop", "--eval-every", "10",
        "--save-every", "0", "--lr", "2e-3", "--warmup", "3", "--out", str(tmp_path / "runs"), "--json", "-q",
        "--threads", "2", "--device", "cpu",
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True)
    out, err = p.stdout, p.stderr
    assert p.returncode == 0, err
    res = json.loads(out)
    ev = [json.loads(x) for x in open(os.path.join(res["run_dir"], "events.jsonl"))]
    start = ev[0]
    assert start["recipe"] == "lora" and start["base"]["weight_types"] == ["Q4_1"]  # QLoRA: the base stays Q4_1
    assert start["data"]["dropped"] > 0 and start["data"]["truncated"] == 0  # over-length examples counted
    val = {e["step"]: e["loss"] for e in ev if e["kind"] == "eval"}
    assert sorted(val) == [0, 10, 20]
    assert val[20] <= 0.5 * val[0], val
    peak_mb = int(err.strip().splitlines()[-1]) / 1024  # VmHWM in kB
    assert peak_mb < 500, f"peak RSS {peak_mb:.0f} MB"
    adapter = load_adapter(res["checkpoint"])
    assert adapter.architecture == "llama" and len(adapter.pairs) == 4 * 30
    assert os.stat(smollm2_path).st_mtime_ns == before
