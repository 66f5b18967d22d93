"""The heap a stage builds before it serves (model, compiled code, graphs, tokenizer) kept out of the garbage
collector's full passes: millions of long-lived objects make each a long pause, wherever allocation happens to
cross the threshold, in the middle of a decode step too. Frozen, they leave the collector only newer objects."""

import gc
import time


def freeze() -> int:
    """One full collection, then everything left frozen (gc.freeze) -> the count frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class Pauses:
    """The collector's passes while installed (gc.callbacks): their count, summed and longest milliseconds."""

    def __init__(self):
        self.count, self.total_ms, self.max_ms, self._t0 = 0, 0.0, 0.0, None

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            ms = 1000 * (time.perf_counter() - self._t0)
            self.count, self.total_ms, self.max_ms, self._t0 = self.count + 1, self.total_ms + ms, max(self.max_ms, ms), None

    def __enter__(self):
        gc.callbacks.append(self._on)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._on)
