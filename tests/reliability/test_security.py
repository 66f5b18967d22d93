"""TLS on the public ports, mutual TLS between stages, API keys on the public APIs, reflection where configured: a mesh
made with `scripts/dev-certs`, called as the world and as a stage would call it."""

import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from conftest import write_config
from omni.v1 import omni_pb2, omni_pb2_grpc
from services.client import request
from services.runtime.config import REPO_ROOT as REPO

KEY = "sk-mesh-test"
REFLECTION = {"v1": "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
              "v1alpha": "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"}


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    subprocess.run([str(REPO / "scripts" / "dev-certs"), str(out), "127.0.0.1", "localhost"], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def secure(tiny_model, certs, tmp_path_factory):
    """A text-only mesh with TLS, mutual TLS between stages, a key, no reflection on internal stages, and its door."""
    from api.conftest import start_api, stop
    from services.launch import Mesh

    tmp = tmp_path_factory.mktemp("secure")
    security = {"tls_dir": str(certs), "keys": [KEY], "reflection": False}
    m = Mesh(write_config(tmp / "mesh.yaml", tiny_model, encoders=1, with_talker=False, security=security), log_dir=tmp)
    m.start(timeout=180)
    door = start_api(m.config_path, tmp, "api", security=security)
    yield m, door
    stop(door)
    assert all(c == 0 for c in m.stop().values())


def tls(certs: Path, as_stage: bool = False) -> grpc.ChannelCredentials:
    """The world's credentials (trusting the mesh's CA), or a stage's (showing the mesh certificate too)."""
    if not as_stage:
        return grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
    return grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes(), (certs / "mesh-key.pem").read_bytes(),
                                        (certs / "mesh.pem").read_bytes())


def ask(channel: grpc.Channel, key: str | None) -> str:
    metadata = (("authorization", f"Bearer {key}"),) if key is not None else ()
    req = request("hi", max_tokens=3)
    return "".join(r.text.text for r in omni_pb2_grpc.OmniStub(channel).Generate(req, metadata=metadata, timeout=60))


def code_of(call) -> grpc.StatusCode | None:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return None


def health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def services_listed(channel: grpc.Channel, version: str) -> list[str]:
    call = channel.stream_stream(REFLECTION[version], request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    (reply,) = list(call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
    return sorted(s.name for s in reply.list_services_response.service)


def test_the_gateway_serves_tls_and_wants_a_key(secure, certs):
    mesh, _ = secure
    address = mesh.gateway_address
    with grpc.secure_channel(address, tls(certs)) as ch:
        ask(ch, KEY)  # the world needs only the CA: the public port asks for no client certificate
        assert code_of(lambda: ask(ch, None)) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: ask(ch, "sk-wrong")) == grpc.StatusCode.UNAUTHENTICATED
        info = omni_pb2_grpc.OmniStub(ch).GetModelInfo
        assert code_of(lambda: info(omni_pb2.GetModelInfoRequest(), timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
        assert health(ch) == health_pb2.HealthCheckResponse.SERVING  # probes need no key
        assert "omni.v1.Omni" in services_listed(ch, "v1")  # the public API stays discoverable
    with grpc.insecure_channel(address) as ch:  # plaintext to a TLS port
        assert code_of(lambda: ask(ch, KEY)) == grpc.StatusCode.UNAVAILABLE


def test_internal_stages_take_only_the_mesh(secure, certs):
    mesh, _ = secure
    address = mesh.cfg.thinker.replicas[0].address
    with grpc.secure_channel(address, tls(certs)) as ch:  # the CA, but no mesh certificate
        assert code_of(lambda: health(ch)) == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(address) as ch:
        assert code_of(lambda: health(ch)) == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(address, tls(certs, as_stage=True)) as ch:
        assert health(ch) == health_pb2.HealthCheckResponse.SERVING
        for version in REFLECTION:  # reflection off for internal stages here
            assert code_of(lambda: services_listed(ch, version)) == grpc.StatusCode.UNIMPLEMENTED


def test_the_door_serves_https_and_wants_the_key(secure, certs):
    _, door = secure
    url = door.url.replace("http://", "https://")
    with httpx.Client(verify=ssl.create_default_context(cafile=certs / "ca.pem")) as http:
        good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, http_client=http)
        reply = good.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert reply.choices[0].message.content is not None  # the door's key reached the gateway too
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0, http_client=http).models.list()
    with pytest.raises(httpx.HTTPError):
        httpx.get(door.url + "/health", timeout=5)  # plain HTTP to an HTTPS port


def test_the_client_speaks_tls_with_a_key(secure, certs):
    mesh, _ = secure
    cmd = [sys.executable, "-m", "services.client", "hi", "--max-tokens", "3", "--address", mesh.gateway_address,
           "--tls-ca", str(certs / "ca.pem")]
    ok = subprocess.run([*cmd, "--api-key", KEY], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr


def test_reflection_in_both_versions_without_tls(mesh):
    """The plaintext mesh with the defaults: every stage lists its services in reflection v1 and v1alpha."""
    for stage in ("gateway", "thinker"):
        with grpc.insecure_channel(mesh.cfg.replicas(stage)[0].address) as ch:
            listed = {v: services_listed(ch, v) for v in REFLECTION}
        assert listed["v1"] == listed["v1alpha"] and "grpc.health.v1.Health" in listed["v1"], listed


def test_the_realtime_door_and_converse_want_the_key(secure, certs):
    """/v1/realtime over TLS takes the key as a header (OpenAI's clients) or a subprotocol (browsers), refuses the
    upgrade without it; Converse on the gateway wants it as Generate does."""
    import asyncio
    import json

    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    mesh, door = secure
    url = door.url.replace("http://", "wss://") + "/v1/realtime"
    ctx = ssl.create_default_context(cafile=certs / "ca.pem")

    async def first_event(**how):
        async with connect(url, ssl=ctx, **how) as ws:
            return json.loads(await ws.recv())["type"], ws.subprotocol

    assert asyncio.run(first_event(additional_headers={"Authorization": f"Bearer {KEY}"})) == ("session.created", None)
    assert asyncio.run(first_event(subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"])) == ("session.created", "realtime")
    for how in ({}, {"additional_headers": {"Authorization": "Bearer sk-wrong"}}):
        with pytest.raises(InvalidStatus) as e:
            asyncio.run(first_event(**how))
        assert e.value.response.status_code == 403
    with grpc.secure_channel(mesh.gateway_address, tls(certs)) as ch:
        converse = omni_pb2_grpc.OmniStub(ch).Converse
        assert code_of(lambda: list(converse(iter([omni_pb2.ConverseRequest()]), timeout=30))) == grpc.StatusCode.UNAUTHENTICATED
