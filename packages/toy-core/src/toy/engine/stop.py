"""Stop strings over streamed text: decide what may be shown now and when to stop.

Generation produces text a few characters at a time, and a stop string may
arrive split across many pieces ("\\n\\nUs" + "er:"). ``StopMatcher.push``
takes each new piece and returns the part that is safe to emit now; it holds
back just the text that could still turn into a stop string, and reports
``stopped`` once one is complete. ``truncate_at_stop`` is the one-shot form
for text that is already whole.

Invariants:

- Everything emitted, concatenated, plus ``flush()`` at the end, equals the
  input up to (not including) the stop string that ended it; text after a
  stop string is dropped, and a stopped matcher emits nothing more.
- The held-back text is the longest suffix of the pending text that is a
  proper prefix of some stop string, and nothing else: text that cannot
  start a stop string is never delayed, and with no stop strings nothing is
  ever held (pass-through).
- The result does not depend on how the text was cut into pieces: pushing
  "abc" at once or as "a", "b", "c" emits the same text and stops at the
  same place.

Decisions:

- Several stop strings: the one that is complete first wins, i.e. the
  occurrence that ENDS earliest in the text; among those ending at the same
  place, the longer one (it starts earlier, so less text is emitted). Ending
  first rather than starting first is what makes the result independent of
  the chunking: an engine streaming token by token stops the moment a stop
  string completes and cannot wait to see whether a longer stop string that
  started earlier would also complete (stops "b" and "abc" on "abc": "a").
- Stop strings are matched on decoded text, exactly (case and whitespace
  count); an empty stop string is an error, since it would match at once.
- Duplicates are dropped, keeping the first occurrence's order; a single
  string is taken as one stop string, not as a list of characters.
- Matching uses ``str.find`` per stop string on the pending text plus the new
  piece: the pending part is shorter than the longest stop string, so a push
  costs O(len(piece) * number of stops), with at most 16 stops in practice.
"""

from __future__ import annotations

from collections.abc import Sequence

from toy.engine.sampling import SamplingError


def _normalize(stops: Sequence[str] | str) -> tuple[str, ...]:
    """The stop strings as a duplicate-free tuple, checked: strings, none empty."""
    if isinstance(stops, str):
        stops = (stops,)
    try:
        items = tuple(stops)
    except TypeError:
        raise SamplingError(f"stops={stops!r} must be a list of strings") from None
    for s in items:
        if not isinstance(s, str):
            raise SamplingError(f"stop string {s!r} must be a str, not {type(s).__name__}")
        if s == "":
            raise SamplingError("stop string '' is empty", hint="an empty stop string would end generation at once")
    return tuple(dict.fromkeys(items))


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(start, stop) of the stop occurrence in ``text`` that ends first (the longer one on a tie), or None."""
    best: tuple[int, int, str] | None = None  # (end, -length, stop): min() picks earliest end, then longest
    for stop in stops:
        start = text.find(stop)  # the first occurrence of this stop also ends first
        if start < 0:
            continue
        key = (start + len(stop), -len(stop), stop)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    end, neg_len, stop = best
    return end + neg_len, stop


class StopMatcher:
    """Incremental stop-string matcher over streamed text.

    ``push(piece)`` returns ``(text safe to emit now, stopped)``; ``flush()`` at the end of generation returns
    the text still held back. After a stop, ``matched`` names the stop string that ended the text.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = _normalize(stops)
        # Every proper prefix of every stop: a pending suffix in this set might still become a stop string.
        self._prefixes = frozenset(s[:i] for s in self.stops for i in range(1, len(s)))
        self._max_hold = max((len(s) - 1 for s in self.stops), default=0)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    @property
    def pending(self) -> str:
        """The text held back because it may be the start of a stop string."""
        return self._pending

    def _hold_length(self, text: str) -> int:
        # Longest first: the longest suffix that is a prefix covers every shorter candidate start.
        for n in range(min(self._max_hold, len(text)), 0, -1):
            if text[-n:] in self._prefixes:
                return n
        return 0

    def push(self, text: str) -> tuple[str, bool]:
        """Feed the next piece of generated text; return what may be emitted now and whether a stop was hit."""
        if not isinstance(text, str):
            raise SamplingError(f"text={text!r} must be a str, not {type(text).__name__}")
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        # A stop cannot lie entirely inside the old pending text (the last push would have found it), but it
        # can start there, so the search runs over pending + the new piece.
        buf = self._pending + text
        hit = _first_stop(buf, self.stops)
        if hit is not None:
            start, stop = hit
            self._pending = ""
            self.stopped = True
            self.matched = stop
            return buf[:start], True
        hold = self._hold_length(buf)
        cut = len(buf) - hold
        self._pending = buf[cut:]
        return buf[:cut], False

    def reset(self) -> None:
        """Start over for a new text with the same stop strings (the prefix table is kept)."""
        self._pending = ""
        self.stopped = False
        self.matched = None

    def __repr__(self) -> str:
        return f"StopMatcher(stops={self.stops!r}, pending={self._pending!r}, stopped={self.stopped})"

    def flush(self) -> str:
        """At the end of generation (no more text coming): release the held-back text."""
        out, self._pending = self._pending, ""
        return out


def truncate_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Whole-text form: ``text`` cut before the stop string that ends first, and that stop (None if none).

    Equal to pushing ``text`` through a ``StopMatcher`` in any number of pieces and then flushing.
    """
    if not isinstance(text, str):
        raise SamplingError(f"text={text!r} must be a str, not {type(text).__name__}")
    hit = _first_stop(text, _normalize(stops))
    if hit is None:
        return text, None
    start, stop = hit
    return text[:start], stop
