"""Starts one stage process: a grpc.aio server with health, reflection and a Prometheus endpoint.

    python -m services.<stage> --config FILE [--replica N]
"""

import argparse
import asyncio
import ctypes
import functools
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2
from google.protobuf import message_factory
from prometheus_client import start_http_server

from omni.stage.v1 import common_pb2, load_pb2
from services.runtime import heap, metrics
from services.runtime.config import MeshConfig, load_config
from services.runtime.metrics import parse
from services.runtime.security import HANDLERS, KeyInterceptor, server_credentials
from services.runtime.worker import use_device

log = logging.getLogger(__name__)

STAGE_MESSAGE_BYTES = 1 << 30  # stages hand tensors inline where they cannot share memory
# A restarted stage is called again within a second of serving: gRPC's default backoff (1 s growing to 120 s) would
# idle it for seconds more; the connect timeout floor stays long enough for a remote host's handshake
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000),
                     ("grpc.min_reconnect_backoff_ms", 1000)]
# The services a stage offers the world (API keys apply to them); the others' callers are the mesh itself.
PUBLIC_SERVICES = {"gateway": ("omni.v1.Omni/",)}
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
# An engine thread's wait for the interpreter lock: Python's default would follow each of its device waits
SWITCH_INTERVAL_S = 0.0005
# An engine thread that neither stepped nor woke idle this long is wedged (a step takes well under a second, a first
# use's kernel compile tens of seconds): health says NOT_SERVING until it steps again
ENGINE_STALL_S = 90.0
# Wedged this much longer: the process exits, so a restart policy (compose's, the launcher's) starts it afresh
WEDGED_EXIT_S = 120.0
WATCH_EVERY_S = 1.0


@dataclass
class Stage:
    """What a stage registered on the server, and what to run when it stops."""
    services: list[str]
    close: Callable[[], Awaitable[None]] | None = None
    load: Callable[[], dict] | None = None  # EngineWorker.load, for the Load service
    stalled: Callable[[], float] | None = None  # EngineWorker.stalled_for, for the watchdog


Builder = Callable[[MeshConfig, int, grpc.aio.Server], Awaitable[Stage]]


def timings(**seconds: float) -> list[common_pb2.Timing]:
    """A reply's stage timings, the zero ones left out."""
    return [common_pb2.Timing(stage=k, seconds=v) for k, v in seconds.items() if v]


def add_service(server: grpc.aio.Server, servicer, service) -> str:
    """Registers `servicer` for `service`; unparsable requests arrive as `BadMessage` (INVALID_ARGUMENT)."""
    handlers = {}
    for m in service.methods:
        request_cls = message_factory.GetMessageClass(m.input_type)
        response_cls = message_factory.GetMessageClass(m.output_type)
        handlers[m.name] = HANDLERS[m.client_streaming, m.server_streaming](
            getattr(servicer, m.name), request_deserializer=functools.partial(parse, request_cls),
            response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    return service.full_name


def engine_stage(server: grpc.aio.Server, stage: str, cfg: MeshConfig, replica: int, engine, make_servicer, service,
                 exports_gpu_tensors: bool = False) -> Stage:
    """An engine on its own thread, a transport (its GPU pool made before serving), the servicer registered."""
    from services.runtime.admission import stage_slots
    from services.runtime.transport import Transport
    from services.runtime.worker import EngineWorker

    r = cfg.replicas(stage)[replica]
    log.info("%s[%d] engine: %s on %s", stage, replica, getattr(engine, "summary", type(engine).__name__), r.device)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    worker = EngineWorker(engine, stage, stage_slots(cfg, stage))
    transport = Transport(cfg.transport, f"{stage}{replica}")
    if exports_gpu_tensors and engine.device.type == "cuda":
        transport.cuda_pool(engine.device)
    name = add_service(server, make_servicer(worker, transport), service)

    async def close():
        worker.stop()
        transport.close()

    return Stage(services=[name], close=close, load=worker.load, stalled=worker.stalled_for)


class LoadServicer:
    """What this process is working on, for callers choosing among replicas (not itself counted)."""

    def __init__(self, stage: str, replica: int, engine_load: Callable[[], dict] | None,
                 in_flight: Callable[[], int] = metrics.in_flight):
        self.stage, self.replica, self.engine_load, self.in_flight = stage, replica, engine_load, in_flight

    async def Get(self, request, context):
        extra = self.engine_load() if self.engine_load is not None else {}
        return load_pb2.LoadReport(stage=self.stage, replica=self.replica, in_flight=self.in_flight(), **extra)


def enable_reflection(server: grpc.aio.Server, services: list[str]) -> None:
    """gRPC reflection, as `grpc.reflection.v1` (what grpcurl asks first) and `v1alpha`: one servicer answers both,
    their messages being the same on the wire."""
    names = [*services, reflection.SERVICE_NAME]
    servicer = reflection.aio.ReflectionServicer(names)
    reflection.enable_server_reflection(names, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": v1}),))


async def watchdog(health_servicer, names: list[str], stalled: Callable[[], float], on_wedged: Callable[[], None],
                   stall_s: float = ENGINE_STALL_S, exit_s: float = WEDGED_EXIT_S, every: float = WATCH_EVERY_S) -> None:
    """Health NOT_SERVING while the engine is stalled past `stall_s`, SERVING once it steps again; `on_wedged` past
    `stall_s + exit_s`."""
    serving = True
    while True:
        await asyncio.sleep(every)
        idle = stalled()
        if serving == (idle > stall_s):
            serving = not serving
            log.warning("engine is stepping again: serving" if serving else f"engine stalled for {idle:.0f} s: not serving")
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in names:
                await health_servicer.set(name, status)
        if idle > stall_s + exit_s:
            log.error("engine made no progress for %.0f s: exiting, to be started again", idle)
            on_wedged()
            return


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    # Streams one connection may carry at once: far above a stage's admission bound (the gateway's channel carries
    # every call to it), so calls reach admission and are refused there rather than waiting in the transport
    max_streams = 4096
    keepalive_ms = 20_000  # a ping after this long without data finds a peer that vanished without closing
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", STAGE_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", max_streams),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", 10_000),  # unanswered this long, the connection is closed and its calls fail
        ("grpc.http2.max_pings_without_data", 0),  # a long stream between messages keeps being pinged
        ("grpc.http2.min_ping_interval_without_data_ms", keepalive_ms // 2),  # a peer's keepalive is no abuse
        ("grpc.max_connection_idle_ms", 300_000),  # a connection without calls for 5 minutes is closed
    ]


async def serve(stage: str, cfg: MeshConfig, replica: int, build: Builder, max_message_bytes: int = STAGE_MESSAGE_BYTES) -> None:
    r = cfg.replicas(stage)[replica]
    use_device(r.device)
    metrics.set_stage(stage)
    start_http_server(r.metrics_port, addr=r.bind_address.rsplit(":", 1)[0])
    sec = cfg.security
    public = PUBLIC_SERVICES.get(stage, ())
    interceptors = [KeyInterceptor(sec.keys, public)] if sec.keys and public else []
    server = grpc.aio.server(options=grpc_options(max_message_bytes), interceptors=interceptors)
    built = await build(cfg, replica, server)
    log.info("%s[%d] froze %d objects built before serving", stage, replica, heap.freeze())
    built.services.append(add_service(server, LoadServicer(stage, replica, built.load), load_pb2.DESCRIPTOR.services_by_name["Load"]))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if public or sec.reflection:
        enable_reflection(server, [*built.services, health.SERVICE_NAME])
    creds = server_credentials(sec, stage)
    port = server.add_insecure_port(r.bind_address) if creds is None else server.add_secure_port(r.bind_address, creds)
    if port == 0:
        raise RuntimeError(f"{stage}: cannot listen on {r.bind_address}")
    stop = asyncio.Event()  # a stage that says it serves can be stopped
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    for name in ["", *built.services]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s[%d] serving on %s (metrics :%d)", stage, replica, r.bind_address, r.metrics_port)
    wedged = []
    if built.stalled is not None:
        watch = asyncio.create_task(watchdog(health_servicer, ["", *built.services], built.stalled,
                                             lambda: (wedged.append(1), stop.set())))
    await stop.wait()
    if built.stalled is not None:
        watch.cancel()
    log.info("%s[%d] stopping", stage, replica)
    # A later signal (the launcher's SIGTERM behind a SIGINT) must not cut the exit short; a hung stop gets SIGKILL
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=3)
    if built.close is not None:
        await built.close()
    if wedged:
        sys.exit(f"{stage}[{replica}]: the engine was wedged")


def die_with_launcher() -> None:
    """A launched stage (OMNI_LAUNCHER_PID) gets SIGTERM when the launcher dies, even by SIGKILL (PR_SET_PDEATHSIG)."""
    launcher = os.environ.get("OMNI_LAUNCHER_PID")
    if not launcher or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(launcher):
        sys.exit(f"the launcher (pid {launcher}) is gone")


def main(stage: str, build: Builder, max_message_bytes: Callable[[MeshConfig], int] | None = None) -> None:
    die_with_launcher()
    parser = argparse.ArgumentParser(prog=f"python -m services.{stage}")
    parser.add_argument("--config", required=True, help="mesh config (YAML)")
    parser.add_argument("--replica", type=int, default=0, help="which replica of this stage in the config")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s {stage}[{args.replica}] %(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    cfg = load_config(args.config)
    if not 0 <= args.replica < len(cfg.replicas(stage)):
        parser.error(f"--replica {args.replica}: the config lists {len(cfg.replicas(stage))} {stage} replica(s)")
    limit = max_message_bytes(cfg) if max_message_bytes else STAGE_MESSAGE_BYTES
    asyncio.run(serve(stage, cfg, args.replica, build, limit))
