"""Runs an engine on a thread of its own and connects it to the asyncio server.

The engine sees plain request objects and returns outputs per step; it knows nothing of gRPC. Each request's
outputs reach its RPC through an asyncio queue, then `DONE` (or an exception)."""

import asyncio
import logging
import threading
import time
from typing import Any, Protocol

from services.runtime import metrics

log = logging.getLogger(__name__)

DONE = object()


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
    def __init__(self, req, loop: asyncio.AbstractEventLoop):
        self.req, self.loop = req, loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def post(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def outputs(self):
        """Yields the request's outputs until it is done; raises what the engine raised for it."""
        while True:
            item = await self.queue.get()
            if item is DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


def post_all(items: list[tuple[Handle, Any]]) -> None:
    """Each (handle, item) onto its request's queue, in order, with one wake-up of each event loop, not one per item."""
    by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list]] = {}
    for handle, item in items:
        by_loop.setdefault(id(handle.loop), (handle.loop, []))[1].append((handle.queue, item))
    for loop, puts in by_loop.values():
        loop.call_soon_threadsafe(_put_all, puts)


def _put_all(puts: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in puts:
        queue.put_nowait(item)


class EngineWorker:
    def __init__(self, engine: Engine, stage: str):
        self.engine, self.stage = engine, stage
        self._cond = threading.Condition()
        self._new: list[Handle] = []
        self._cancelled: set[int] = set()
        self._active: list[Handle] = []
        self._stopped = False
        self.progress = time.monotonic()  # the engine thread's last step or idle wake-up: a watchdog's sign of life
        self._thread = threading.Thread(target=self._run, name=f"{stage}-engine", daemon=True)
        self._thread.start()

    def submit(self, req) -> Handle:
        handle = Handle(req, asyncio.get_running_loop())
        with self._cond:
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
        """New input arrived for a request already submitted."""
        with self._cond:
            self._cond.notify()

    def cancel(self, handle: Handle) -> None:
        with self._cond:
            self._cancelled.add(id(handle))
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _admit(self) -> None:
        for handle in self._new:
            try:
                self.engine.add(handle.req)
                self._active.append(handle)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                handle.post(exc)
        self._new.clear()
        metrics.QUEUED.labels(self.stage).set(0)

    def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        keep = []
        for handle in self._active:
            if id(handle) in self._cancelled:
                self.engine.free(handle.req)
            else:
                keep.append(handle)
        self._active = keep
        self._cancelled.clear()

    def _run(self) -> None:
        use_device(str(getattr(self.engine, "device", "cpu")))  # the current GPU is per thread
        while True:
            with self._cond:
                while not self._stopped and not self._new and not self._cancelled and not any(
                    self.engine.ready(h.req) for h in self._active
                ):
                    self._cond.wait(timeout=1.0)
                    self.progress = time.monotonic()
                if self._stopped:
                    break
                self._admit()
                self._drop_cancelled()
                batch = [h for h in self._active if self.engine.ready(h.req)]
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
                    self.engine.free(h.req)
                    posts.append((h, DONE))
                self._active = [h for h in self._active if not h.req.done]
            post_all(posts)
            metrics.ACTIVE.labels(self.stage).set(len(self._active))
        for h in self._active + self._new:
            h.post(RuntimeError(f"{self.stage} engine stopped"))
