"""Encoder routing: the replica the output path leaves idle, else the least loaded."""

import asyncio

from services.gateway.router import Router
from services.runtime.config import Replica


def test_prefers_by_modality_then_falls_back_to_the_least_loaded():
    async def body():
        r = Router([Replica(port=1, prefer_for=["text"]), Replica(port=2, prefer_for=["audio"]), Replica(port=3)],
                   stub_cls=lambda ch: None, by_modality=True)
        a, b, c = r.endpoints
        assert r.pick("text") is a and r.pick("audio") is b
        a.in_flight = 2
        assert r.pick("text") in (b, c)  # busy preferred replica: the least loaded takes it
        b.in_flight = c.in_flight = 3
        assert r.pick("text") is a  # still the least loaded
        plain = Router([Replica(port=4), Replica(port=5)], stub_cls=lambda ch: None)
        assert {plain.pick("text").index for _ in range(4)} == {0, 1}  # ties alternate
        with plain.use(plain.endpoints[0]):
            assert plain.pick().index == 1
        await r.close()
        await plain.close()

    asyncio.run(body())
