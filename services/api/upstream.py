"""The api process's one channel to the gateway (the public gRPC API, nothing else), and the calls over it as the
HTTP handlers use them: cancelled when their HTTP client goes away."""

import asyncio
import time

import grpc
from starlette.requests import Request

from omni.v1 import omni_pb2, omni_pb2_grpc
from services.api.errors import ApiError, from_grpc
from services.runtime.config import SecurityConfig
from services.runtime.security import aio_channel, bearer
from services.runtime.server import RECONNECT_OPTIONS

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30), *RECONNECT_OPTIONS]
INFO_FRESH_S = 10.0  # the model the gateway serves is asked again after this long (a gateway restarted with another)


class Upstream:
    def __init__(self, address: str, timeout_s: float, security: SecurityConfig | None = None):
        security = security or SecurityConfig()
        self.address, self.timeout, self.metadata = address, timeout_s or None, bearer(security)
        self.channel = aio_channel(security, address, options=CHANNEL_OPTIONS)
        self.stub = omni_pb2_grpc.OmniStub(self.channel)
        self._info: omni_pb2.ModelInfo | None = None
        self._asked = 0.0

    async def info(self, fresh_s: float = INFO_FRESH_S) -> omni_pb2.ModelInfo:
        if self._info is None or time.monotonic() - self._asked > fresh_s:
            try:
                self._info = await self.stub.GetModelInfo(omni_pb2.GetModelInfoRequest(), timeout=5.0, metadata=self.metadata)
            except grpc.aio.AioRpcError as e:
                raise from_grpc(e) from None
            self._asked = time.monotonic()
        return self._info

    async def model(self, name: str) -> omni_pb2.ModelInfo:
        """The deployment's ModelInfo, when `name` is the model it serves (else 404, as OpenAI answers)."""
        info = await self.info()
        if name != info.model:
            raise ApiError(404, f"The model `{name}` does not exist or you do not have access to it.", param="model",
                           code="model_not_found")
        return info

    def generate(self, req: omni_pb2.GenerateRequest) -> grpc.aio.UnaryStreamCall:
        return self.stub.Generate(req, timeout=self.timeout, metadata=self.metadata)

    async def close(self) -> None:
        await self.channel.close()


async def next_event(call: grpc.aio.UnaryStreamCall) -> omni_pb2.GenerateResponse | None:
    """The call's next response, None at its end; its failure as the ApiError it maps to."""
    try:
        out = await call.read()
    except grpc.aio.AioRpcError as e:
        raise from_grpc(e) from None
    return None if out is grpc.aio.EOF else out


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Gone(Exception):
    """The HTTP client disconnected before its reply began (answered 499, as nginx counts it, to no one)."""


async def unless_gone(request: Request, call: grpc.aio.UnaryStreamCall, work):
    """Awaits `work` (reading `call`), cancelling the call if the HTTP client disconnects first: every stage then
    lets go of the request. Once a streamed response has begun, Starlette's own watch cancels its body instead."""
    watch = asyncio.ensure_future(_disconnected(request))
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait([watch, task], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise Gone()
        return task.result()
    finally:
        watch.cancel()
        if not task.done():  # the client left, or this handler was cancelled
            call.cancel()
            task.cancel()
