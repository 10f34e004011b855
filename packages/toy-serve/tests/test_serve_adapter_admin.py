"""Adapters loaded and unloaded while serving: ``POST /v1/adapters``, ``GET /v1/adapters``,
``DELETE /v1/adapters/{name}`` (``toy_serve.adapters``).

The model is the real SmolLM2-135M-Instruct (the session's ``serve_model``, which gets a "boot" adapter before
the server starts, as ``--lora boot=PATH`` gives one, and loses every adapter again afterwards) with seeded
adapters (``train_helpers.seeded_adapter``). The reference for each request is ``toy.load(..., lora=[(file,
scale)])``: the adapter applied alone, from start-up, on another copy of the model (exact-batching kernels as
the server's), its greedy text compared character for character (the tokens are the same bit for bit).
Errors are checked against the files made wrong here by hand (another base, not an adapter, a FIFO, a
symlink out of the adapter folder).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time

import httpx
import numpy as np
import pytest

from toy_testsupport.train_helpers import seeded_adapter

pytestmark = pytest.mark.model

KEY = "admin-key"
RECIPES = {
    "boot": {"seed": 11, "rank": 4, "alpha": 8.0, "targets": ("q", "v"), "std": 0.05},
    "rt": {"seed": 12, "rank": 8, "alpha": 8.0, "targets": ("q", "v", "up", "down"), "std": 0.06},
    "x": {"seed": 13, "rank": 4, "alpha": 4.0, "targets": ("k", "o", "gate"), "std": 0.06},
    "y": {"seed": 14, "rank": 2, "alpha": 4.0, "targets": ("q", "up"), "std": 0.06},
}
SCALE = {"boot": 1.0, "rt": 0.5, "x": 1.0, "y": 1.5}
PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "The three primary colors are"]
N = 12


@pytest.fixture(scope="module")
def place(smollm2_path, tmp_path_factory):
    """The adapter folder (the four adapters and the wrong files) and a folder outside it."""
    from toy.adapters import save_adapter
    from toy_testsupport.toy_test_models import write_tiny_model

    root = tmp_path_factory.mktemp("admin")
    adir, out = root / "adapters", root / "outside"
    adir.mkdir()
    out.mkdir()
    files = {
        n: seeded_adapter(smollm2_path, adir / f"{n}.gguf", base_name=smollm2_path.name, **r)
        for n, r in RECIPES.items()
    }
    a = np.zeros((4, 64), np.float32)
    b = np.zeros((64, 4), np.float32)
    save_adapter(adir / "tiny-base.gguf", architecture="llama", pairs={"blk.0.attn_q.weight": (a, b)}, alpha=1, rank=4)
    save_adapter(adir / "gemma.gguf", architecture="gemma", pairs={"blk.0.attn_q.weight": (a, b)}, alpha=1, rank=4)
    write_tiny_model(adir / "model.gguf", seed=1, extra_metadata={"tokenizer.ggml.merges": []})
    os.mkfifo(adir / "fifo.gguf")
    os.mkfifo(out / "fifo.gguf")
    seeded_adapter(smollm2_path, out / "a.gguf", base_name=smollm2_path.name, **RECIPES["x"])
    os.symlink(out / "a.gguf", adir / "link.gguf")
    return adir, out, files


# the (adapter, prompt) pairs the tests compare with
USED = {None: PROMPTS[:2], "boot": PROMPTS[:2], "rt": PROMPTS[:2], "x": PROMPTS, "y": PROMPTS[1:2]}


@pytest.fixture(scope="module")
def alone(smollm2_path, place):
    """Greedy text of each (adapter or None, prompt) from the library with that adapter alone, at start-up."""
    import toy

    files = place[2]
    out = {}
    for name, prompts in USED.items():
        lora = [(files[name], SCALE[name])] if name else None
        with toy.load(smollm2_path, n_ctx=512, threads=2, exact_batching=True, lora=lora) as m:
            for p in prompts:
                out[name, p] = m.generate(p, temperature=0, max_tokens=N, ignore_eos=True).text
    for name, prompts in USED.items():  # each adapter changes the output of some prompt it is used with
        assert name is None or any(out[name, p] != out[None, p] for p in prompts if (None, p) in out), name
    return out


@pytest.fixture(scope="module")
def live(serve_model, serve_settings, serving, place):
    adir, _, files = place
    serve_model.load_adapter("boot", files["boot"])  # what --lora boot=PATH gives (toy.load(adapters=...))
    settings = serve_settings(
        api_key=KEY, adapter_dirs=(str(adir),), max_adapters=3, adapters=(f"boot={files['boot']}",)
    )
    try:
        with serving(settings, serve_model) as s:
            s.http.headers["authorization"] = f"Bearer {KEY}"
            yield s
    finally:
        for name in list(serve_model.selectable_adapters()):
            serve_model.unload_adapter(name)


def body(alias, model, prompt, **kw):
    return {"model": model or alias, "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True, **kw}


def names(live):
    return {a["name"]: a for a in live.http.get("/v1/adapters").json()["data"]}


def test_loaded_adapter_batches_with_boot_and_base_bit_for_bit(live, alone, place, serve_model):
    """A runtime-loaded adapter (relative path, scale 0.5) gives what it gives loaded at start-up, in one decode
    batch with the base and a start-up adapter; after DELETE it is gone (404, unlisted, memory freed)."""
    alias, http, files = live.srv.settings.alias, live.http, place[2]
    r = http.post("/v1/adapters", json={"name": "rt", "path": "rt.gguf", "scale": 0.5})
    assert r.status_code == 201, r.text
    card = r.json()
    digest = hashlib.sha256(files["rt"].read_bytes()).hexdigest()
    assert card["id"] == f"{alias}:rt" and card["file"] == "rt.gguf" and card["scale"] == 0.5
    assert card["sha256"] == digest and card["source"] == "api" and card["in_use"] == 0 and card["bytes"] > 0
    assert serve_model.adapter_identity(card["index"]) == f"{digest}:0.5"
    listed = names(live)
    assert set(listed) == {"boot", "rt"} and listed["boot"]["source"] == "startup"
    assert abs(listed["rt"]["loaded_at"] - time.time()) < 60
    ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert ids == [alias, f"{alias}:boot", f"{alias}:rt"]

    jobs = [(n, p) for p in PROMPTS[:2] for n in (None, "boot", "rt")]
    seen = []
    orig = live.srv.worker.engine.decode

    def spy(slots, tokens):
        seen.append({live.srv.worker.engine.slot_adapter[s] for s in slots})
        return orig(slots, tokens)

    async def run():
        async with httpx.AsyncClient(base_url=live.url, timeout=300, headers=dict(live.http.headers)) as c:

            async def one(name, prompt):
                model = f"{alias}:{name}" if name else None
                r = await c.post("/v1/completions", json=body(alias, model, prompt))
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            return await asyncio.gather(*(one(*j) for j in jobs))

    live.srv.worker.engine.decode = spy
    try:
        texts = asyncio.run(run())
    finally:
        live.srv.worker.engine.decode = orig
    for (name, prompt), text in zip(jobs, texts):
        assert text == alone[name, prompt], (name, prompt)
    assert max(len(s) for s in seen) >= 3  # the base and both adapters shared decode steps

    held = serve_model.selectable_adapters()["rt"]
    r = http.delete("/v1/adapters/rt")
    assert r.status_code == 200 and r.json()["status"] == "unloaded", r.text
    assert held.context is None and "rt" not in serve_model.selectable_adapters()  # the memory is freed
    for b in (body(alias, f"{alias}:rt", PROMPTS[0]), body(alias, None, PROMPTS[0], lora="rt")):
        r = http.post("/v1/completions", json=b)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert set(names(live)) == {"boot"}
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [alias, f"{alias}:boot"]
    assert http.delete("/v1/adapters/rt").status_code == 404


def test_load_use_unload_under_load(live, alone, serve_model):
    """8 streams: 4 long base streams fill the 4 slots, then 4 streams on adapter x queue behind them (they
    hold x). Meanwhile y is loaded (between two decode steps) and x is deleted: the DELETE answers 202
    "unloading" with x in use by the 4, a new request for x gets 404 at once. Then the long streams are
    cancelled: the 4 x streams run and end with x's reference text, y's request with y's, and x's memory is
    freed once the last x stream has ended."""
    alias = live.srv.settings.alias
    assert live.http.post("/v1/adapters", json={"name": "x", "path": "x.gguf"}).status_code == 201
    long = 500 - 16  # tokens: the long streams outlive the test's steps, then they are cancelled

    async def run():
        async with httpx.AsyncClient(base_url=live.url, timeout=300, headers=dict(live.http.headers)) as c:
            first = [asyncio.Event() for _ in range(4)]

            async def stream(model, prompt, max_tokens, started=None):
                b = body(alias, model, prompt, stream=True, max_tokens=max_tokens)
                text = []
                async with c.stream("POST", "/v1/completions", json=b) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        ch = json.loads(line[6:])["choices"] if line.startswith("data: {") else None
                        if ch and ch[0]["text"]:
                            text.append(ch[0]["text"])
                            if started is not None:
                                started.set()
                return "".join(text)

            blockers = [asyncio.create_task(stream(None, PROMPTS[i], long, first[i])) for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 300)  # all 4 slots decode
            xs = [asyncio.create_task(stream(f"{alias}:x", p, N)) for p in PROMPTS]
            for _ in range(600):  # the 4 x streams are queued (and hold x)
                if live.srv.worker.queue_depth == 4:
                    break
                await asyncio.sleep(0.05)
            r = await c.post("/v1/adapters", json={"name": "y", "path": "y.gguf", "scale": 1.5})
            assert r.status_code == 201, r.text
            r = await c.delete("/v1/adapters/x")
            deleted = r.status_code, r.json()
            r = await c.post("/v1/completions", json=body(alias, f"{alias}:x", PROMPTS[0]))
            gone = r.status_code, r.json()["error"]["code"]
            listed = {a["name"]: a for a in (await c.get("/v1/adapters")).json()["data"]}
            running = sum(not t.done() for t in blockers)
            for t in blockers:
                t.cancel()
            y = await c.post("/v1/completions", json=body(alias, f"{alias}:y", PROMPTS[1]))
            texts = await asyncio.wait_for(asyncio.gather(*xs), 300)
            return deleted, gone, listed, running, y.json()["choices"][0]["text"], texts

    held = serve_model.selectable_adapters()["x"]
    (status, card), gone, listed, running, y_text, texts = asyncio.run(run())
    assert running == 4  # the DELETE came while the long streams still ran
    assert status == 202 and card["status"] == "unloading" and card["in_use"] == 4, card
    assert listed["x"]["status"] == "unloading" and listed["x"]["in_use"] == 4
    assert gone == (404, "model_not_found")
    assert y_text == alone["y", PROMPTS[1]]
    for p, text in zip(PROMPTS, texts):
        assert text == alone["x", p], p
    deadline = time.monotonic() + 10
    while "x" in names(live) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "x" not in names(live) and held.context is None and "x" not in serve_model.selectable_adapters()
    assert live.http.delete("/v1/adapters/y").status_code == 200
    deadline = time.monotonic() + 10
    while live.srv.worker.busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(names(live)) == {"boot"} and live.srv.worker.busy() == 0


def test_paths_auth_and_errors(live, place):
    """401 without the key; 403 for a path outside the adapter folder (a FIFO there is never opened: opening
    it would hang), through a symlink or '..'; 400 for a FIFO inside, a missing file, an adapter of another
    base or architecture, a file that is not an adapter, a bad name; 409 for a name taken and past
    --max-adapters (3); 404 for deleting what is not loaded. Nothing stays loaded."""
    adir, out, _ = place
    http, url = live.http, live.url
    with httpx.Client(base_url=url, timeout=10) as anon:
        assert anon.get("/v1/adapters").status_code == 401
        assert anon.post("/v1/adapters", json={"name": "q", "path": "x.gguf"}).status_code == 401
        assert anon.delete("/v1/adapters/boot").status_code == 401
    post = lambda name, path, **kw: http.post("/v1/adapters", json={"name": name, "path": str(path), **kw}, timeout=10)  # noqa: E731
    for path in (out / "fifo.gguf", out / "a.gguf", adir / "link.gguf", "../outside/a.gguf", "/etc/passwd"):
        r = post("q", path)
        assert r.status_code == 403 and r.json()["error"]["code"] == "path_not_allowed", (path, r.text)
    for path, what in [
        (adir / "fifo.gguf", "is not a regular file"),
        ("nope.gguf", "does not exist"),
        ("tiny-base.gguf", "does not make the model's"),
        ("gemma.gguf", "the adapter is for 'gemma', the model is 'llama'"),
        ("model.gguf", "not an adapter file"),
    ]:
        r = post("q", path)
        assert r.status_code == 400 and what in r.json()["error"]["message"], (path, r.text)
        assert r.json()["error"]["param"] == "path"
    assert post("a b", "x.gguf").json()["error"]["param"] == "name"
    r = post("boot", "x.gguf")
    assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_exists", r.text
    assert post("one", "x.gguf").status_code == 201 and post("two", "y.gguf").status_code == 201
    r = post("three", "rt.gguf")
    assert r.status_code == 409 and r.json()["error"]["code"] == "too_many_adapters", r.text
    for n in ("one", "two"):
        assert http.delete(f"/v1/adapters/{n}").status_code == 200
    assert http.delete("/v1/adapters/nope").status_code == 404
    assert set(names(live)) == {"boot"}


def test_no_adapter_dir_means_403_naming_the_option(tmp_path):
    from toy_serve.adapters import confine
    from toy_serve.schemas import APIError

    f = tmp_path / "a.gguf"
    f.write_bytes(b"")
    with pytest.raises(APIError) as e:
        confine(str(f), ())
    assert e.value.status == 403 and "--adapter-dir" in e.value.message
    assert confine("a.gguf", (str(tmp_path / "none"), str(tmp_path))) == str(f)  # looked up in each, in order


def test_settings_adapter_dirs_and_limit(tmp_path):
    from toy.errors import BadInputError
    from toy_serve import Settings

    s = Settings(model="m.gguf", adapter_dirs=tmp_path)
    assert s.adapter_dirs == (str(tmp_path),) and s.max_adapters == 8
    assert Settings(model="m.gguf").adapter_dirs == ()
    assert list(s.config()["adapter_dirs"]) == [str(tmp_path)]  # the run bundle records the folders
    for bad in ({"max_adapters": 0}, {"max_adapters": True}, {"adapter_dirs": ("",)}):
        with pytest.raises(BadInputError) as e:
            Settings(model="m.gguf", **bad)
        assert e.value.field in ("max_adapters", "adapter_dirs")
