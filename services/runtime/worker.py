"""Runs an engine on a thread of its own and connects it to the asyncio server.

The engine sees plain request objects and returns outputs per step; it knows nothing of gRPC. Each request's
outputs reach its RPC through an asyncio queue, then `DONE` (or an exception). The engine holds at most its
admission slots; a bounded queue waits behind them, and a request whose reader fell behind is not stepped."""

import asyncio
import logging
import threading
import time
from typing import Any, Protocol

from services.runtime import admission, metrics

log = logging.getLogger(__name__)

DONE = object()
# Step outputs a request may run ahead of its RPC's reader: past that the reader stalled, and the engine skips it
OUTPUT_BOUND = 16


def use_device(device: str) -> None:
    """Makes `device` this thread's current GPU: CUDA keeps one per thread, and events naming no device go there."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(device)


class Engine(Protocol):
    def add(self, req) -> None: ...
    def ready(self, req) -> bool: ...
    def step(self, reqs: list) -> list[tuple[Any, Any]]: ...
    def free(self, req) -> None: ...


class Handle:
    def __init__(self, req, loop: asyncio.AbstractEventLoop, wake=None):
        self.req, self.loop, self.wake = req, loop, wake
        self.queue: asyncio.Queue = asyncio.Queue()
        self.posted = self.taken = 0  # outputs handed over (engine thread) and read (event loop)
        self.admitted = 0.0  # when the engine took it

    @property
    def backlog(self) -> int:
        return self.posted - self.taken

    def post(self, item) -> None:
        self.posted += 1
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def outputs(self):
        """Yields the request's outputs until it is done; raises what the engine raised for it."""
        while True:
            item = await self.queue.get()
            self.taken += 1
            if self.backlog == OUTPUT_BOUND - 1 and self.wake is not None:
                self.wake()  # back under the bound: the engine steps it again
            if item is DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


def post_all(items: list[tuple[Handle, Any]]) -> None:
    """Each (handle, item) onto its request's queue, in order, with one wake-up of each event loop, not one per item."""
    by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list]] = {}
    for handle, item in items:
        handle.posted += 1
        by_loop.setdefault(id(handle.loop), (handle.loop, []))[1].append((handle.queue, item))
    for loop, puts in by_loop.values():
        loop.call_soon_threadsafe(_put_all, puts)


def _put_all(puts: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in puts:
        queue.put_nowait(item)


class EngineWorker:
    def __init__(self, engine: Engine, stage: str, slots: int = admission.UNSIZED_SLOTS):
        """`slots`: requests the engine holds at once (admission.stage_slots); a bounded queue waits behind them."""
        self.engine, self.stage = engine, stage
        self.limit = admission.Limit(stage, slots)
        self._cond = threading.Condition()
        self._new: list[Handle] = []
        self._cancelled: set[Handle] = set()
        self._active: list[Handle] = []
        self._held: set[Handle] = set()  # not stepped: their readers are behind
        self._stopped = False
        self.progress = time.monotonic()  # the engine thread's last step or idle wake-up: a watchdog's sign of life
        self._thread = threading.Thread(target=self._run, name=f"{stage}-engine", daemon=True)
        self._thread.start()

    def submit(self, req) -> Handle:
        """Queues `req` for the engine; refused (Overloaded) if the queue is full or it cannot finish in time."""
        handle = Handle(req, asyncio.get_running_loop(), self.notify)
        with self._cond:
            self.limit.check(len(self._new), len(self._active), admission.time_left())
            self._new.append(handle)
            metrics.QUEUED.labels(self.stage).set(len(self._new))
            self._cond.notify()
        return handle

    def load(self) -> dict:
        """Requests waiting, requests held, and KV cache use."""
        allocator = getattr(getattr(self.engine, "scheduler", None), "allocator", None)
        kv = allocator.used / allocator.num_blocks if allocator is not None and allocator.num_blocks else 0.0
        return {"queued": len(self._new), "active": len(self._active), "kv_used": kv}

    def stalled_for(self) -> float:
        """Seconds since the engine thread last stepped or woke idle (it wakes at least every second)."""
        return time.monotonic() - self.progress

    def notify(self) -> None:
        """New input arrived for a request already submitted, or its reader caught up."""
        with self._cond:
            self._cond.notify()

    def cancel(self, handle: Handle) -> None:
        with self._cond:
            self._cancelled.add(handle)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # -- admission (under the lock) ------------------------------------------------------------------

    def _admissible(self) -> bool:
        return bool(self._new) and len(self._active) < self.limit.slots

    def _admit(self) -> None:
        """Queued requests into the engine, oldest first, while it has slots."""
        while self._admissible():
            handle = self._new.pop(0)
            try:
                self.engine.add(handle.req)
                handle.admitted = time.perf_counter()
                self._active.append(handle)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                handle.post(exc)
        metrics.QUEUED.labels(self.stage).set(len(self._new))

    def _drop_cancelled(self) -> None:
        """Callers that left: queued requests never reach the engine, started ones free what they hold."""
        if not self._cancelled:
            return
        gone, self._cancelled = self._cancelled, set()
        self._new = [h for h in self._new if h not in gone]
        keep = []
        for handle in self._active:
            if handle in gone:
                self.engine.free(handle.req)
                self._held.discard(handle)
            else:
                keep.append(handle)
        self._active = keep

    def _steppable(self) -> list[Handle]:
        """Active requests ready for a step whose readers keep up; the engine's scheduler told which are held."""
        batch = []
        for h in self._active:
            behind = h.backlog >= OUTPUT_BOUND
            if behind != (h in self._held):
                self._hold(h, behind)
            if not behind and self.engine.ready(h.req):
                batch.append(h)
        return batch

    def _hold(self, handle: Handle, on: bool) -> None:
        (self._held.add if on else self._held.discard)(handle)
        hold = getattr(getattr(self.engine, "scheduler", None), "hold", None)  # engines that step what they hold
        if hold is not None:
            hold(handle.req, on)

    def _finished(self, handle: Handle) -> None:
        self.engine.free(handle.req)
        self._held.discard(handle)
        self.limit.held(time.perf_counter() - handle.admitted)

    def _run(self) -> None:
        use_device(str(getattr(self.engine, "device", "cpu")))  # the current GPU is per thread
        while True:
            with self._cond:
                while not (self._stopped or self._cancelled or self._admissible() or self._steppable()):
                    self._cond.wait(timeout=1.0)
                    self.progress = time.monotonic()
                if self._stopped:
                    break
                self._drop_cancelled()
                self._admit()
                batch = self._steppable()
            metrics.ACTIVE.labels(self.stage).set(len(self._active))
            if not batch:
                continue
            by_req = {id(h.req): h for h in self._active}  # an engine may advance requests it was not asked about
            t0 = time.perf_counter()
            try:
                outputs = self.engine.step([h.req for h in batch])
                posts = [(by_req[id(req)], out) for req, out in outputs]
            except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
                log.exception("engine step failed")
                for h in batch:
                    h.req.done = True
                posts = [(h, exc) for h in batch]
            metrics.STEP.labels(self.stage, "step").observe(time.perf_counter() - t0)
            self.progress = time.monotonic()
            with self._cond:
                for h in [h for h in self._active if h.req.done]:
                    self._finished(h)
                    posts.append((h, DONE))
                self._active = [h for h in self._active if not h.req.done]
            post_all(posts)
            metrics.ACTIVE.labels(self.stage).set(len(self._active))
        for h in self._active + self._new:
            h.post(RuntimeError(f"{self.stage} engine stopped"))
