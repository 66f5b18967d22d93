"""Incremental detokenisation: text deltas as tokens arrive, never splitting a UTF-8 character, and
stop strings found across delta boundaries (text that could begin a stop string is held back)."""

from dataclasses import dataclass, field


@dataclass
class Detokenizer:
    tokenizer: object
    stop: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    _prefix: int = 0  # ids[_prefix:_read] decode to text already produced
    _read: int = 0
    _held: str = ""  # produced, not yet sent: may be the start of a stop string
    stopped: bool = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int]) -> str:
        """The text these tokens complete (possibly empty). After a stop string, nothing more."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the bytes that finish it
        self._prefix, self._read = self._read, len(self.ids)
        return self._release(self._held + text[len(prefix_text):])

    def _release(self, pending: str) -> str:
        for s in self.stop:
            at = pending.find(s)
            if at >= 0:
                self.stopped, self._held = True, ""
                return pending[:at]
        keep = 0
        for s in self.stop:  # the longest tail of `pending` that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(pending)), keep, -1):
                if s.startswith(pending[-k:]):
                    keep = k
                    break
        self._held = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep]

    def flush(self) -> str:
        """At the end: text held back for a stop string, and incomplete bytes as U+FFFD (as a whole decode gives)."""
        if self.stopped:
            return ""
        tail = self._decode(self.ids[self._prefix:])[len(self._decode(self.ids[self._prefix:self._read])):]
        self._prefix = self._read = len(self.ids)
        out = self._release(self._held + tail)
        held, self._held = self._held, ""
        return out + ("" if self.stopped else held)
