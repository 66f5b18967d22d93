"""Closed-loop load over the public gRPC API: exactly B requests in flight, each finished one replaced at once.

One asyncio loop with grpc.aio; requests are built before the clock starts, and per message the loop only reads
a timestamp and a few lengths, so the client stays cheap (its CPU time is reported per cell). StageCpu reads each
stage process's CPU from its metrics endpoint: a Python process out of its one core shows there.
"""

import asyncio
import itertools
import time
import urllib.request
from dataclasses import dataclass, field

import grpc

from bench.records import RequestRecord
from omni.v1 import omni_pb2, omni_pb2_grpc
from services.runtime.config import MeshConfig

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 1 << 30),
    ("grpc.max_send_message_length", 1 << 30),
    # Separate connections per channel: otherwise channels with equal arguments share one subchannel.
    ("grpc.use_local_subchannel_pool", 1),
]


@dataclass
class LoopResult:
    records: list[RequestRecord]
    duration: float  # first request sent -> last request finished
    client_cpu_s: float  # this process's CPU time over the loop
    messages: int  # responses read
    out_of_time: bool = False
    stage_cpu: dict = field(default_factory=dict)  # stage process -> its CPU seconds per wall second (StageCpu)


class MeshClient:
    """A few channels to one gateway; requests are spread over them round-robin."""

    def __init__(self, address: str, channels: int = 4, timeout: float = 900.0):
        self.address, self.timeout = address, timeout
        self._channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(max(1, channels))]
        self._stubs = itertools.cycle([omni_pb2_grpc.OmniStub(ch) for ch in self._channels])
        self.messages = 0

    async def model_info(self) -> omni_pb2.ModelInfo:
        return await next(self._stubs).GetModelInfo(omni_pb2.GetModelInfoRequest(), timeout=60)

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()

    async def one(self, index: int, req: omni_pb2.GenerateRequest) -> RequestRecord:
        rec = RequestRecord(index=index, start=time.perf_counter())
        last_text = 0.0
        call = next(self._stubs).Generate(req, timeout=self.timeout)
        try:
            async for resp in call:
                now = time.perf_counter()
                self.messages += 1
                kind = resp.WhichOneof("event")
                if kind == "text":
                    n = len(resp.text.token_ids)
                    if n == 0:
                        continue
                    if rec.ttft is None:
                        rec.ttft = now - rec.start
                    else:
                        rec.itl.append((now - last_text) / n)
                    last_text = now
                    rec.text_tokens += n
                    rec.text_deltas += 1
                elif kind == "audio":
                    if rec.ttfa is None:
                        rec.ttfa = now - rec.start
                    rec.audio_samples += len(resp.audio.data) // 2  # PCM16 mono
                    rec.audio_chunks += 1
                elif kind == "finished":
                    u = resp.finished.usage
                    rec.finished = True
                    rec.usage_tokens, rec.audio_frames, rec.prompt_tokens = u.completion_tokens, u.audio_frames, u.prompt_tokens
                    rec.server_ttft = u.time_to_first_token_seconds or None
                    rec.server_ttfa = u.time_to_first_audio_seconds or None
                    rec.stage_seconds = {t.stage: t.seconds for t in u.timings}
        except grpc.aio.AioRpcError as e:
            rec.error, rec.detail = e.code().name, (e.details() or "")[:500]
        except asyncio.CancelledError:
            call.cancel()
            rec.error, rec.detail = "CANCELLED", "the run's time ran out"
            raise
        finally:
            rec.end = time.perf_counter()
        if not rec.finished and not rec.error:
            rec.error, rec.detail = "UNFINISHED", "the stream ended without a Finished message"
        return rec

    async def closed_loop(self, requests: list[tuple[int, omni_pb2.GenerateRequest]], concurrency: int,
                          deadline: float | None = None) -> LoopResult:
        """Runs (index, request) pairs with `concurrency` in flight until all are done or `deadline` (perf_counter) passes."""
        records: list[RequestRecord] = []
        pending = iter(requests)
        out_of_time = False

        async def slot():
            for index, req in pending:  # a shared iterator: each request is taken by exactly one slot
                records.append(await self.one(index, req))

        self.messages = 0
        cpu0, t0 = time.process_time(), time.perf_counter()
        slots = [asyncio.create_task(slot()) for _ in range(concurrency)]
        try:
            timeout = None if deadline is None else max(0.0, deadline - t0)
            done, running = await asyncio.wait(slots, timeout=timeout)
            if running:
                out_of_time = True
                for task in running:
                    task.cancel()
                await asyncio.gather(*running, return_exceptions=True)
            for task in done:
                task.result()  # a slot only fails on a bug in this file: surface it
        finally:
            for task in slots:
                task.cancel()
        end = max((r.end for r in records), default=time.perf_counter())
        return LoopResult(records, end - t0, time.process_time() - cpu0, self.messages, out_of_time)


class StageCpu:
    """The mesh's metrics endpoints; `read()` gives each reachable one's CPU seconds so far."""

    def __init__(self, cfg: MeshConfig, timeout: float = 2.0):
        self.timeout = timeout
        self.urls = {f"{stage}-{i}": f"http://{r.host}:{r.metrics_port}/metrics"
                     for stage in cfg.STAGES for i, r in enumerate(cfg.replicas(stage)) if r.metrics_port}

    def read(self) -> dict[str, float]:
        seconds = {}
        for name, url in list(self.urls.items()):
            try:
                with urllib.request.urlopen(url, timeout=self.timeout) as resp:
                    line = next((x for x in resp.read().decode().splitlines() if x.startswith("process_cpu_seconds_total ")), None)
            except OSError:  # not reachable from here (another host's name), or busy past the timeout: left out this time
                continue
            if line is None:  # no process collector (not Linux): not asked again
                del self.urls[name]
            else:
                seconds[name] = float(line.split()[1])
        return seconds

    @staticmethod
    def fractions(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
        """CPU seconds per wall second (1.0: one core busy the whole time) of each process read both times."""
        return {k: round((after[k] - before[k]) / max(seconds, 1e-9), 3) for k in after if k in before}
