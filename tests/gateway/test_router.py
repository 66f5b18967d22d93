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
        fixed = Router([Replica(port=6, prefer_for=["text"]), Replica(port=7, prefer_for=["audio"]), Replica(port=8)],
                       stub_cls=lambda ch: None, fixed=True)
        fixed.endpoints[0].in_flight = 5  # busy, and taken all the same: a fixed map
        assert fixed.pick("text") is fixed.endpoints[0] and fixed.pick("audio") is fixed.endpoints[1]
        assert fixed.pick(None) is not fixed.endpoints[0]  # no modality: by load, around the busy one
        await fixed.close()
        plain = Router([Replica(port=4), Replica(port=5)], stub_cls=lambda ch: None)
        assert {plain.pick("text").index for _ in range(4)} == {0, 1}  # ties alternate
        with plain.use(plain.endpoints[0]):
            assert plain.pick().index == 1
        await r.close()
        await plain.close()

    asyncio.run(body())


def test_routes_by_what_replicas_report_and_around_one_that_does_not_answer():
    """Two real gRPC servers answering Load (one busy with other callers' work) and an address nobody serves."""
    import grpc

    from conftest import free_ports
    from omni.stage.v1 import load_pb2
    from services.runtime.server import LoadServicer, add_service

    async def body():
        ports = free_ports(3)
        busy = {"n": 5}
        servers = []
        for i, in_flight in enumerate((lambda: busy["n"], lambda: 0)):
            server = grpc.aio.server()
            add_service(server, LoadServicer("encoder", i, lambda: {"queued": 1, "active": 2, "kv_used": 0.5}, in_flight),
                        load_pb2.DESCRIPTOR.services_by_name["Load"])
            server.add_insecure_port(f"127.0.0.1:{ports[i]}")
            await server.start()
            servers.append(server)
        r = Router([Replica(port=ports[0], prefer_for=["text"]), Replica(port=ports[1]), Replica(port=ports[2])],
                   stub_cls=lambda ch: None, by_modality=True, poll_s=0.05)
        a, b, dead = r.endpoints
        await r.poll_once()
        assert (a.others, a.kv_used, b.others) == (5, 0.5, 0) and not dead.reachable
        assert r.pick("text") is b  # the preferred replica is busy with work this gateway never sent
        assert all(r.pick() is b for _ in range(3))  # never the one that does not answer, while another does
        busy["n"] = 0
        r.pick()  # starts the poller
        for _ in range(100):  # its next answered poll (one may miss its 0.5 s deadline on a loaded machine)
            await asyncio.sleep(0.05)
            if a.reachable and a.others == 0:
                break
        assert a.others == 0 and r.pick("text") is a
        with r.use(a):  # a report that counted our own call does not count it twice
            busy["n"] = 1
            await r.poll_once()
            assert a.others == 0 and a.load == 1
        await r.close()
        for s in servers:
            await s.stop(None)

    asyncio.run(body())


def test_a_call_that_finds_its_replica_gone_names_it_and_later_calls_go_around_it():
    """A replica's server stops (its process died): the call through it fails as UNAVAILABLE naming the stage and
    the replica, the next picks take the other replica, and once the replica answers its load report again it is
    picked again. Other failures pass through as they came."""
    import grpc
    import pytest

    from conftest import free_ports
    from omni.stage.v1 import load_pb2
    from services.runtime.errors import Unavailable
    from services.runtime.server import LoadServicer, add_service

    async def serve(port: int):
        server = grpc.aio.server()
        add_service(server, LoadServicer("thinker", 0, lambda: {}, lambda: 0), load_pb2.DESCRIPTOR.services_by_name["Load"])
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server

    async def body():
        ports = free_ports(2)
        servers = [await serve(p) for p in ports]
        r = Router([Replica(port=ports[0]), Replica(port=ports[1])], stub_cls=lambda ch: None, poll_s=60, stage="thinker")
        a, b = r.endpoints
        await r.poll_once()
        assert a.reachable and b.reachable
        await servers[0].stop(None)
        with pytest.raises(Unavailable, match=rf"thinker replica 0 \(127.0.0.1:{ports[0]}\) is unavailable"):
            with r.use(a):
                await a.load_stub.Get(load_pb2.LoadRequest(), timeout=5)
        assert not a.reachable and a.in_flight == 0
        assert all(r.pick() is b for _ in range(4))  # whatever the tie-break's turn
        with pytest.raises(grpc.aio.AioRpcError) as other:  # not the replica gone: as it came
            with r.use(b):
                await b.channel.unary_unary("/omni.stage.v1.Load/NoSuchMethod")(b"", timeout=5)
        assert other.value.code() == grpc.StatusCode.UNIMPLEMENTED and b.reachable
        servers[0] = await serve(ports[0])  # back (restarted)
        for _ in range(100):  # its channel reconnects after gRPC's backoff (a second or so)
            await r.poll_once()
            if a.reachable:
                break
            await asyncio.sleep(0.1)
        assert a.reachable and {r.pick().index for _ in range(4)} == {0, 1}
        await r.close()
        for s in servers:
            await s.stop(None)

    asyncio.run(body())
