"""Bad input gets a clear gRPC status naming the problem, and the mesh keeps serving everyone else."""

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from client_util import error_of, generate, metric
from conftest import wait_until
from omni.v1 import omni_pb2, omni_pb2_grpc
from bad_requests import EXHAUSTED, INVALID, PRECONDITION, bad_requests, user
from references import png, video_file

def assert_served(mesh, speech: bool = False) -> None:
    """The mesh still serves a request whole: all 3 tokens (and 3 frames of speech) it asked for."""
    req = user(("text", "next")).request(speech=speech, max_tokens=3, frames=3)
    req.sampling.ignore_eos = req.talker_sampling.ignore_eos = True
    res = generate(mesh.gateway_address, req)
    assert res.finished.reason == omni_pb2.FINISH_REASON_LENGTH and len(res.token_ids) == 3, res
    assert len(res.codes) == (3 if speech else 0) and (res.samples > 0) == speech, res


def test_bad_input_is_refused_clearly_while_good_requests_are_served(mesh):
    bad = bad_requests()
    kinds = [user(("image", png(9)), ("text", "ok")).request(speech=s, max_tokens=6, frames=6) for s in (False, True)]
    kinds.append(user(("video_sound", video_file(1, 64, 48, sound="aac")), ("text", "ok")).request(max_tokens=6))
    good = kinds * 3
    expected_good = [generate(mesh.gateway_address, g) for g in kinds]
    jobs = [("bad", name, req) for name, (req, _, _) in bad.items()] + [("good", i, g) for i, g in enumerate(good)]
    random.Random(1).shuffle(jobs)

    def run(job):
        kind, key, req = job
        return (job, error_of(mesh.gateway_address, req)) if kind == "bad" else (job, generate(mesh.gateway_address, req))

    port = mesh.cfg.gateway.replicas[0].metrics_port
    counted = {c: metric(port, "omni_requests_total", method="Generate", code=c) for c in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED")}
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, jobs))
    for (kind, key, _), out in results:
        if kind == "good":
            ref = expected_good[key % len(kinds)]
            assert out.token_ids == ref.token_ids and out.codes == ref.codes, f"good request {key} changed"
            continue
        _, code, words = bad[key]
        assert out is not None, f"{key}: accepted"
        assert out.code() == code, f"{key}: {out.code()} {out.details()}"
        assert words in out.details(), f"{key}: {out.details()!r} does not say {words!r}"
    # The gateway counts each refusal by its status (over-size payloads are refused by gRPC before the handler).
    invalid = sum(1 for req, code, _ in bad.values() if code == INVALID)
    exhausted = sum(1 for req, code, words in bad.values() if code == EXHAUSTED and words != "larger than max")
    assert metric(port, "omni_requests_total", method="Generate", code="INVALID_ARGUMENT") - counted["INVALID_ARGUMENT"] == invalid
    assert metric(port, "omni_requests_total", method="Generate", code="RESOURCE_EXHAUSTED") - counted["RESOURCE_EXHAUSTED"] == exhausted


def test_malformed_message_bytes(mesh):
    with grpc.insecure_channel(mesh.gateway_address) as ch:
        call = ch.unary_stream("/omni.v1.Omni/Generate", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as e:
            list(call(b"\x0a\xff\xff\xff\x0f garbage", timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed omni.v1.GenerateRequest" in e.value.details()
    assert_served(mesh)


def test_audio_output_without_a_talker(tiny_model, tmp_path):
    from conftest import write_config
    from services.launch import Mesh

    with Mesh(write_config(tmp_path / "notalker.yaml", tiny_model, encoders=1, with_talker=False), log_dir=tmp_path, stages=("gateway",)) as m:
        err = error_of(m.gateway_address, user(("text", "x")).request(speech=True))
        assert err.code() == PRECONDITION and "no talker" in err.details()
        with grpc.insecure_channel(m.gateway_address) as ch:
            info = omni_pb2_grpc.OmniStub(ch).GetModelInfo(omni_pb2.GetModelInfoRequest(), timeout=10)
        assert list(info.output_modalities) == [omni_pb2.MODALITY_TEXT] and not info.voices


def _held(mesh) -> dict:
    """What every stage still holds: engine sequences, RPCs in flight, shared-memory slots."""
    held = {}
    for stage in mesh.cfg.STAGES:
        for i, r in enumerate(mesh.cfg.replicas(stage)):
            p = r.metrics_port
            held[f"{stage}{i}"] = (metric(p, "omni_active_sequences"), metric(p, "omni_inflight_requests"),
                                   metric(p, "omni_shm_slots_in_use"))
    return held


def _wait_released(mesh, timeout: float) -> dict:
    """What the stages hold once they hold nothing, or at `timeout`."""
    held = {}

    def released() -> bool:
        held.update(_held(mesh))
        return all(v == (0, 0, 0) for v in held.values())

    wait_until(released, timeout, every=0.05)
    return held


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_cancel_or_deadline_frees_every_stage(any_mesh, how):
    mesh = any_mesh
    generate(mesh.gateway_address, user(("text", "warm up")).request(speech=True, max_tokens=3, frames=3))
    req = user(("image", png(11)), ("text", "talk a lot")).request(speech=True, max_tokens=250, frames=1000)
    req.sampling.ignore_eos = req.talker_sampling.ignore_eos = True
    both_busy = False  # seen the thinker and the talker both holding the request
    with grpc.insecure_channel(mesh.gateway_address) as ch:
        stub = omni_pb2_grpc.OmniStub(ch)
        call = stub.Generate(req, timeout=60 if how == "cancel" else 2.5)
        try:
            for resp in call:
                if resp.HasField("audio") and not both_busy:
                    held = _held(mesh)
                    both_busy = held["thinker0"][0] == 1 and held["talker0"][0] == 1
                    if both_busy and how == "cancel":
                        call.cancel()
        except grpc.RpcError as e:
            assert e.code() == (grpc.StatusCode.CANCELLED if how == "cancel" else grpc.StatusCode.DEADLINE_EXCEEDED)
        else:
            pytest.fail("the call finished before it was cancelled or timed out")
    assert both_busy
    # freed by the stages themselves, not by reclaim (after 30 s): within a pool's sweep (1 s) of the end; 0.8 s measured
    held = _wait_released(mesh, timeout=3.0)
    assert all(v == (0, 0, 0) for v in held.values()), held
    assert_served(mesh)


def test_a_killed_preprocess_worker_costs_no_request(mesh):
    """The preprocess stage decodes in worker processes: kill them all, and the next image request is still
    served (a new pool takes over), as is every one after it."""
    import os
    import signal
    from pathlib import Path

    pid = mesh.procs["preprocess-0"].pid

    def pool_workers() -> list[int]:
        """Children of the stage running spawn_main (not multiprocessing's resource tracker), read from /proc:
        no fork in this process, which holds gRPC channels."""
        found = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == pid and b"spawn_main" in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
        return found

    workers = pool_workers()
    assert workers, "the preprocess stage has no worker processes"
    for w in workers:
        os.kill(w, signal.SIGKILL)
    case = user(("image", png(8)), ("text", "What is it?"))
    for _ in range(2):
        assert generate(mesh.gateway_address, case.request(max_tokens=3)).token_ids
    new = pool_workers()
    assert new and not set(new) & set(workers)


@pytest.mark.parametrize("run", range(3))
def test_speech_that_ends_before_its_text_leaves_nothing_held(any_mesh, run):
    """The talker is done after 2 frames while the thinker streams 60 more tokens of states to it: the request
    succeeds (the talker's call stays open until the text ends, so nothing writes to a finished call), and
    every state slot is given back at once, long before the reclaim time."""
    mesh = any_mesh
    req = user(("text", "say little, write a lot")).request(speech=True, max_tokens=60, frames=2)
    req.sampling.ignore_eos = True
    res = generate(mesh.gateway_address, req)
    assert len(res.token_ids) == 60 and len(res.codes) == 2
    held = _wait_released(mesh, timeout=3.0)  # reclaim comes only after 30 s
    assert all(v == (0, 0, 0) for v in held.values()), held


def test_thinker_states_out_of_order_fail_the_talker_call_at_once(any_mesh):
    """A caller of the talker stage whose states skip positions gets INVALID_ARGUMENT naming it at once, its
    stream still open, and the talker serves the next request."""
    mesh = any_mesh
    import torch
    from transformers import AutoTokenizer

    from omni.stage.v1 import talker_pb2, talker_pb2_grpc
    from services.model.spec import OmniSpec
    from services.runtime.config import TransportConfig
    from services.runtime.transport import Transport

    cfg = mesh.cfg
    hidden = OmniSpec.load(cfg.model.dir).thinker_hidden
    ids = AutoTokenizer.from_pretrained(cfg.model.dir).apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    inline = Transport(TransportConfig(shm=False), "test")
    start = talker_pb2.TalkerStart(request_id="ooo", prompt_ids=ids, voice="", tts_embeds=inline.put(torch.zeros(3, hidden), None))
    start.sampling.max_tokens = 4
    rows = inline.put(torch.zeros(2, 2, hidden), None)  # embeds and hidden of two positions
    failed = threading.Event()

    def messages():
        yield talker_pb2.TalkerInput(start=start)
        yield talker_pb2.TalkerInput(states=talker_pb2.ThinkerStates(start=5, states=rows))
        failed.wait(30)  # the stream stays open until the call has failed: an error that waited for its end times out
        yield talker_pb2.TalkerInput(end=talker_pb2.TextEnd())

    with grpc.insecure_channel(cfg.talker.replicas[0].address) as ch:
        t0 = time.monotonic()
        try:
            with pytest.raises(grpc.RpcError) as e:
                list(talker_pb2_grpc.TalkerStub(ch).Synthesize(messages(), timeout=20))
        finally:
            failed.set()
    assert e.value.code() == INVALID and "out of order" in e.value.details()
    assert time.monotonic() - t0 < 3  # at once: 0.3 s measured, against the call's 20 s timeout
    assert_served(mesh, speech=True)
