"""Recent replies' audio, by id, for a later turn that refers back to it (`{"role": "assistant", "audio": {"id"}}`):
only its transcript is kept (the turn the model sees is what it said), for a bounded time and number."""

import secrets
import time
from collections import OrderedDict


EXPIRY_S = 3600.0  # long enough for a conversation's next turns, short enough that old replies do not pile up


class AudioStore:
    def __init__(self, expiry_s: float = EXPIRY_S, max_items: int = 65536):
        self.expiry_s, self.max_items = expiry_s, max_items
        self.items: OrderedDict[str, tuple[str, float]] = OrderedDict()  # id -> (transcript, expires at, unix time)

    def new_id(self) -> tuple[str, int]:
        """An id for a reply's audio and when it will expire (unix seconds), before the audio exists."""
        return f"audio_{secrets.token_hex(12)}", int(time.time() + self.expiry_s)

    def put(self, audio_id: str, transcript: str, expires_at: float) -> None:
        self._expire()
        self.items[audio_id] = (transcript, expires_at)
        while len(self.items) > self.max_items:
            self.items.popitem(last=False)

    def transcript(self, audio_id: str) -> str | None:
        self._expire()
        item = self.items.get(audio_id)
        return item[0] if item else None

    def _expire(self) -> None:
        now = time.time()
        while self.items and next(iter(self.items.values()))[1] <= now:  # put in order of expiry
            self.items.popitem(last=False)
