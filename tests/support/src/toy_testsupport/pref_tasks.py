"""Generated post-training tasks with a verifiable property (test-only): the
data of the learning tests and benchmarks of the preference and GRPO recipes.

- ``punctuation_pairs``: preference pairs whose prompt states a constraint
  ("end the answer with an exclamation mark") and whose two answers are the
  same words, the chosen one satisfying it, the rejected one ending with a
  full stop. What the pair teaches is checkable on any held-out prompt: a
  model that learned it gives the "!" answer a higher log-probability than
  the "." one. Items and categories are split so held-out pairs use words
  the training pairs never show.
- ``sum_prompts``: GRPO prompts "What is a + b?" with the sum as ``answer``
  (the exact-answer reward extracts the last number of a completion);
  ``sum_split`` gives training and held-out prompts with no question in
  common.

Everything is seeded; no download.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CATEGORIES = {
    "fruit": ["apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "pear", "plum", "melon", "lime", "kiwi"],
    "colour": ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "brown", "grey", "gold"],
    "animal": ["cat", "dog", "horse", "tiger", "lion", "zebra", "mouse", "rabbit", "eagle", "shark", "whale", "wolf"],
    "country": ["France", "Spain", "Italy", "Japan", "Brazil", "Canada", "Egypt", "India", "Kenya", "Peru", "Chile"],
    "city": ["Paris", "Rome", "Tokyo", "Lima", "Cairo", "Oslo", "Berlin", "Madrid", "Dublin", "Vienna", "Prague"],
    "tool": ["hammer", "saw", "drill", "wrench", "chisel", "pliers", "shovel", "rake", "axe", "file", "level"],
}

TEMPLATES = [
    "Name a {cat}. End your answer with an exclamation mark.",
    "Give me one {cat}, and finish your reply with an exclamation mark.",
    "Tell me a {cat}. Your answer must end with an exclamation mark.",
]


def punctuation_pairs(n_train: int, n_val: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(training pairs, held-out pairs) in the conversational pair format
    ({"prompt": [user message], "chosen": [assistant], "rejected":
    [assistant]}). Held-out pairs draw from the last third of each
    category's items (never shown in training)."""
    rng = np.random.default_rng(seed)

    def make(n: int, held_out: bool) -> list[dict]:
        out = []
        cats = sorted(CATEGORIES)
        for _ in range(n):
            cat = cats[int(rng.integers(len(cats)))]
            items = CATEGORIES[cat]
            cut = (2 * len(items)) // 3
            pool = items[cut:] if held_out else items[:cut]
            item = pool[int(rng.integers(len(pool)))]
            prompt = TEMPLATES[int(rng.integers(len(TEMPLATES)))].format(cat=cat)
            word = item[0].upper() + item[1:]
            answer = word if rng.random() < 0.5 else f"{word} is my answer"
            out.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "chosen": [{"role": "assistant", "content": answer + "!"}],
                    "rejected": [{"role": "assistant", "content": answer + "."}],
                }
            )
        return out

    return make(n_train, False), make(n_val, True)


def sum_prompts(
    n: int, seed: int = 0, *, low: int = 1, high: int = 9, instruction: str = " Reply with the number only."
) -> list[dict]:
    """GRPO prompts {"prompt": [user message], "answer": "<a + b>"}: the
    question "What is a + b?" followed by ``instruction``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(low, high + 1, size=2))
        q = f"What is {a} + {b}?{instruction}"
        out.append({"prompt": [{"role": "user", "content": q}], "answer": str(a + b)})
    return out


def sum_split(n_train: int, n_val: int, seed: int = 0, **kw) -> tuple[list[dict], list[dict]]:
    """(training prompts, held-out prompts) of ``sum_prompts`` (``kw``): no
    training question is one of the held-out ones."""
    held_out = sum_prompts(n_val, seed + 1, **kw)
    seen = {p["prompt"][0]["content"] for p in held_out}
    train: list[dict] = []
    k = 0
    while len(train) < n_train:
        k += 1
        train = [p for p in sum_prompts(4 * k * n_train, seed, **kw) if p["prompt"][0]["content"] not in seen]
    return train[:n_train], held_out


def write_jsonl(path, rows: list[dict]) -> Path:
    p = Path(path)
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return p
