"""Per-request LoRA adapters in toy serve (``--lora NAME=PATH``): requests that name different adapters
(or none) decode in one batch, and each gets the greedy output the library gives with that adapter alone.

The model is the real SmolLM2-135M-Instruct with three seeded adapters (``train_helpers.seeded_adapter``,
different seeds, ranks and targets). The reference for each request is ``toy.load(..., lora=[file])`` (the
adapter applied alone, on another copy of the model, exact-batching kernels as the server's).
"""

from __future__ import annotations

import asyncio

import pytest

from toy_testsupport.train_helpers import seeded_adapter

pytestmark = pytest.mark.model

RECIPES = {
    "qv": {"seed": 1, "rank": 4, "alpha": 8.0, "targets": ("q", "v"), "std": 0.05},
    "mlp": {"seed": 2, "rank": 8, "alpha": 8.0, "targets": ("up", "down"), "std": 0.04},
    "all": {
        "seed": 3,
        "rank": 2,
        "alpha": 4.0,
        "targets": ("q", "k", "o", "gate"),
        "std": 0.06,
    },
}
PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "The three primary colors are"]
N = 16


@pytest.fixture(scope="module")
def files(smollm2_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    return {
        n: seeded_adapter(smollm2_path, d / f"{n}.gguf", base_name=smollm2_path.name, **r) for n, r in RECIPES.items()
    }


@pytest.fixture(scope="module")
def live(smollm2_path, files, serve_settings, serving):
    import toy

    settings = serve_settings(adapters=tuple(f"{n}={p}" for n, p in files.items()))
    named = {n: p for n, p, _ in settings.adapters}
    with toy.load(smollm2_path, n_ctx=512, n_slot=4, threads=2, exact_batching=True, adapters=named) as m:
        with serving(settings, m) as s:
            yield s


@pytest.fixture(scope="module")
def alone(smollm2_path, files):
    """Greedy completion text of each (adapter, prompt) from the library with that adapter alone."""
    import toy

    out = {}
    for name in [None, *files]:
        lora = [files[name]] if name else None
        with toy.load(smollm2_path, n_ctx=512, threads=2, exact_batching=True, lora=lora) as m:
            for p in PROMPTS:
                out[name, p] = m.generate(p, temperature=0, max_tokens=N, ignore_eos=True).text
    return out


def test_models_lists_each_adapter(live, files):
    alias = live.srv.settings.alias
    data = live.http.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [alias] + [f"{alias}:{n}" for n in files]
    assert [m["adapter"]["name"] for m in data[1:]] == list(files) and all(m["parent"] == alias for m in data[1:])


def test_three_adapters_and_the_base_in_one_batch_equal_each_alone(live, alone, files):
    alias = live.srv.settings.alias
    assert len({alone[n, PROMPTS[0]] for n in [None, *files]}) == 4  # the adapters change the output
    names = [None, *files]
    jobs = [(names[i % 4], p, i % 2) for i, p in enumerate(PROMPTS * 2)]

    async def run():
        async with live.async_client() as c:

            async def one(name, prompt, via_field):
                kw = {
                    "model": alias,
                    "prompt": prompt,
                    "max_tokens": N,
                    "temperature": 0,
                    "extra_body": {"ignore_eos": True},
                }
                if name and via_field:
                    kw["extra_body"]["lora"] = name
                elif name:
                    kw["model"] = f"{alias}:{name}"
                r = await c.completions.create(**kw)
                return r.choices[0].text

            return await asyncio.gather(*(one(*j) for j in jobs))

    seen = []
    orig = live.srv.worker.engine.decode

    def spy(slots, tokens):
        seen.append({live.srv.worker.engine.slot_adapter[s] for s in slots})
        return orig(slots, tokens)

    live.srv.worker.engine.decode = spy
    try:
        texts = asyncio.run(run())
    finally:
        live.srv.worker.engine.decode = orig
    for (name, prompt, _), text in zip(jobs, texts):
        assert text == alone[name, prompt], (name, prompt)
    assert max(len(s) for s in seen) >= 3  # different adapters really shared decode steps


def test_llama_server_lora_field_and_errors(live, alone, files):
    alias, http = live.srv.settings.alias, live.http
    body = {"model": alias, "prompt": PROMPTS[1], "max_tokens": N, "temperature": 0, "ignore_eos": True}
    ids = list(files)
    r = http.post("/v1/completions", json={**body, "lora": [{"id": 0, "scale": 0}, {"id": 1, "scale": 1.0}]}).json()
    assert r["choices"][0]["text"] == alone[ids[1], PROMPTS[1]]
    chat = {"model": f"{alias}:{ids[2]}", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    bad = [  # an adapter name that is not loaded is a 404 model_not_found (as after DELETE /v1/adapters/{name})
        ({**body, "model": f"{alias}:nope"}, "model", 404),
        ({**body, "lora": "nope"}, "lora", 404),
        ({**body, "lora": [{"id": 7}]}, "lora", 400),
        ({**body, "lora": [{"id": 0, "scale": 0.5}]}, "lora", 400),
        ({**body, "lora": [{"id": 0}, {"id": 1}]}, "lora", 400),
        ({**body, "model": f"{alias}:{ids[0]}", "lora": ids[1]}, "lora", 400),
    ]
    for b, param, status in bad:
        r = http.post("/v1/completions", json=b)
        assert r.status_code == status and r.json()["error"]["param"] == param, (b, r.text)
        assert (r.json()["error"]["code"] == "model_not_found") == (status == 404), r.text


def test_settings_parse_named_adapters(files):
    from toy.errors import BadInputError
    from toy_serve import Settings

    s = Settings(model="m.gguf", adapters=(f"a={files['qv']}:0.5", ("b", str(files["mlp"]), 2)))
    assert s.adapters == (("a", str(files["qv"]), 0.5), ("b", str(files["mlp"]), 2.0))
    for bad in [(f"a={files['qv']}", f"a={files['mlp']}"), ("bad name=x.gguf",), (f"{files['qv']}",)]:
        with pytest.raises(BadInputError):
            Settings(model="m.gguf", adapters=bad)
