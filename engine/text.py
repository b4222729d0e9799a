"""Text out of token ids, as it firms up: one request's incremental detokeniser with stop strings."""

from __future__ import annotations

from collections.abc import Sequence


class StreamText:
    """Incremental detokenisation with stop strings: text is released only once no stop string can
    still begin inside it and no UTF-8 sequence is left half decoded."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0  # characters already released
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new: list[int]) -> tuple[str, list[int], bool]:
        """Returns (text to release, the new ids kept, whether a stop string ended the output)."""
        before = len(self.ids)
        self.ids.extend(new)
        self.text = self._decode(self.ids)
        hit = self._first_stop(self.text)
        if hit is not None:
            # Keep ids up to the one that completed the stop string; the text ends before it.
            while before < len(self.ids) and self._first_stop(self._decode(self.ids[: before + 1])) is None:
                before += 1
            kept = new[: before + 1 - (len(self.ids) - len(new))]
            self.ids = self.ids[: before + 1]
            self.text = self.text[:hit]
            return self._release(len(self.text)), kept, True
        # Hold back a half-decoded character and any tail that could still grow into a stop string.
        base = safe = len(self.text.rstrip("\ufffd"))
        for s in self.stops:
            for k in range(min(len(s) - 1, base), 0, -1):
                if self.text.endswith(s[:k], 0, base):
                    safe = min(safe, base - k)
                    break
        return self._release(safe), new, False

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _release(self, upto: int) -> str:
        delta = self.text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return delta

    def flush(self) -> str:
        return self._release(len(self.text))
