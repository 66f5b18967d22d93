"""A gateway the test plays: omni.v1.Omni on a real socket, failing each Generate with the status its first text part
names ("status:RESOURCE_EXHAUSTED:2500" adds a grpc-retry-pushback-ms trailer of 2500), or "midstream": a delta and
then INTERNAL. The api process's mapping of every gRPC status is seen from its HTTP side."""

from concurrent import futures

import grpc

from omni.v1 import omni_pb2, omni_pb2_grpc


class FakeOmni(omni_pb2_grpc.OmniServicer):
    def GetModelInfo(self, request, context):
        return omni_pb2.ModelInfo(model="fake", limits=omni_pb2.Limits(max_request_bytes=1 << 20))

    def Generate(self, request, context):
        what = request.messages[-1].parts[0].text
        if what == "midstream":
            yield omni_pb2.GenerateResponse(text=omni_pb2.TextDelta(text="so far", token_ids=[1]))
            context.abort(grpc.StatusCode.INTERNAL, "the thinker failed midway")
        _, name, *pushback = what.split(":")
        if pushback:
            context.set_trailing_metadata((("grpc-retry-pushback-ms", pushback[0]),))
        context.abort(grpc.StatusCode[name], f"fake {name}")


def serve() -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    omni_pb2_grpc.add_OmniServicer_to_server(FakeOmni(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"
