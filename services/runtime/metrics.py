"""Prometheus metrics every stage exports, and the decorator that counts each RPC by its status."""

import asyncio
import contextlib
import functools
import inspect
import logging
import time

import grpc
from prometheus_client import Counter, Gauge, Histogram

from services.runtime import admission
from services.runtime.errors import InvalidArgument, OmniError

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

REQUESTS = Counter("omni_requests", "RPCs served, by final status", ["stage", "method", "code"])
LATENCY = Histogram("omni_request_seconds", "RPC duration", ["stage", "method"], buckets=_LATENCY_BUCKETS)
INFLIGHT = Gauge("omni_inflight_requests", "RPCs in progress", ["stage", "method"])
STEP = Histogram("omni_step_seconds", "Engine step duration", ["stage", "kind"], buckets=_STEP_BUCKETS)
ACTIVE = Gauge("omni_active_sequences", "Requests holding engine state (KV cache, talker state)", ["stage"])
QUEUED = Gauge("omni_queued_requests", "Requests waiting for the engine", ["stage"])
QUEUE_WAIT = Histogram("omni_queue_wait_seconds", "How long a request waited for its stage's engine to first take it",
                       ["stage"], buckets=_LATENCY_BUCKETS)
TOKENS = Counter("omni_generated_tokens", "Tokens (thinker) or frames (talker) produced", ["stage"])

TRANSPORT_BYTES = Counter("omni_transport_bytes", "Tensor bytes handed over", ["transport", "direction"])
TRANSPORT_TRANSFERS = Counter("omni_transport_transfers", "Tensors handed over", ["transport", "direction"])
SHM_SLOTS = Gauge("omni_shm_slots_in_use", "Tensor pool slots allocated and not yet released", ["pool"])
SHM_BYTES = Gauge("omni_shm_bytes_in_use", "Tensor pool bytes allocated and not yet released", ["pool"])
SHM_RECLAIMED = Counter("omni_shm_slots_reclaimed", "Slots reclaimed after their consumer never released them", ["pool"])
SHM_FALLBACKS = Counter("omni_shm_fallbacks", "Tensors sent another way because their pool was full", ["pool"])

STAGE = "unknown"
_IN_FLIGHT = 0  # RPCs in progress, every method (what the Load service reports)


def in_flight() -> int:
    return _IN_FLIGHT


def set_stage(name: str) -> None:
    global STAGE
    STAGE = name


def _status_of(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, OmniError):
        return exc.code
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code()
    if isinstance(exc, grpc.aio.AbortError):
        return grpc.StatusCode.UNKNOWN
    return grpc.StatusCode.INTERNAL


STATUS_DETAILS = "grpc-status-details-bin"  # google.rpc.Status (RetryInfo and friends) in the trailers


async def _abort(context, exc: BaseException):
    if isinstance(exc, admission.Overloaded):
        status = exc.status()
        await context.abort(status.code, status.details, status.trailing_metadata)
    if isinstance(exc, OmniError):
        await context.abort(exc.code, str(exc))
    if isinstance(exc, grpc.aio.AioRpcError):  # a downstream stage's status, passed on with its details
        details = tuple((k, v) for k, v in (exc.trailing_metadata() or ()) if k in (STATUS_DETAILS, admission.PUSHBACK))
        await context.abort(exc.code(), exc.details() or "", details)
    log.exception("internal error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


class BadMessage:
    """A request that did not parse; the method answers it with INVALID_ARGUMENT."""

    def __init__(self, type_name: str, error: Exception):
        self.problem = f"malformed {type_name}: {error}"


def parse(cls, data: bytes):
    try:
        return cls.FromString(data)
    except Exception as e:  # noqa: BLE001 - DecodeError and friends
        return BadMessage(cls.DESCRIPTOR.full_name, e)


async def _checked(requests):
    async for r in requests:
        if isinstance(r, BadMessage):
            raise InvalidArgument(r.problem)
        yield r


def _check(request):
    if isinstance(request, BadMessage):
        raise InvalidArgument(request.problem)
    return request if not hasattr(request, "__aiter__") else _checked(request)


def rpc(fn=None, *, check: bool = True):
    """Wraps a servicer method (unary or streaming): metrics by status, OmniError -> gRPC status. `check=False`:
    the method is handed unparsable messages (BadMessage) of its request stream to answer itself."""
    if fn is None:
        return functools.partial(rpc, check=check)
    method = fn.__name__
    screen = _check if check else (lambda request: request)

    def start(context):
        global _IN_FLIGHT
        admission.set_deadline(context.time_remaining())  # for the stage's admission of this call
        _IN_FLIGHT += 1
        INFLIGHT.labels(STAGE, method).inc()
        return time.perf_counter()

    def finish(t0: float, code: grpc.StatusCode, context) -> None:
        global _IN_FLIGHT
        if code == grpc.StatusCode.OK and context.cancelled():
            code = _cancel_code(context)
        _IN_FLIGHT -= 1
        INFLIGHT.labels(STAGE, method).dec()
        LATENCY.labels(STAGE, method).observe(time.perf_counter() - t0)
        REQUESTS.labels(STAGE, method, code.name).inc()

    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def stream(self, request, context):
            t0, code = start(context), grpc.StatusCode.OK
            try:
                # Closed however the call ends, so its finally blocks run now, not when a collection finds it
                async with contextlib.aclosing(fn(self, screen(request), context)) as items:
                    async for item in items:
                        yield item
            except BaseException as exc:  # noqa: BLE001 - every failure becomes a status
                code = _outcome(exc, context)
                await _end(context, exc)
            finally:
                finish(t0, code, context)
        return stream

    @functools.wraps(fn)
    async def unary(self, request, context):
        t0, code = start(context), grpc.StatusCode.OK
        try:
            return await fn(self, screen(request), context)
        except BaseException as exc:  # noqa: BLE001
            code = _outcome(exc, context)
            await _end(context, exc)
        finally:
            finish(t0, code, context)
    return unary


def _outcome(exc: BaseException, context) -> grpc.StatusCode:
    return _cancel_code(context) if _is_cancel(exc) else _status_of(exc)


def _cancel_code(context) -> grpc.StatusCode:
    """A call that ended unfinished: its deadline passed (the server's clock says none is left), or its caller left."""
    left = context.time_remaining()
    return grpc.StatusCode.DEADLINE_EXCEEDED if left is not None and left <= 0 else grpc.StatusCode.CANCELLED


async def _end(context, exc: BaseException) -> None:
    """Ends the RPC with the status `exc` maps to; a caller that went away, or an abort under way, passes through."""
    if _is_cancel(exc) or isinstance(exc, grpc.aio.AbortError):
        raise exc
    await _abort(context, exc)


def _is_cancel(exc: BaseException) -> bool:
    return isinstance(exc, (asyncio.CancelledError, GeneratorExit))  # GeneratorExit: the caller left mid-stream
