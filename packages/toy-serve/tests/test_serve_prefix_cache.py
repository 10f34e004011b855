"""The prefix cache in toy serve (``--cache-ram``, ``--cache-dir``) and slot save/restore (``POST /slots/{id}``).

Every answer is compared with the library's (``ref_model``: another copy of the model, slot 0, the prompt
prefilled from scratch, no prefix cache): greedy outputs are equal token for token whether the prompt's prefix
came from the requester's slot, another request's blocks, blocks spilled to disk and read back by a restarted
server, or a slot file. ``usage.prompt_tokens_details.cached_tokens`` and ``/metrics`` show the reuse.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytestmark = pytest.mark.model

KEY = "prefix-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SYSTEM = (
    "You are a terse assistant in a fruit shop. Answer every question with one or two words, "
    "never more, and never repeat the question."
)
TURNS = 20
CLIENTS = 4
N = 4  # tokens per answer


def user(t: int) -> str:
    return f"Turn {t}: a fruit?"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-cache"), tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def live(serve_model, serve_settings, serving, folders):
    settings = serve_settings(api_key=KEY, cache_dir=str(folders[0]), slot_save_path=str(folders[1]))
    with serving(settings, serve_model) as s:
        yield s


class Reference:
    """Greedy answers of the library (``ref_model``: the prompt prefilled from scratch), memoized by prompt."""

    def __init__(self, model):
        self.model, self.memo = model, {}

    def __call__(self, prompt) -> tuple[str, int]:
        """(text, prompt tokens) for a chat's messages or a completion's prompt text."""
        key = prompt if isinstance(prompt, str) else tuple((m["role"], m["content"]) for m in prompt)
        if key not in self.memo:
            self.model.engine.cache.clear()  # generate() prefills the whole prompt; this only makes it obvious
            g = self.model.generate(prompt, temperature=0, max_tokens=N)
            self.memo[key] = g.text, g.prompt_tokens
        return self.memo[key]


@pytest.fixture(scope="module")
def reference(ref_model):
    return Reference(ref_model)


def test_a_chat_replayed_by_four_concurrent_clients_equals_the_library(live, reference):
    alias = live.srv.settings.alias

    async def client(k: int) -> list[tuple[list[dict], str, int, int]]:
        async with live.async_client(api_key=KEY) as c:
            messages = [{"role": "system", "content": SYSTEM}]
            out = []
            for t in range(TURNS):
                messages.append({"role": "user", "content": user(t)})
                r = await c.chat.completions.create(model=alias, messages=messages, max_tokens=N, temperature=0)
                text = r.choices[0].message.content
                out.append((list(messages), text, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
                messages.append({"role": "assistant", "content": text})
            return out

    async def run():
        return await asyncio.gather(*(client(k) for k in range(CLIENTS)))

    runs = asyncio.run(run())
    for k, turns in enumerate(runs):
        for t, (messages, text, prompt_tokens, cached) in enumerate(turns):
            want, n_prompt = reference(messages)
            assert (text, prompt_tokens) == (want, n_prompt), (k, t)
            assert 0 <= cached < prompt_tokens
            if t > 0:
                assert cached > 0, (k, t)  # at least the system prompt and the earlier turns

    # every slot erased: the next turn's prefix can only come from the prefix cache's blocks
    for slot in range(live.srv.worker.n_slot):
        r = live.http.post(f"/slots/{slot}?action=erase", headers=AUTH)
        assert r.status_code == 200 and r.json()["id_slot"] == slot
    messages, _, _, _ = runs[0][-1]
    messages = [*messages, {"role": "assistant", "content": runs[0][-1][1]}, {"role": "user", "content": user(99)}]
    hits, tokens = live.metric("toy_prefix_cache_hits_total"), live.metric("toy_prefix_cache_cached_tokens_total")
    with live.client(api_key=KEY) as c:
        r = c.chat.completions.create(model=alias, messages=messages, max_tokens=N, temperature=0)
    want, n_prompt = reference(messages)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == n_prompt
    assert cached > 0 and cached % 16 == 0 and cached > n_prompt - 64  # whole blocks, all but the new turn
    assert live.metric("toy_prefix_cache_hits_total") - hits == cached // 16
    assert live.metric("toy_prefix_cache_cached_tokens_total") - tokens == cached
    assert live.metric("toy_prefix_cache_bytes", {"tier": "ram"}) > 0
    assert 0 < live.metric("toy_prefix_cache_hit_ratio") <= 1


def test_slot_save_and_restore_round_trip(live, reference, folders):
    alias = live.srv.settings.alias
    prompt = SYSTEM + " What is the price of one green apple today?"
    with live.client(api_key=KEY) as c:
        first = c.completions.create(model=alias, prompt=prompt, max_tokens=N, temperature=0)
    want, _ = reference(prompt)
    assert first.choices[0].text == want
    worker = live.srv.worker
    ids = live.srv.model.tokenize(prompt)
    slot = next(s for s in range(worker.n_slot) if worker.engine.cache.tokens(s)[: len(ids)] == ids)  # it served
    held = worker.engine.cache.tokens(slot)
    r = live.http.post(f"/slots/{slot}?action=save", json={"filename": "apple.bin"}, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id_slot"] == slot and body["filename"] == "apple.bin" and body["n_saved"] == len(held)
    assert body["n_written"] == (folders[1] / "apple.bin").stat().st_size and body["timings"]["save_ms"] >= 0

    for s in range(worker.n_slot):  # nothing left in any slot (the prefix cache has whole blocks only)
        assert live.http.post(f"/slots/{s}?action=erase", headers=AUTH).status_code == 200
    assert (len(ids) - 1) % 16  # so that reusing all but the last prompt token needs the restored slot
    other = (slot + 1) % worker.n_slot
    r = live.http.post(f"/slots/{other}?action=restore", json={"filename": "apple.bin"}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["n_restored"] == len(held) and r.json()["id_slot"] == other
    assert worker.engine.cache.tokens(other) == held
    with live.client(api_key=KEY) as c:
        again = c.completions.create(model=alias, prompt=prompt, max_tokens=N, temperature=0)
    assert again.choices[0].text == want
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_slot_route_errors(live, folders, serve_model):
    from toy.engine.prefix import Fingerprint, fingerprint, write_file

    post = live.http.post
    assert post("/slots/0?action=erase").status_code == 401  # behind the API key
    cases = [
        ("/slots/0?action=save", {}, 400, "filename"),
        ("/slots/0?action=save", {"filename": "../x.bin"}, 400, "filename"),
        ("/slots/0?action=save", {"filename": "a/b.bin"}, 400, "filename"),
        ("/slots/0?action=save", {"filename": ".hidden"}, 400, "filename"),
        ("/slots/0?action=fly", {"filename": "x.bin"}, 400, "action"),
        ("/slots/99?action=erase", {}, 400, "id_slot"),
        ("/slots/0?action=restore", {"filename": "absent.bin"}, 400, "filename"),
    ]
    for url, body, status, param in cases:
        r = post(url, json=body, headers=AUTH)
        assert r.status_code == status, (url, body, r.text)
        assert r.json()["error"]["param"] == param, (url, r.json())
    # nothing was written: not beside the slot folder ("../x.bin"), not in a subfolder, not by the unknown action
    # (only these paths: the session's other tests write into the same temporary root)
    assert not (folders[1].parent / "x.bin").exists()
    assert not (folders[1] / "a").exists() and not (folders[1] / "x.bin").exists()

    # a file saved for another KV setup: 400 naming what differs
    fp = fingerprint(serve_model, full=True)
    parts = dict(fp.parts)
    parts["kv_type"] = "F32"
    foreign = Fingerprint(tuple(sorted(parts.items())))
    meta = {"kind": "slot", "adapter": "", "fingerprint": parts}
    write_file(
        folders[1] / "f32.bin", foreign, b"\0" * 32, [1, 2], bytes(2 * serve_model.engine.cache.token_bytes), meta
    )
    r = post("/slots/0?action=restore", json={"filename": "f32.bin"}, headers=AUTH)
    assert r.status_code == 400 and "kv_type: 'F32' in the file, 'F16' here" in r.json()["error"]["message"]

    # a busy slot: 409 while a stream holds it
    alias = live.srv.settings.alias

    async def busy() -> list[int]:
        async with live.async_client(api_key=KEY) as c:
            stream = await c.completions.create(
                model=alias, prompt=SYSTEM, max_tokens=64, temperature=0, stream=True, extra_body={"ignore_eos": True}
            )
            codes = []
            async for _ in stream:
                async with httpx.AsyncClient(base_url=live.url, timeout=60) as h:
                    for s in range(live.srv.worker.n_slot):
                        r = await h.post(f"/slots/{s}?action=save", json={"filename": "busy.bin"}, headers=AUTH)
                        codes.append(r.status_code)
                        if r.status_code == 409:
                            assert r.json()["error"]["code"] == "slot_busy"
                break
            await stream.close()
            return codes

    assert 409 in asyncio.run(busy())


def test_tiny_cache_ram_evicts_to_disk_and_a_restarted_server_reads_it_back(
    serve_model, serve_settings, serving, reference, tmp_path
):
    """``--cache-ram 1`` (two blocks of SmolLM2's 368 KB) and a cache folder: blocks are evicted to disk; a new
    server over the same folder (a restart) serves the prompt from them, bit-exact; no slot file option: 501."""
    prompt = SYSTEM + " " + SYSTEM.upper() + " Which fruit is yellow?"
    settings = serve_settings(cache_ram=1, cache_dir=str(tmp_path))
    with serving(settings, serve_model) as s:
        with s.client() as c:
            first = c.completions.create(model=s.srv.settings.alias, prompt=prompt, max_tokens=N, temperature=0)
        assert s.metric("toy_prefix_cache_evictions_total", {"tier": "ram"}) > 0
        assert s.metric("toy_prefix_cache_bytes", {"tier": "disk"}) > 0
        assert s.metric("toy_prefix_cache_bytes", {"tier": "ram"}) <= 1 << 20
        r = s.http.post("/slots/0?action=save", json={"filename": "x.bin"})
        assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]
    want, _ = reference(prompt)
    assert first.choices[0].text == want
    with serving(settings, serve_model) as s:  # serving() clears every slot: only the disk folder remembers
        assert s.metric("toy_prefix_cache_bytes", {"tier": "disk"}) > 0
        with s.client() as c:
            again = c.completions.create(model=s.srv.settings.alias, prompt=prompt, max_tokens=N, temperature=0)
        assert again.choices[0].text == want
        n = again.usage.prompt_tokens
        assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
