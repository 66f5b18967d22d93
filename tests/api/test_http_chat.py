"""Chat completions through the HTTP door with the official openai client, against the same requests through gRPC:
the same tokens (greedy and seeded), every turn kept as a turn, image, audio and video-file parts, 16 streams at once."""

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from api.calls import as_chat, read_stream
from api.test_audio_in import MADE, transcode
from client_util import generate
from omni.v1 import omni_pb2
from references import Case, png, video_file, wav

OPENAI_PARAMS = {"model", "messages", "temperature", "top_p", "max_tokens", "seed", "stop", "modalities", "audio", "stream",
                 "stream_options"}


def create(client, body: dict, **kw):
    """client.chat.completions.create with `body`; what OpenAI's API lacks goes in extra_body, as a user sends it."""
    known = {k: v for k, v in body.items() if k in OPENAI_PARAMS}
    extra = {k: v for k, v in body.items() if k not in OPENAI_PARAMS}
    return client.chat.completions.create(**known, **kw, extra_body=extra or None)


def both(mesh, client, req: omni_pb2.GenerateRequest, stream: bool):
    """(the gRPC result, the HTTP reply's text, token ids, usage, finish reason) of one request."""
    grpc_out = generate(mesh.gateway_address, req)
    body = as_chat(req)
    if stream:
        s = read_stream(create(client, body, stream=True, stream_options={"include_usage": True}))
        return grpc_out, s.text, s.token_ids, s.usage, s.finish_reason
    r = create(client, body)
    choice = r.choices[0]
    return grpc_out, choice.message.content, choice.model_extra["token_ids"], r.usage, choice.finish_reason


def text_case(text: str = "Tell me a story about a cat.") -> Case:
    return Case([("system", [("text", "You are terse.")]), ("user", [("text", text)])])


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].owned_by == "omni-mesh"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_text_chat_gives_the_tokens_grpc_gives(mesh, client, sampling, stream):
    req = text_case().request(max_tokens=12, greedy=sampling == "greedy")
    if sampling == "seeded":
        req.sampling.temperature, req.sampling.top_p, req.sampling.seed = 0.9, 0.95, 1234
    g, text, ids, usage, finish = both(mesh, client, req, stream)
    assert ids == g.token_ids and text == g.text and len(ids) > 0
    assert usage.prompt_tokens == g.finished.usage.prompt_tokens and usage.completion_tokens == len(ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert finish == {omni_pb2.FINISH_REASON_LENGTH: "length"}.get(g.finished.reason, "stop")


def test_seeds_matter_over_http(client):
    body = as_chat(text_case().request(max_tokens=12, greedy=False))
    body.update(temperature=1.0, top_p=1.0)
    first, again, other = (create(client, {**body, "seed": s}).choices[0].model_extra["token_ids"] for s in (7, 7, 8))
    assert first == again != other


def test_multi_turn_with_an_earlier_audio_reply(mesh, client):
    """The earlier reply referred back by its audio id, or sent back whole: both are the assistant turn the gRPC API
    gets with that reply's transcript as its text, turn for turn (never one flattened text)."""
    first = create(client, {**as_chat(text_case("Say hello.").request(speech=True, max_tokens=6, frames=8)),
                            "audio": {"voice": "ethan", "format": "wav"}})
    said = first.choices[0].message
    assert said.audio.transcript == said.content and said.audio.id.startswith("audio_")
    turns = Case([("user", [("text", "Say hello.")]), ("assistant", [("text", said.audio.transcript)]),
                  ("user", [("text", "Again, louder.")])])
    expected = generate(mesh.gateway_address, turns.request(max_tokens=10)).token_ids
    follow = [{"role": "user", "content": "Again, louder."}]
    by_id = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "audio": {"id": said.audio.id}}, *follow]
    whole = [{"role": "user", "content": "Say hello."}, said.model_dump(exclude_none=True), *follow]
    transcript_only = [{"role": "user", "content": "Say hello."},
                       {"role": "assistant", "audio": {"id": "audio_elsewhere", "transcript": said.audio.transcript}}, *follow]
    for messages in (by_id, whole, transcript_only):
        r = create(client, {"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0, "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == expected
    flattened = Case([("user", [("text", f"Say hello.\n{said.audio.transcript}\nAgain, louder.")])])
    assert generate(mesh.gateway_address, flattened.request(max_tokens=10)).token_ids != expected
    with pytest.raises(openai.BadRequestError) as e:
        create(client, {"model": "tiny", "messages": [{"role": "assistant", "audio": {"id": "audio_gone"}}, *follow]})
    assert e.value.body["code"] == "audio_not_found" and e.value.body["param"] == "messages[0].audio.id"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_image_and_audio_parts(mesh, client, stream):
    case = Case([("system", [("text", "You are terse.")]),
                 ("user", [("text", "Look:"), ("image", png(3, 96, 64)), ("audio", wav(4, 1.0)), ("text", "and compare.")])])
    g, text, ids, _, _ = both(mesh, client, case.request(max_tokens=10), stream)
    assert ids == g.token_ids and text == g.text


@pytest.mark.parametrize("fmt", list(MADE))
def test_input_audio_in_every_listed_format(mesh, client, fmt):
    clip = transcode(wav(5, 1.5, rate=44100, channels=2), *MADE[fmt])
    req = Case([("user", [("audio", clip), ("text", "What do you hear?")])]).request(max_tokens=8)
    body = as_chat(req)
    body["messages"][0]["content"][0]["input_audio"]["format"] = fmt
    r = create(client, body)
    assert r.choices[0].model_extra["token_ids"] == generate(mesh.gateway_address, req).token_ids


@pytest.mark.parametrize("kind", ["video_file", "video_sound"])
def test_a_video_url_data_url_is_the_grpc_video_file(mesh, client, kind):
    """A video_url part is Video.file; with use_audio_in_video, heard too (the tokens differ from the file unheard)."""
    clip = video_file(2, 64, 48, sound="aac")
    req = Case([("user", [(kind, clip), ("text", "What happens?")])]).request(max_tokens=8)
    r = create(client, as_chat(req))
    assert r.choices[0].model_extra["token_ids"] == generate(mesh.gateway_address, req).token_ids
    if kind == "video_sound":
        unheard = Case([("user", [("video_file", clip), ("text", "What happens?")])]).request(max_tokens=8)
        assert r.choices[0].model_extra["token_ids"] != generate(mesh.gateway_address, unheard).token_ids
        body = as_chat(unheard) | {"mm_processor_kwargs": {"use_audio_in_video": True}}  # vLLM's request-wide form
        assert create(client, body).choices[0].model_extra["token_ids"] == r.choices[0].model_extra["token_ids"]


def test_16_concurrent_streams(mesh, client):
    """Sixteen chats streamed at once, text and speech, each the tokens (and samples) its request gets alone over gRPC."""
    reqs = []
    for i in range(16):
        req = text_case(f"Story number {i}.").request(speech=i % 4 == 0, max_tokens=8, frames=8, greedy=False, codes=False)
        req.sampling.seed = req.talker_sampling.seed = 100 + i
        reqs.append(req)
    expected = [generate(mesh.gateway_address, r) for r in reqs]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda r: read_stream(create(client, as_chat(r), stream=True)), reqs))
    for want, have in zip(expected, got):
        assert have.token_ids == want.token_ids and have.text == want.text
        assert have.audio == b"".join((p * 32767.0).round().astype("<i2").tobytes() for p in want.pcm)
