"""Errors through the HTTP door, in OpenAI's shape with the right status: bad input 400 (every bad-media case with the
gRPC API's own message), fields refused by name, keys 401, unknown model 404, oversize 413, overload 429 with
Retry-After, a stage down 503, deadlines 504; and a client that leaves mid-stream frees every stage."""

import base64
import http.client
import http.server
import re
import threading
import time

import grpc
import httpx
import openai
import pytest

from api.calls import as_chat
from api.conftest import start_api, stop
from api.fake_gateway import serve as fake_gateway
from api.test_http_chat import create
from client_util import error_of, metric
from omni.stage.v1 import load_pb2, load_pb2_grpc
from references import Case, png
from bad_requests import bad_requests

# The gRPC API's bad-input cases (tests/bad_requests.py) an OpenAI body can carry.
SAME_MESSAGE = ["corrupt image", "truncated image", "unsupported image format", "image too thin", "decompression bomb",
                "corrupt audio", "truncated audio", "audio too long", "too many media", "reserved token in text",
                "unknown voice", "max tokens over limit", "past the context", "bad top_p", "text past the context",
                "media past the context",
                "corrupt video file", "truncated webm file", "unsupported video codec", "video file too long",
                "video file frames", "video frame pixels", "silent video heard", "garbled soundtrack heard"]


def chat_body(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def post(url: str, body: dict, path: str = "/v1/chat/completions", **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120, **kw)


def _unaddressed(message: str) -> str:
    return re.sub(r"0x[0-9a-f]+", "0x?", message)  # PIL names the BytesIO it could not read by its address


def test_every_bad_media_case_is_400_with_the_grpc_message(mesh, client):
    cases = bad_requests()
    for name in SAME_MESSAGE:
        req = cases[name][0]
        expected = error_of(mesh.gateway_address, req).details()
        with pytest.raises(openai.BadRequestError) as e:
            create(client, as_chat(req))
        assert e.value.status_code == 400 and _unaddressed(e.value.body["message"]) == _unaddressed(expected), name
        assert e.value.body["type"] == "invalid_request_error", name


def test_media_past_the_context_is_400_before_the_preprocess_is_called(mesh, api):
    """Counted from the media's headers at the gateway: OpenAI's error body naming the count and the context, and no
    call to the preprocess stage."""
    from bad_requests import media_past_the_context

    port = mesh.cfg.preprocess.replicas[0].metrics_port
    before = metric(port, "omni_requests_total", method="Process")
    r = post(api.url, as_chat(media_past_the_context()))
    error = r.json()["error"]
    assert r.status_code == 400 and set(error) == {"message", "type", "param", "code"}, r.text
    assert error["type"] == "invalid_request_error"
    assert "counted from their headers" in error["message"] and "past the context of 512" in error["message"], error
    assert metric(port, "omni_requests_total", method="Process") == before


IMAGE = "data:image/png;base64," + base64.b64encode(png(1)).decode()
REFUSED = {  # body fields -> the param the 400 names
    "unknown field": ({"foo": 1}, "foo"),
    "n": ({"n": 2}, "n"),
    "tools": ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    "logprobs": ({"logprobs": True}, "logprobs"),
    "presence penalty": ({"presence_penalty": 0.5}, "presence_penalty"),
    "json output": ({"response_format": {"type": "json_object"}}, "response_format"),
    "stream options unstreamed": ({"stream_options": {"include_usage": True}}, "stream_options"),
    "audio only": ({"modalities": ["audio"], "audio": {"voice": "ethan", "format": "wav"}}, "modalities"),
    "audio without its settings": ({"modalities": ["text", "audio"]}, "audio"),
    "audio settings without audio": ({"audio": {"voice": "ethan", "format": "wav"}}, "audio"),
    "unknown audio format": ({"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "ogg"}}, "audio.format"),
    "hot": ({"temperature": 3}, "temperature"),
    "no tokens": ({"max_tokens": 0}, "max_tokens"),
    "two different limits": ({"max_completion_tokens": 3}, "max_completion_tokens"),
    "no frames": ({"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}, "talker": {"max_tokens": 0}}, "talker.max_tokens"),
    "talker without audio": ({"talker": {"temperature": 0.5}}, "talker"),
    "negative seed": ({"seed": -1}, "seed"),
    "five stops": ({"stop": list("abcde")}, "stop"),
    "a name": ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages[0].name"),
    "a tool turn": ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "x"}]}, "messages[0].role"),
    "a file part": ({"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}]}, "messages[0].content[0].type"),
    "image detail": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE, "detail": "low"}}]}]},
                     "messages[0].content[0].image_url.detail"),
    "unknown input audio format": ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aiff"}}]}]},
                                   "messages[0].content[0].input_audio.format"),
    "bad base64": ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}}]}]},
                   "messages[0].content[0].input_audio.data"),
    "url fetch off": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]},
                      "messages[0].content[0].image_url.url"),
    "no messages": ({"messages": []}, "messages"),
    "other processor options": ({"mm_processor_kwargs": {"fps": 4}}, "mm_processor_kwargs.fps"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_fields_not_honoured_are_refused_by_name(api, name):
    extra, param = REFUSED[name]
    r = post(api.url, chat_body(**extra))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and param.split("[")[0] in err["message"], err


def test_fields_sent_by_default_are_taken_when_they_mean_what_we_do(api):
    r = post(api.url, chat_body(n=1, presence_penalty=0, frequency_penalty=0, logprobs=False, tool_choice="none", store=False,
                                service_tier="auto", user="u-1", stream=False, parallel_tool_calls=True,
                                response_format={"type": "text"}, max_completion_tokens=2))
    assert r.status_code == 200, r.text


def test_speech_refusals(api):
    speech = {"model": "tiny", "input": "hi", "voice": "ethan"}
    r = post(api.url, {**speech, "speed": 1.5}, "/v1/audio/speech")
    assert r.status_code == 400 and r.json()["error"]["param"] == "speed"
    r = post(api.url, {**speech, "response_format": "ogg"}, "/v1/audio/speech")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    r = post(api.url, {**speech, "model": "tts-1"}, "/v1/audio/speech")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_not_json_and_unknown_routes(api):
    r = httpx.post(api.url + "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(api.url + "/v1/embeddings")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_oversize_bodies_are_413(mesh, api):
    limit = mesh.cfg.limits.max_request_bytes
    host, port = api.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("content-type", "application/json")
    conn.putheader("content-length", str(50 << 20))
    conn.endheaders()  # no byte of the body sent: refused from its length alone
    r = conn.getresponse()
    assert r.status == 413 and b"request_too_large" in r.read()
    conn.close()
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("transfer-encoding", "chunked")
    conn.endheaders()
    piece = b"x" * (1 << 20)
    for _ in range(limit * 4 // 3 // len(piece) + 2):  # no length given: refused once it grows past the limit
        conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
    r = conn.getresponse()
    assert r.status == 413 and b"request_too_large" in r.read()
    conn.close()
    # Within the body limit as base64, over the gateway's once decoded: refused before it is sent on.
    big = "data:image/png;base64," + base64.b64encode(bytes(limit + 16384)).decode()
    r = post(api.url, chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": big}}]}]))
    assert r.status_code == 413 and "holds" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def fake(mesh, tmp_path_factory):
    server, address = fake_gateway()
    door = start_api(mesh.config_path, tmp_path_factory.mktemp("fake"), "api-fake", gateway=address)
    yield door
    stop(door)
    server.stop(0)


@pytest.mark.parametrize("what,status,code", [
    ("status:RESOURCE_EXHAUSTED:2500", 429, "rate_limit_exceeded"),
    ("status:RESOURCE_EXHAUSTED", 400, "over_limit"),
    ("status:UNAVAILABLE", 503, "service_unavailable"),
    ("status:DEADLINE_EXCEEDED", 504, "deadline_exceeded"),
    ("status:UNAUTHENTICATED", 401, "invalid_api_key"),
    ("status:NOT_FOUND", 404, None),
    ("status:FAILED_PRECONDITION", 400, "unsupported_request"),
    ("status:INTERNAL", 500, None),
])
def test_grpc_statuses_map_to_http(fake, what, status, code):
    for stream in (False, True):  # a refusal before the first event is an HTTP status, streamed or not
        r = post(fake.url, {"model": "fake", "messages": [{"role": "user", "content": what}], "stream": stream})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] == code and err["message"] == f"fake {what.split(':')[1]}"
        if status == 429:
            assert r.headers["retry-after"] == "3" and err["type"] == "rate_limit_error"
        else:
            assert "retry-after" not in r.headers


def test_a_failure_mid_stream_is_an_error_event(fake):
    c = openai.OpenAI(base_url=fake.base_url, api_key="x", max_retries=0)
    stream = c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "midstream"}], stream=True)
    with pytest.raises(openai.APIError, match="the thinker failed midway"):
        for _ in stream:
            pass


@pytest.fixture(scope="module")
def strict(mesh, tmp_path_factory):
    """An api process with keys, fetching URLs, and a 3 s deadline."""
    door = start_api(mesh.config_path, tmp_path_factory.mktemp("strict"), "api-strict", security={"keys": ["key-one", "key-two"]},
                     allow_url_fetch=True, request_timeout_s=3.0)
    yield door
    stop(door)


def test_keys(strict):
    assert httpx.get(strict.url + "/health").status_code == 200  # the launcher's check needs no key
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "key-one"}):
        r = httpx.get(strict.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=strict.base_url, api_key="wrong", max_retries=0).models.list()
    for key in ("key-one", "key-two"):
        assert openai.OpenAI(base_url=strict.base_url, api_key=key, max_retries=0).models.list().data[0].id == "tiny"


def test_deadline_is_504(strict):
    body = chat_body(max_tokens=250, ignore_eos=True, modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"},
                     talker={"max_tokens": 1000, "ignore_eos": True})
    t0 = time.monotonic()
    r = post(strict.url, body, headers={"authorization": "Bearer key-one"})
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
    assert time.monotonic() - t0 < 30


def test_url_fetch(mesh, strict, api):
    image = png(2)

    class Files(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == "/cat.png"
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(image if ok else b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        def ask(door, url, key=None):
            body = chat_body(temperature=0, max_tokens=6, return_token_ids=True,
                             messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]}])
            return post(door.url, body, headers={"authorization": f"Bearer {key}"} if key else {})

        fetched = ask(strict, f"http://127.0.0.1:{server.server_port}/cat.png", "key-one")
        inline = ask(api, "data:image/png;base64," + base64.b64encode(image).decode())
        assert fetched.status_code == inline.status_code == 200, fetched.text
        assert fetched.json()["choices"][0]["token_ids"] == inline.json()["choices"][0]["token_ids"]
        missing = ask(strict, f"http://127.0.0.1:{server.server_port}/dog.png", "key-one")
        assert missing.status_code == 400 and missing.json()["error"]["code"] == "url_fetch_failed"
        assert "HTTP 404" in missing.json()["error"]["message"]
    finally:
        server.shutdown()


def test_a_stage_down_is_503(tiny_model, tmp_path):
    """A gateway whose thinker is not running: the request's UNAVAILABLE is 503, and the door stays up."""
    from conftest import write_config
    from services.launch import Mesh

    with Mesh(write_config(tmp_path / "down.yaml", tiny_model, encoders=1), log_dir=tmp_path, stages=("gateway",)) as m:
        door = start_api(m.config_path, tmp_path, "api-down")
        try:
            r = post(door.url, chat_body())
            assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable", r.text
            assert "thinker" in r.json()["error"]["message"]
            assert httpx.get(door.url + "/health").status_code == 200  # the door and the gateway still serve
        finally:
            stop(door)


def _load(mesh, stage: str):
    with grpc.insecure_channel(mesh.cfg.replicas(stage)[0].address) as ch:
        return load_pb2_grpc.LoadStub(ch).Get(load_pb2.LoadRequest(), timeout=10)


def test_a_client_that_leaves_mid_stream_frees_every_stage(mesh, api):
    body = as_chat(Case([("user", [("image", png(11)), ("text", "talk a lot")])]).request(speech=True, max_tokens=250, frames=1000))
    body.update(ignore_eos=True, stream=True)
    body["talker"]["ignore_eos"] = True
    with httpx.stream("POST", api.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a dropped iterator closes the connection
        for line in lines:
            if '"content":"' in line and '"content":""' not in line:  # the first text delta
                break
        deadline = time.monotonic() + 5
        while True:  # both hold it at once before the client leaves
            busy = {stage: _load(mesh, stage) for stage in ("thinker", "talker")}
            if all(rep.active + rep.queued >= 1 for rep in busy.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert all(rep.active + rep.queued >= 1 for rep in busy.values()), busy
    deadline = time.monotonic() + 30
    while True:
        held = {stage: (rep.queued, rep.active, rep.in_flight) for stage in ("gateway", "thinker", "talker")
                for rep in [_load(mesh, stage)]}
        if all(v == (0, 0, 0) for v in held.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert all(v == (0, 0, 0) for v in held.values()), held
    assert metric(api.metrics_port, "omni_http_inflight_requests") == 0


def test_metrics_count_routes_statuses_and_audio_bytes(api, client):
    def count(route, status):
        return metric(api.metrics_port, "omni_http_requests_total", route=route, status=status)

    ok, missing = count("/v1/chat/completions", "200"), count("/v1/chat/completions", "404")
    sent = metric(api.metrics_port, "omni_http_audio_bytes_total", format="mp3")
    seen = metric(api.metrics_port, "omni_http_request_seconds_count", route="/v1/audio/speech")
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    audio = client.audio.speech.create(model="tiny", voice="ethan", input="hi", response_format="mp3",
                                       extra_body={"thinker": {"max_tokens": 3}, "talker": {"max_tokens": 10, "ignore_eos": True}})
    assert count("/v1/chat/completions", "200") == ok + 1 and count("/v1/chat/completions", "404") == missing + 1
    assert metric(api.metrics_port, "omni_http_audio_bytes_total", format="mp3") == sent + len(audio.content)
    assert metric(api.metrics_port, "omni_http_request_seconds_count", route="/v1/audio/speech") == seen + 1
    assert metric(api.metrics_port, "omni_http_inflight_requests") == 0
    on_app = httpx.get(api.url + "/metrics").text  # the app serves them too, at /metrics
    assert "omni_http_requests_total" in on_app and "process_cpu_seconds_total" in on_app
