"""Admission control: how many requests a stage holds and how many may wait for it, sized from what its engine
holds; a request that would have to wait and could not finish in time (a full queue, or a deadline shorter than the
estimated wait plus a mean hold) is refused at once with RESOURCE_EXHAUSTED and a retry hint, instead of failing
at its deadline."""

import asyncio
import math
import time
from collections import deque
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from services.runtime.errors import ResourceExhausted

# Waiting requests per slot: a slot that frees is refilled at once, and none waits past about half a request's time
QUEUE_SHARE = 0.5
UNSIZED_SLOTS = 16  # an engine run without a config (tests, tools): what one step of it takes at once
EWMA_WEIGHT = 0.2  # of each finished request in the mean hold time: follows a change of load within a few requests
MIN_RETRY_S = 0.05  # the smallest retry hint: sooner only meets the same queue

PUSHBACK = "grpc-retry-pushback-ms"  # what a client's retry policy waits for
_DEADLINE: ContextVar[float | None] = ContextVar("rpc_deadline", default=None)


def set_deadline(time_remaining: float | None) -> None:
    """The RPC being served ends `time_remaining` seconds from now (None: no deadline); read by `time_left`."""
    _DEADLINE.set(None if time_remaining is None else time.monotonic() + time_remaining)


def time_left() -> float | None:
    deadline = _DEADLINE.get()
    return None if deadline is None else deadline - time.monotonic()


def slots(section) -> int:
    """Requests a stage's engine holds at once: its batch (max_seqs), no more than its KV blocks (one each at least)."""
    n = getattr(section, "max_seqs", UNSIZED_SLOTS)
    blocks = getattr(section, "kv_blocks", 0)
    return max(1, min(n, blocks) if blocks else n)


def stage_slots(cfg, stage: str) -> int:
    """An LM stage's slots; a media stage's (preprocess, encoder), what the gateway admits for the thinkers it
    feeds, so that a request admitted there is not refused behind them."""
    section = getattr(cfg, stage)
    if hasattr(section, "max_seqs"):
        return slots(section)
    thinkers = slots(cfg.thinker) * len(cfg.thinker.replicas)
    return thinkers + queue_bound(thinkers)


def queue_bound(n_slots: int) -> int:
    return max(1, math.ceil(n_slots * QUEUE_SHARE))


@dataclass(frozen=True)
class _Status(grpc.Status):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple


class Overloaded(ResourceExhausted):
    """Refused for load, not for what the request asks: retrying after `retry_after` seconds may succeed."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = max(MIN_RETRY_S, retry_after)

    def status(self) -> grpc.Status:
        """RESOURCE_EXHAUSTED with a google.rpc.RetryInfo in its details, and gRPC's own pushback trailer."""
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(self.retry_after * 1e9))
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        status = rpc_status.to_status(status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=str(self),
                                                        details=[detail]))
        pushback = (PUSHBACK, str(math.ceil(self.retry_after * 1000)))
        return _Status(status.code, status.details, (*status.trailing_metadata, pushback))


class Limit:
    """`slots` requests at once and `bound` more waiting; refuses a waiter that cannot finish before its deadline."""

    def __init__(self, what: str, n_slots: int, bound: int | None = None):
        self.what, self.slots = what, n_slots
        self.bound = queue_bound(n_slots) if bound is None else bound
        self.mean_hold = 0.0  # seconds a request holds a slot, on average; 0: none finished yet

    def held(self, seconds: float) -> None:
        self.mean_hold = seconds if not self.mean_hold else self.mean_hold + EWMA_WEIGHT * (seconds - self.mean_hold)

    def wait(self, queued: int, running: int) -> float:
        """Estimated wait of a request arriving now: slots free at `slots / mean_hold` a second."""
        ahead = queued + running - self.slots + 1
        return 0.0 if ahead <= 0 else ahead * self.mean_hold / self.slots

    def check(self, queued: int, running: int, left: float | None) -> None:
        """Raises Overloaded unless a request arriving now may wait (`left`: seconds to its deadline)."""
        wait = max(MIN_RETRY_S, self.wait(queued, running))
        if queued + running >= self.slots + self.bound:
            raise Overloaded(f"{self.what} is at capacity: {running} requests running and {queued} waiting; retry "
                             f"in {wait:.2f} s", wait)
        if left is None or not self.wait(queued, running):
            return  # a free slot: it starts at once, whatever it will take
        if wait + self.mean_hold > left:  # admitted, it would only slow the others and fail at its deadline
            raise Overloaded(f"{self.what} cannot finish this request before its deadline: the estimated wait is "
                             f"{wait:.2f} s and a request holds a slot {self.mean_hold:.2f} s, {max(left, 0.0):.2f} s "
                             f"are left", wait)


class Gate(Limit):
    """A Limit in an asyncio process: waiting requests take freed slots in arrival order."""

    def __init__(self, what: str, n_slots: int, bound: int | None = None):
        super().__init__(what, n_slots, bound)
        self.running = 0
        self.waiters: deque[asyncio.Future] = deque()

    def refuse_early(self, left: float | None) -> None:
        """Raises Overloaded if a request arriving now would be refused: before any work is spent on it."""
        self.check(len(self.waiters), self.running, left)

    @asynccontextmanager
    async def enter(self, left: float | None):
        """Holds a slot for the body; refused at once (Overloaded) if it cannot start in time."""
        self.refuse_early(left)
        if self.running < self.slots and not self.waiters:
            self.running += 1
        else:
            await self._queue()
        t0, ok = time.monotonic(), False
        try:
            yield
            ok = True
        finally:
            if ok:
                self.held(time.monotonic() - t0)
            self._release()

    async def _queue(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await fut  # a slot handed over by `_release`, still counted in `running`
        except asyncio.CancelledError:  # the caller left while waiting: it costs nothing more
            if fut.cancelled():
                if fut in self.waiters:
                    self.waiters.remove(fut)
            else:
                self._release()  # handed a slot as it left: pass it on
            raise

    def _release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1
