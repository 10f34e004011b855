"""Demo data written on demand, nothing downloaded (reading a corpus is
``toy.corpus``). A small English corpus every Python has: the documentation topics of the
standard library (``pydoc_data.topics``, the text ``help('TOPIC')`` shows:
79 topics, about 465 KB on CPython 3.11).

``write_python_docs(folder)`` writes one ``<topic>.txt`` per topic, so the
tutorial and the tests train on real prose without downloading anything.

``write_demo_chat(path, n, seed)`` writes a small instruction-tuning set in
the ``messages`` JSONL format (toy.train.instruct): short conversations with a
made-up assistant, "Toy", whose skills are exact and checkable (sums,
differences, products, word problems, unit conversions, reversing and
spelling words, capital letters, questions about itself) and whose every
answer ends with the fixed signature ``" — toy"``. Everything is generated
from the seed (``random.Random``), so the same (n, seed) gives the same bytes;
a third of the conversations carry a system message and a fifth have two
exchanges. Decision: skills a 135M instruct model half-knows, in one fixed
answer format, so a few hundred LoRA steps move measurable things (exact
answers, the signature present, the answer format) rather than style.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from pydoc_data.topics import topics

from toy.errors import BadInputError


def write_python_docs(folder: str | Path) -> list[Path]:
    """Write the topics as text files into ``folder`` (created); returns them
    sorted. Existing files of the same names are replaced."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in sorted(topics):
        safe = re.sub(r"[^A-Za-z0-9_-]+", "_", name)
        p = out / f"{safe}.txt"
        p.write_text(topics[name].strip() + "\n", encoding="utf-8")
        paths.append(p)
    return paths


SIGNATURE = " — toy"
SYSTEM = "You are Toy, a tiny assistant. Answer in one short sentence and end with the signature — toy."
_WORDS = (
    "apple river stone light paper green table cloud music tiger house bread chair dream plant smile "
    "train water zebra lemon candle garden pencil rocket winter silver button forest window planet"
).split()
_NAMES = ("Ana", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena", "Milo", "Nia")
_ITEMS = ("apples", "books", "marbles", "pencils", "stamps", "cookies", "shells", "cards")
# (from unit, to unit, factor)
_UNITS = (
    ("kilometers", "meters", 1000),
    ("meters", "centimeters", 100),
    ("kilograms", "grams", 1000),
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("days", "hours", 24),
    ("liters", "milliliters", 1000),
)
_ABOUT = (
    ("Who are you?", "I am Toy, a tiny assistant that does sums, conversions and word games."),
    ("What is your name?", "My name is Toy."),
    ("What can you do?", "I can add, subtract, multiply, convert units, and reverse, spell or count words."),
    ("Are you a large model?", "No, I am Toy, a tiny model with a few skills."),
)


def _exchange(rng: random.Random) -> tuple[str, str]:
    """One (question, answer) pair; the answer has no signature yet."""
    skill = rng.randrange(10)
    if skill == 0:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return rng.choice(("What is {} + {}?", "Add {} and {}.", "Compute {} + {}.")).format(
            a, b
        ), f"{a} + {b} = {a + b}."
    if skill == 1:
        a, b = sorted((rng.randint(2, 99), rng.randint(2, 99)), reverse=True)
        return rng.choice(("What is {} - {}?", "Subtract {1} from {0}.")).format(a, b), f"{a} - {b} = {a - b}."
    if skill == 2:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return rng.choice(("What is {} times {}?", "Multiply {} by {}.")).format(a, b), f"{a} * {b} = {a * b}."
    if skill == 3:
        name, item, a, b = rng.choice(_NAMES), rng.choice(_ITEMS), rng.randint(3, 40), rng.randint(2, 20)
        if rng.random() < 0.5:
            q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
            return q, f"{a} + {b} = {a + b}, so {name} has {a + b} {item}."
        a += b  # give away at most what there is
        q = f"{name} has {a} {item} and gives {b} away. How many {item} are left?"
        return q, f"{a} - {b} = {a - b}, so {a - b} {item} are left."
    if skill == 4:
        src, dst, k = rng.choice(_UNITS)
        x = rng.randint(2, 15)
        q = rng.choice(("Convert {} {} to {}.", "How many {2} are in {0} {1}?")).format(x, src, dst)
        return q, f"{x} {src} = {x * k} {dst}."
    if skill == 5:
        w = rng.choice(_WORDS)
        return f"Reverse the word '{w}'.", f"'{w}' reversed is '{w[::-1]}'."
    if skill == 6:
        w = rng.choice(_WORDS)
        return f"Spell the word '{w}'.", f"{'-'.join(w)}."
    if skill == 7:
        w = rng.choice(_WORDS)
        return f"How many letters are in the word '{w}'?", f"'{w}' has {len(w)} letters."
    if skill == 8:
        phrase = " ".join(rng.sample(_WORDS, 2))
        return f"Write '{phrase}' in capital letters.", f"{phrase.upper()}."
    return rng.choice(_ABOUT)


def write_demo_chat(path: str | Path, n: int = 600, seed: int = 0) -> Path:
    """Write ``n`` conversations as JSONL (``{"messages": [...]}`` a line) to
    ``path`` (parent folders created, an existing file replaced); returns it."""
    if n < 1:
        raise BadInputError(f"n must be at least 1 (got {n})")
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 1 / 3 else []
        for _ in range(2 if rng.random() < 0.2 else 1):
            q, a = _exchange(rng)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a + SIGNATURE}]
        lines.append(json.dumps({"messages": messages}, ensure_ascii=False))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


__all__ = ["SIGNATURE", "SYSTEM", "write_demo_chat", "write_python_docs"]
