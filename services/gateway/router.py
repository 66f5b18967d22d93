"""Which replica of a stage takes a call: by the request's output modality where replicas say what
they are preferred for, then by load (calls in flight from this gateway)."""

import itertools
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from services.runtime.config import Replica
from services.runtime.server import STAGE_MESSAGE_BYTES, grpc_options


@dataclass
class Endpoint:
    index: int
    replica: Replica
    channel: grpc.aio.Channel
    stub: object
    in_flight: int = 0


class Router:
    def __init__(self, replicas: list[Replica], stub_cls, by_modality: bool = False):
        self.by_modality = by_modality
        self.endpoints = [
            Endpoint(i, r, ch := grpc.aio.insecure_channel(r.address, options=grpc_options(STAGE_MESSAGE_BYTES)), stub_cls(ch))
            for i, r in enumerate(replicas)
        ]
        self._tiebreak = itertools.count()

    def pick(self, modality: str | None = None) -> Endpoint:
        """The preferred replica for `modality` if it is idle or no other is; otherwise the least loaded."""
        turn = next(self._tiebreak)
        least = min(self.endpoints, key=lambda e: (e.in_flight, (e.index - turn) % len(self.endpoints)))
        if not (self.by_modality and modality):
            return least
        preferred = [e for e in self.endpoints if modality in e.replica.prefer_for]
        if not preferred:
            return least
        best = min(preferred, key=lambda e: (e.in_flight, (e.index - turn) % len(self.endpoints)))
        return best if best.in_flight == 0 or least.in_flight >= best.in_flight else least

    @contextmanager
    def use(self, endpoint: Endpoint):
        endpoint.in_flight += 1
        try:
            yield endpoint
        finally:
            endpoint.in_flight -= 1

    async def close(self) -> None:
        for e in self.endpoints:
            await e.channel.close()
