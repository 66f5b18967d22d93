"""Gateway: the public omni.v1.Omni API in front of the mesh."""

from contextlib import aclosing

from omni.v1 import omni_pb2, omni_pb2_grpc
from services.gateway.orchestrator import Gateway
from services.gateway.session import Session
from services.runtime.config import MeshConfig
from services.runtime.metrics import rpc
from services.runtime.server import Stage, add_service


class OmniServicer(omni_pb2_grpc.OmniServicer):
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    @rpc
    async def Generate(self, request, context):
        async with aclosing(self.gateway.generate(request, context.time_remaining())) as responses:
            async for response in responses:
                yield response

    @rpc(check=False)  # a bad event is answered in the session's stream, which goes on
    async def Converse(self, request_iterator, context):
        async with aclosing(Session(self.gateway).run(request_iterator)) as events:
            async for event in events:
                yield event

    @rpc
    async def GetModelInfo(self, request, context):
        return self.gateway.model_info()


async def build(cfg: MeshConfig, replica: int, server) -> Stage:
    gateway = Gateway(cfg)
    name = add_service(server, OmniServicer(gateway), omni_pb2.DESCRIPTOR.services_by_name["Omni"])
    return Stage(services=[name], close=gateway.close)
