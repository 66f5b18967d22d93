"""The load generator's own ceiling: it drives a fake Omni server that streams as fast as it can.

    python -m bench.ceiling [--concurrency 1,16,64] [--tokens 256] [--chunks 10] [--server-procs 2]

The fake server sends `tokens` one-token TextDeltas and `chunks` PCM16 AudioChunks of `chunk_frames`
frames per request, with no model behind it. What matters is the client's CPU time per message: a
client at 100% CPU is the bottleneck; the mesh's message rate must stay well below 1e6 / us_per_msg.
"""

import argparse
import asyncio
import json
import multiprocessing
import socket

import grpc

from bench.loadgen import MeshClient
from bench.records import summarize
from omni.v1 import omni_pb2, omni_pb2_grpc


class FakeOmni(omni_pb2_grpc.OmniServicer):
    def __init__(self, tokens: int, chunks: int, chunk_frames: int):
        self.tokens, self.chunks = tokens, chunks
        self.pcm = bytes(2 * 1920 * chunk_frames)

    async def Generate(self, request, context):
        rid = request.request_id or "fake"
        every = max(1, self.tokens // max(self.chunks, 1))
        sent = 0
        for t in range(self.tokens):
            yield omni_pb2.GenerateResponse(request_id=rid, text=omni_pb2.TextDelta(text="x", token_ids=[t]))
            if self.chunks and (t + 1) % every == 0 and sent < self.chunks:
                yield omni_pb2.GenerateResponse(request_id=rid, audio=omni_pb2.AudioChunk(data=self.pcm, index=sent, sample_rate=24000))
                sent += 1
        usage = omni_pb2.Usage(completion_tokens=self.tokens, audio_frames=0)
        yield omni_pb2.GenerateResponse(request_id=rid, finished=omni_pb2.Finished(reason=omni_pb2.FINISH_REASON_LENGTH, usage=usage))

    async def GetModelInfo(self, request, context):
        return omni_pb2.ModelInfo(model="fake")


def serve(port: int, tokens: int, chunks: int, chunk_frames: int, ready) -> None:
    async def main():
        # SO_REUSEPORT (grpc's default on Linux) lets several server processes share the port.
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 1 << 30), ("grpc.so_reuseport", 1)])
        omni_pb2_grpc.add_OmniServicer_to_server(FakeOmni(tokens, chunks, chunk_frames), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


async def measure(address: str, concurrency: list[int], requests_per_slot: int, channels: int) -> list[dict]:
    client = MeshClient(address, channels)
    cells = []
    try:
        for b in concurrency:
            req = omni_pb2.GenerateRequest(messages=[omni_pb2.Message(role=omni_pb2.ROLE_USER, parts=[omni_pb2.Part(text="hi")])])
            await client.closed_loop([(i, req) for i in range(b)], b)  # warm-up
            loop = await client.closed_loop([(i, req) for i in range(requests_per_slot * b)], b)
            cell = summarize(loop.records, loop.duration)
            cells.append({"concurrency": b, "requests": cell["requests"], "failures": cell["failures"],
                          "msgs_per_s": loop.messages / loop.duration, "output_tok_per_s": cell["output_tok_per_s"],
                          "client_cpu_frac": loop.client_cpu_s / loop.duration, "client_us_per_msg": 1e6 * loop.client_cpu_s / loop.messages})
    finally:
        await client.close()
    return cells


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--chunks", type=int, default=10)
    p.add_argument("--chunk-frames", type=int, default=25)
    p.add_argument("--requests-per-slot", type=int, default=4)
    p.add_argument("--channels", type=int, default=4)
    p.add_argument("--server-procs", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print the cells as JSON")
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    servers = []
    for _ in range(args.server_procs):
        ready = ctx.Event()
        proc = ctx.Process(target=serve, args=(port, args.tokens, args.chunks, args.chunk_frames, ready), daemon=True)
        proc.start()
        servers.append(proc)
        if not ready.wait(60):
            raise RuntimeError("the fake server did not start")
    try:
        concurrency = [int(b) for b in args.concurrency.split(",")]
        cells = asyncio.run(measure(f"127.0.0.1:{port}", concurrency, args.requests_per_slot, args.channels))
    finally:
        for proc in servers:
            proc.terminate()
            proc.join(10)
    if args.json:
        print(json.dumps(cells, indent=1))
    for c in cells:
        print(f"B={c['concurrency']:<3} {c['msgs_per_s']:8.0f} msg/s {c['output_tok_per_s']:8.0f} tok/s  "
              f"client CPU {c['client_cpu_frac']:4.0%}  "
              f"{c['client_us_per_msg']:5.1f} us/msg  {c['failures']} failed")
    return cells


if __name__ == "__main__":
    main()
