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
- Matching is linear: each stop string gets a Knuth-Morris-Pratt failure
  table (one int per character) when the matcher is built, and every pushed
  character advances one match state per stop string (amortized O(1)). So
  building costs O(total length of the stop strings) in time and memory, and a
  push O(len(piece) * number of stops), whatever the stops' lengths. (An
  earlier version kept every prefix of every stop string in a set: memory
  quadratic in a stop's length, ~800 MB for one 40,000-character stop.) Callers
  facing untrusted input still bound the stops' count and length (the server:
  16 strings of at most ``toy_serve.schemas.MAX_STOP_CHARS`` characters).
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


def _failure(stop: str) -> list[int]:
    """KMP failure table: ``f[i]`` = length of the longest proper prefix of ``stop[:i+1]`` that is also its suffix."""
    f = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        c = stop[i]
        while k and stop[k] != c:
            k = f[k - 1]
        if stop[k] == c:
            k += 1
        f[i] = k
    return f


class StopMatcher:
    """Incremental stop-string matcher over streamed text.

    ``push(piece)`` returns ``(text safe to emit now, stopped)``; ``flush()`` at the end of generation returns
    the text still held back. After a stop, ``matched`` names the stop string that ended the text.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = _normalize(stops)
        self._fail = [_failure(s) for s in self.stops]
        # _state[i]: length of the longest suffix of the text so far that is a prefix of stops[i] (< its length)
        self._state = [0] * len(self.stops)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    @property
    def pending(self) -> str:
        """The text held back because it may be the start of a stop string."""
        return self._pending

    def _advance(self, c: str) -> str | None:
        """Feed one character to every stop's automaton; the stop completed by it (the longest), or None."""
        done = None
        state, stops, fails = self._state, self.stops, self._fail
        for i, stop in enumerate(stops):
            k = state[i]
            while k and stop[k] != c:
                k = fails[i][k - 1]
            if stop[k] == c:
                k += 1
            if k == len(stop):
                if done is None or len(stop) > len(done):
                    done = stop
                k = fails[i][k - 1]
            state[i] = k
        return done

    def push(self, text: str) -> tuple[str, bool]:
        """Feed the next piece of generated text; return what may be emitted now and whether a stop was hit."""
        if not isinstance(text, str):
            raise SamplingError(f"text={text!r} must be a str, not {type(text).__name__}")
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        # The held-back text is exactly the longest current match (every shorter one is its suffix), so a stop
        # completed inside this piece starts within pending + piece.
        buf = self._pending + text
        base = len(self._pending)
        for j, c in enumerate(text):
            stop = self._advance(c)
            if stop is not None:
                self._pending = ""
                self.stopped = True
                self.matched = stop
                return buf[: base + j + 1 - len(stop)], True
        hold = max(self._state)
        cut = len(buf) - hold
        self._pending = buf[cut:]
        return buf[:cut], False

    def reset(self) -> None:
        """Start over for a new text with the same stop strings (the failure tables are kept)."""
        self._pending = ""
        self._state = [0] * len(self.stops)
        self.stopped = False
        self.matched = None

    def __repr__(self) -> str:
        return f"StopMatcher(stops={self.stops!r}, pending={self._pending!r}, stopped={self.stopped})"

    def flush(self) -> str:
        """At the end of generation (no more text coming): release the held-back text."""
        out, self._pending = self._pending, ""
        self._state = [0] * len(self.stops)
        return out


def truncate_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Whole-text form: ``text`` cut before the stop string that ends first, and that stop (None if none).

    Equal to pushing ``text`` through a ``StopMatcher`` in any number of pieces and then flushing.
    """
    if not isinstance(text, str):
        raise SamplingError(f"text={text!r} must be a str, not {type(text).__name__}")
    m = StopMatcher(stops)
    out, stopped = m.push(text)
    return (out, m.matched) if stopped else (text, None)
