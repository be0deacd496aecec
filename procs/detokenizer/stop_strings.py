"""Stop-string matching on streamed text.

Text that could still be the start of a stop string is held back; once a stop string appears, only
the text before it (with `include_match`, up to its end) is released and nothing after it ever is.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Filters one request's text stream for its stop strings.

    Invariant: the held text is the longest suffix of everything fed so far that is a proper prefix
    of some stop string. So a match can never start inside text already released, and searching
    `held + new` finds every match.
    """

    def __init__(self, stop: Sequence[str] = (), *, include_match: bool = False) -> None:
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))  # no empties
        self._include_match = include_match
        self._held = ""
        self.matched: str | None = None

    @property
    def active(self) -> bool:
        return bool(self._stops)

    @property
    def held(self) -> str:
        return self._held

    def feed(self, text: str) -> str:
        """Add new text; return the part that is safe to release (up to a match, if one occurs)."""
        if self.matched is not None:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        match_at, matched = self._earliest_match(buffer)
        if matched is not None:
            self.matched = matched
            self._held = ""
            return buffer[: match_at + len(matched) if self._include_match else match_at]
        keep = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Release the held text: the stream ended, so it can no longer become a stop string."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _earliest_match(self, buffer: str) -> tuple[int, str | None]:
        """The match that completes first in the stream (so the result does not depend on how the
        text was split into `feed` calls); at an equal end the longer, earlier-starting one."""
        best_end, best_at, best = len(buffer) + 1, -1, None
        for stop in self._stops:
            at = buffer.find(stop, 0, best_end)  # only matches ending at or before best_end
            if at == -1:
                continue
            end = at + len(stop)
            if end < best_end or at < best_at:
                best_end, best_at, best = end, at, stop
        return best_at, best

    def _longest_partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
