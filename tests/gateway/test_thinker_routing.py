"""Two thinker replicas behind one gateway: each call goes to the replica preferred for its output modality
while that one is idle (real processes over real sockets, the tiny model, reference engines)."""

import pytest

from client_util import generate, metric
from conftest import write_config
from test_mesh import CASES


@pytest.fixture(scope="module")
def two_thinkers(tiny_model, tmp_path_factory):
    from services.launch import Mesh

    tmp = tmp_path_factory.mktemp("two-thinkers")
    m = Mesh(write_config(tmp / "mesh.yaml", tiny_model, encoders=1, thinkers=2), log_dir=tmp / "logs")
    m.start(timeout=180)
    yield m
    codes = m.stop()
    assert all(c == 0 for c in codes.values()), f"stages did not stop cleanly: {codes}"


def generates(port: int) -> float:
    return metric(port, "omni_requests_total", method="Generate")


def test_thinker_calls_are_routed_by_output_modality(two_thinkers):
    ports = [r.metrics_port for r in two_thinkers.cfg.thinker.replicas]
    before = [generates(p) for p in ports]
    texts = []
    for speech in (False, True, False, True, True):
        result = generate(two_thinkers.gateway_address, CASES["text"].request(speech=speech, max_tokens=3, frames=2))
        assert len(result.token_ids) == 3 and (len(result.codes) == 2) == speech
        if not speech:
            texts.append(result.token_ids)
    after = [generates(p) for p in ports]
    # Replica 0 is preferred for text output, replica 1 for audio output (see conftest.write_config).
    assert [a - b for a, b in zip(after, before)] == [2, 3]
    assert texts[0] == texts[1]  # the same greedy request, the same replica, the same tokens


def test_a_thinker_replica_that_dies_fails_its_call_by_name_and_the_other_serves_the_rest(tiny_model, tmp_path):
    """Replica 1 (preferred for speech) is killed while it streams a speech request's text: that call fails as
    UNAVAILABLE naming the thinker replica, and every request after it, speech and text, is served by replica 0."""
    import os
    import signal

    import grpc

    from omni.v1 import omni_pb2_grpc
    from services.launch import Mesh

    mesh = Mesh(write_config(tmp_path / "mesh.yaml", tiny_model, encoders=1, thinkers=2), log_dir=tmp_path / "logs")
    mesh.start(timeout=180)
    try:
        assert len(generate(mesh.gateway_address, CASES["text"].request(speech=True, max_tokens=3, frames=2)).codes) == 2
        dead = mesh.procs["thinker-1"]
        long = CASES["text"].request(speech=True, max_tokens=200, frames=200)
        long.sampling.ignore_eos = True
        with grpc.insecure_channel(mesh.gateway_address) as channel:
            stream = omni_pb2_grpc.OmniStub(channel).Generate(long, timeout=120)
            try:
                assert next(stream).WhichOneof("event") == "text"  # under way on replica 1
                os.kill(dead.pid, signal.SIGKILL)
                for _ in stream:
                    pass
                raise AssertionError("the call outlived its thinker")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                address = mesh.cfg.thinker.replicas[1].address
                assert f"thinker replica 1 ({address}) is unavailable" in err.details(), err.details()
        dead.wait(timeout=30)
        for speech in (True, False, True):
            result = generate(mesh.gateway_address, CASES["text"].request(speech=speech, max_tokens=3, frames=2))
            assert len(result.token_ids) == 3 and (len(result.codes) == 2) == speech
    finally:
        codes = mesh.stop()
    assert codes.pop("thinker-1") == -signal.SIGKILL and all(c == 0 for c in codes.values()), codes
