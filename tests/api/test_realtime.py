"""/v1/realtime through OpenAI's own realtime client, in front of the CPU mesh: a conversation of three turns with
PCM16 audio in and out, turns committed by the server's turn detection, G.711 both ways, a cancel that frees every
stage and reports what the cut turn used, items deleted and truncated, eight sessions at once, and bad events
answered with error events while the session goes on."""

import asyncio
import base64
import time

import numpy as np
import pytest

from api.conftest import start_api, stop
from converse_client import Load, speech_clip

MODEL = "tiny"
FREED_S = 0.1  # the gRPC session's bound (tests/gateway/test_converse.py); the door's WebSocket hop may take as long again
SHORT = {"sampling": {"temperature": 0}, "talker": {"temperature": 0, "max_tokens": 10}, "max_output_tokens": 6}


@pytest.fixture(scope="module")
def door(native_mesh, tmp_path_factory):
    d = start_api(native_mesh.config_path, tmp_path_factory.mktemp("realtime"), "realtime")
    yield d
    stop(d)


def connect(door):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=door.base_url, websocket_base_url=door.base_url.replace("http", "ws"),
                         api_key="unused", max_retries=0)
    return client.realtime.connect(model=MODEL)


async def until(conn, kind: str, timeout: float = 60.0) -> list:
    out = []
    async with asyncio.timeout(timeout):
        async for event in conn:
            out.append(event)
            if event.type == kind:
                return out
    raise AssertionError(f"the connection closed before {kind}: {[e.type for e in out]}")


def b64(pcm: bytes) -> str:
    return base64.b64encode(pcm).decode()


async def append(conn, pcm: bytes, rate: int = 24000, chunk_s: float = 0.1) -> None:
    step = int(rate * chunk_s) * 2
    for i in range(0, len(pcm), step):
        await conn.input_audio_buffer.append(audio=b64(pcm[i:i + step]))


def answer(events) -> dict:
    kinds = [e.type for e in events]
    audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    return {"kinds": kinds, "audio": audio, "transcript": transcript, "done": events[-1].response, "events": events}


async def input_tokens_of(door, clip: bytes, vad: bool) -> int:
    """The input tokens of a completed first response to `clip` in a fresh session, committed by the server's turn
    detection (as the same audio would be anywhere) or by the client."""
    async with connect(door) as conn:
        await until(conn, "session.created")
        vad_ = {} if vad else {"audio": {"input": {"turn_detection": None}}}
        await conn.session.update(session={"type": "realtime", **vad_, **SHORT})
        await until(conn, "session.updated")
        await append(conn, clip)
        if not vad:
            await conn.input_audio_buffer.commit()
            await conn.response.create()
        done = (await until(conn, "response.done"))[-1].response
    assert done.status == "completed", done
    return done.usage.input_tokens


async def until_busy(conn, load) -> None:
    """Until the answer's audio flows and both the thinker and the talker hold work."""
    await until(conn, "response.output_audio.delta")
    while not await load.busy("thinker0", "talker0"):
        await until(conn, "response.output_audio.delta")


async def a_long_answer(conn, load) -> None:
    """A client-committed turn whose answer runs long, under way in every stage."""
    await until(conn, "session.created")
    await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}},
                                       "sampling": {"ignore_eos": True}, "max_output_tokens": 250,
                                       "talker": {"ignore_eos": True, "max_tokens": 1000}})
    await until(conn, "session.updated")
    await append(conn, speech_clip(0.5))
    await conn.input_audio_buffer.commit()
    await conn.response.create()
    await until_busy(conn, load)


def test_three_turns_through_openai_realtime_client(door):
    async def talk():
        async with connect(door) as conn:
            created = await until(conn, "session.created")
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                               "instructions": "You are terse.",
                                               "audio": {"input": {"turn_detection": None}}, **SHORT})
            updated = (await until(conn, "session.updated"))[-1]
            turns = []
            for seed in range(3):
                await append(conn, speech_clip(0.6, seed))
                await conn.input_audio_buffer.commit()
                committed = await until(conn, "input_audio_buffer.committed")
                await conn.response.create()
                turns.append((committed, answer(await until(conn, "response.done"))))
            return created, updated, turns

    created, updated, turns = asyncio.run(talk())
    assert created[-1].session.model == MODEL
    assert updated.session.audio.input.turn_detection is None and updated.session.instructions == "You are terse."
    inputs = []
    for committed, a in turns:
        assert a["done"].status == "completed", a["kinds"]
        assert "response.created" in a["kinds"] and len(a["audio"]) > 0 and len(a["audio"]) % 2 == 0
        assert a["done"].output[0].content[0].transcript == a["transcript"].strip()
        inputs.append(a["done"].usage.input_tokens)
    assert inputs[0] < inputs[1] < inputs[2]  # each turn's prompt holds the ones before


def test_server_vad_commits_and_g711_both_ways(door):
    async def talk():
        async with connect(door) as conn:
            await until(conn, "session.created")
            await conn.session.update(session={
                "type": "realtime", "output_modalities": ["audio"], **SHORT,
                "audio": {"input": {"format": {"type": "audio/pcmu"},
                                    "turn_detection": {"type": "server_vad", "silence_duration_ms": 400}},
                          "output": {"format": {"type": "audio/pcmu"}}}})
            await until(conn, "session.updated")
            from services.api import g711

            pcm8k = speech_clip(0.8, 3, rate=8000, silence_s=0.8)
            await append(conn, g711.encode(np.zeros(4000, "<i2").tobytes(), "mulaw") + g711.encode(pcm8k, "mulaw"),
                         rate=8000, chunk_s=0.05)
            return answer(await until(conn, "response.done"))

    a = asyncio.run(talk())
    k = a["kinds"]
    assert k.index("input_audio_buffer.speech_started") < k.index("input_audio_buffer.speech_stopped") \
        < k.index("input_audio_buffer.committed") < k.index("response.created"), k
    assert a["done"].status == "completed" and len(a["audio"]) > 0
    # mu-law at 8 kHz: a byte a sample, a third of the 24 kHz samples the talker made
    assert a["done"].usage.output_tokens > 0


def test_response_cancel_frees_every_stage(door, native_mesh):
    async def talk():
        load = Load(native_mesh)
        async with connect(door) as conn:
            await a_long_answer(conn, load)
            t0 = time.perf_counter()
            await conn.response.cancel()
            freed = await load.freed_within(t0)
            done = (await until(conn, "response.done"))[-1]
        await load.close()
        return freed, done

    (seconds, held), done = asyncio.run(talk())
    assert seconds < 2 * FREED_S and all(v == (0, 0) for v in held.values()), (seconds, held)
    assert done.response.status == "cancelled" and done.response.status_details.reason == "client_cancelled"
    u = done.response.usage  # what the cut turn used: its whole prompt, and the tokens made before the cut
    assert u.input_tokens == asyncio.run(input_tokens_of(door, speech_clip(0.5), vad=False))
    assert 0 < u.output_tokens < 250 and u.total_tokens == u.input_tokens + u.output_tokens


def test_bad_events_get_error_events_and_the_session_goes_on(door):
    async def talk():
        async with connect(door) as conn:
            await until(conn, "session.created")
            errors = {}
            for name, event in {
                "unknown type": {"type": "input_audio_buffer.nonsense"},
                "bad base64": {"type": "input_audio_buffer.append", "audio": "not base64!"},
                "odd pcm": {"type": "input_audio_buffer.append", "audio": b64(b"\x01\x02\x03")},
                "bad format": {"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/flac"}}}}},
                "nothing to commit": {"type": "input_audio_buffer.commit"},
                "nothing to cancel": {"type": "response.cancel"},
                "assistant item": {"type": "conversation.item.create",
                                   "item": {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]}},
            }.items():
                await conn.send(event)
                errors[name] = (await until(conn, "error"))[-1].error
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}, **SHORT})
            await until(conn, "session.updated")
            await conn.send({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}})
            await conn.response.create()
            done = (await until(conn, "response.done"))[-1]
            return errors, done

    errors, done = asyncio.run(talk())
    expect = {"unknown type": "unknown or unsupported event type", "bad base64": "not valid base64",
              "odd pcm": "whole number", "bad format": "audio/flac", "nothing to commit": "nothing to commit",
              "nothing to cancel": "no answer is in progress", "assistant item": "'assistant' items are not served"}
    for name, words in expect.items():
        assert words in errors[name].message, (name, errors[name])
    assert done.response.status == "completed" and done.response.usage.output_tokens > 0


def test_items_deleted_and_truncated(door):
    """conversation.item.delete and .truncate over the session's conversation: with the first exchange's user item
    deleted and its answer cut to no audio, the same question again is answered from the same prompt; unknown ids
    get errors."""
    hello = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}

    async def talk():
        async with connect(door) as conn:
            await until(conn, "session.created")
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}, **SHORT})
            await until(conn, "session.updated")
            await conn.conversation.item.create(item={"id": "hello_1", **hello})
            added = (await until(conn, "conversation.item.added"))[-1]
            await conn.response.create()
            first = answer(await until(conn, "response.done"))
            answer_id = first["done"].output[0].id
            errors, events = {}, {}
            for name, event in {
                "delete unknown": {"type": "conversation.item.delete", "item_id": "nope"},
                "truncate unknown": {"type": "conversation.item.truncate", "item_id": "nope", "content_index": 0, "audio_end_ms": 0},
                "truncate a user item": {"type": "conversation.item.truncate", "item_id": "hello_1", "content_index": 0, "audio_end_ms": 0},
                "truncate past the audio": {"type": "conversation.item.truncate", "item_id": answer_id, "content_index": 0, "audio_end_ms": 60_000},
                "no item id": {"type": "conversation.item.delete"},
            }.items():
                await conn.send(event)
                errors[name] = (await until(conn, "error"))[-1].error
            half_ms = len(first["audio"]) // 2 * 1000 // 24000 // 2
            await conn.conversation.item.truncate(item_id=answer_id, content_index=0, audio_end_ms=half_ms)
            events["half"] = (await until(conn, "conversation.item.truncated"))[-1]
            await conn.conversation.item.truncate(item_id=answer_id, content_index=0, audio_end_ms=0)
            events["none"] = (await until(conn, "conversation.item.truncated"))[-1]
            await conn.conversation.item.delete(item_id="hello_1")
            events["deleted"] = (await until(conn, "conversation.item.deleted"))[-1]
            await conn.conversation.item.create(item={"id": "hello_2", **hello})
            await until(conn, "conversation.item.added")
            await conn.response.create()
            second = answer(await until(conn, "response.done"))
            return added, first, errors, events, second

    added, first, errors, events, second = asyncio.run(talk())
    assert added.item.id == "hello_1" and first["done"].status == "completed" and first["audio"]
    expect = {"delete unknown": "'nope'", "truncate unknown": "'nope'", "truncate a user item": "user message",
              "truncate past the audio": "outside", "no item id": "item_id"}
    for name, words in expect.items():
        assert words in errors[name].message, (name, errors[name])
    assert errors["delete unknown"].code == "not_found"
    assert events["half"].item_id == first["done"].output[0].id and events["half"].audio_end_ms > 0
    assert events["none"].audio_end_ms == 0 and events["deleted"].item_id == "hello_1"
    # nothing is left of the first exchange: the second's prompt is the first's
    assert second["done"].status == "completed"
    assert second["done"].usage.input_tokens == first["done"].usage.input_tokens


def test_a_websocket_that_closes_frees_every_stage(door, native_mesh):
    from client_util import metric

    async def talk():
        load = Load(native_mesh)
        async with connect(door) as conn:
            await a_long_answer(conn, load)
            t0 = time.perf_counter()
        freed = await load.freed_within(t0)
        await load.close()
        return freed

    seconds, held = asyncio.run(talk())
    assert seconds < 1.0 and all(v == (0, 0) for v in held.values()), (seconds, held)
    port = native_mesh.cfg.gateway.replicas[0].metrics_port
    assert metric(port, "omni_inflight_requests", method="Converse") == 0


def test_eight_sessions_at_once(door, native_mesh):
    """Eight WebSockets side by side, each a conversation of two spoken turns (half committed by the client, half by
    the server's turn detection): every answer completes with speech, each session's events are its own, and once
    they close no stage holds anything."""
    from client_util import metric
    from conftest import wait_until

    async def session(i: int) -> tuple[str, list]:
        vad = i % 2 == 1
        async with connect(door) as conn:
            sid = (await until(conn, "session.created"))[-1].session.id
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"], **SHORT,
                                               **({} if vad else {"audio": {"input": {"turn_detection": None}}})})
            await until(conn, "session.updated")
            turns = []
            for turn in range(2):
                await append(conn, speech_clip(0.5, seed=10 * i + turn, silence_s=0.8 if vad else 0.0))
                if not vad:
                    await conn.input_audio_buffer.commit()
                    await conn.response.create()
                turns.append(answer(await until(conn, "response.done", timeout=180)))
            return sid, turns

    async def all_of_them():
        load = Load(native_mesh)
        sessions = await asyncio.gather(*(session(i) for i in range(8)))
        freed = await load.freed_within(time.perf_counter())
        await load.close()
        return sessions, freed

    sessions, (_, held) = asyncio.run(all_of_them())
    assert len({sid for sid, _ in sessions}) == 8
    for sid, turns in sessions:
        for a in turns:
            done = a["done"]
            assert done.status == "completed" and len(a["audio"]) > 0 and done.conversation_id == sid, a["kinds"]
            assert a["transcript"] and all(e.response_id == done.id for e in a["events"] if hasattr(e, "response_id"))
        assert turns[0]["done"].usage.input_tokens < turns[1]["done"].usage.input_tokens  # the second held the first
    assert all(v == (0, 0) for v in held.values()), held
    port = native_mesh.cfg.gateway.replicas[0].metrics_port
    assert wait_until(lambda: metric(port, "omni_inflight_requests", method="Converse") == 0, 5.0)


def test_speaking_over_an_answer_stops_it_everywhere(door, native_mesh):
    async def talk():
        load = Load(native_mesh)
        async with connect(door) as conn:
            await until(conn, "session.created")
            await conn.session.update(session={"type": "realtime", "sampling": {"ignore_eos": True}, "max_output_tokens": 250,
                                               "talker": {"ignore_eos": True, "max_tokens": 1000}})
            await until(conn, "session.updated")
            await append(conn, speech_clip(0.6, 0, silence_s=0.8))
            await until_busy(conn, load)
            t0 = time.perf_counter()
            await append(conn, speech_clip(0.8, 1))
            freed = await load.freed_within(t0)
            events = await until(conn, "response.done")
        await load.close()
        return freed, events

    (seconds, held), events = asyncio.run(talk())
    assert seconds < 2 * FREED_S and all(v == (0, 0) for v in held.values()), (seconds, held)
    kinds = [e.type for e in events]
    assert "input_audio_buffer.speech_started" in kinds
    done = events[-1].response
    assert done.status == "cancelled" and done.status_details.reason == "turn_detected"
    assert done.usage.input_tokens == asyncio.run(input_tokens_of(door, speech_clip(0.6, 0, silence_s=0.8), vad=True))
    assert 0 < done.usage.output_tokens < 250
    # nothing more of the answer after the user spoke
    assert "response.output_audio.delta" not in kinds[kinds.index("input_audio_buffer.speech_started"):]
