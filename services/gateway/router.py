"""Which replica of a stage takes a call: by the request's output modality where replicas are preferred for
one, then by load. Load is this gateway's calls in flight plus what the replica last reported (polled every
`poll_s`) less our calls it may have counted, so our own ended call never makes it look busy. A replica that
stopped answering is picked only when none answers."""

import asyncio
import itertools
import logging
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from omni.stage.v1 import load_pb2, load_pb2_grpc
from services.runtime.config import Replica, SecurityConfig
from services.runtime.errors import Unavailable
from services.runtime.security import aio_channel
from services.runtime.server import RECONNECT_OPTIONS, STAGE_MESSAGE_BYTES, grpc_options

log = logging.getLogger(__name__)

LOAD_POLL_S = 0.1  # for stages of several replicas


@dataclass
class Endpoint:
    index: int
    replica: Replica
    channel: grpc.aio.Channel
    stub: object
    load_stub: object = None
    in_flight: int = 0  # this gateway's calls
    started: int = 0  # this gateway's calls ever started
    others: int = 0  # other callers' calls in flight at the replica's last report
    kv_used: float = 0.0
    reachable: bool = True

    @property
    def load(self) -> int:
        return self.in_flight + self.others


class Router:
    def __init__(self, replicas: list[Replica], stub_cls, by_modality: bool = False, poll_s: float = 0.0,
                 fixed: bool = False, stage: str = "stage", security: SecurityConfig | None = None):
        """`by_modality`: the preferred replica while idle or least loaded; `fixed`: whatever its load."""
        self.by_modality, self.fixed, self.poll_s, self.stage = by_modality or fixed, fixed, poll_s, stage
        self.endpoints = []
        for i, r in enumerate(replicas):
            channel = aio_channel(security or SecurityConfig(), r.address, options=grpc_options(STAGE_MESSAGE_BYTES) + RECONNECT_OPTIONS)
            self.endpoints.append(Endpoint(i, r, channel, stub_cls(channel), load_pb2_grpc.LoadStub(channel)))
        self._tiebreak = itertools.count()
        self._poller: asyncio.Task | None = None

    def _key(self, turn: int):
        return lambda e: (not e.reachable, e.load, e.kv_used, (e.index - turn) % len(self.endpoints))

    def pick(self, modality: str | None = None) -> Endpoint:
        """The preferred replica for `modality` if it is idle or no other is less loaded; otherwise the least loaded."""
        if self.poll_s > 0 and self._poller is None and len(self.endpoints) > 1:
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        key = self._key(next(self._tiebreak))
        least = min(self.endpoints, key=key)
        if not (self.by_modality and modality):
            return least
        preferred = [e for e in self.endpoints if modality in e.replica.prefer_for and e.reachable]
        if not preferred:
            return least
        best = min(preferred, key=key)
        return best if self.fixed or best.load == 0 or least.load >= best.load else least

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._report(e) for e in self.endpoints))

    async def _report(self, e: Endpoint) -> None:
        ours, started = e.in_flight, e.started
        try:
            r = await e.load_stub.Get(load_pb2.LoadRequest(), timeout=max(2 * self.poll_s, 0.5))
        except grpc.aio.AioRpcError as exc:
            if e.reachable:
                log.warning("%s: no load report (%s): routing around it", e.replica.address, exc.code().name)
            e.reachable, e.others = False, 0
            return
        # Every call of ours between ask and answer: too few others rather than too many, which idles a replica
        counted = ours + (e.started - started)
        e.reachable, e.others, e.kv_used = True, max(0, r.in_flight - counted), r.kv_used

    async def _poll(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.poll_s)

    @contextmanager
    def use(self, endpoint: Endpoint):
        """A call to `endpoint`, counted; UNAVAILABLE becomes Unavailable, the replica avoided until it reports."""
        endpoint.in_flight += 1
        endpoint.started += 1
        try:
            yield endpoint
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            if self.poll_s > 0 and len(self.endpoints) > 1:  # the poller marks it reachable again
                endpoint.reachable = False
            raise Unavailable(f"{self.stage} replica {endpoint.index} ({endpoint.replica.address}) is unavailable: "
                              f"{exc.details()}") from exc
        finally:
            endpoint.in_flight -= 1

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for e in self.endpoints:
            await e.channel.close()
