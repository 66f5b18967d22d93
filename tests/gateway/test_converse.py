"""Converse sessions on the CPU mesh (real processes, real sockets): conversations of several turns with audio in
and out, each turn answered as Generate answers the same conversation; turn detection on silence; cancel,
barge-in and a client that leaves free every stage's work at once; sessions side by side; bad events answered with
error events while the session goes on."""

import asyncio
import time

import grpc
import numpy as np
import pytest

from client_util import generate
from converse_client import IN_RATE, Answer, Conversation, Load, settings, speech_clip
from omni.v1 import omni_pb2
from references import png

FREED_S = 0.1  # every stage's in-flight work gone after a cancel, barge-in or disconnect: within a decode step or so


def run(coro):
    return asyncio.run(coro)


def user(*parts) -> omni_pb2.Message:
    return omni_pb2.Message(role=omni_pb2.ROLE_USER, parts=list(parts))


def pcm_part(pcm: bytes, rate: int) -> omni_pb2.Part:
    return omni_pb2.Part(audio=omni_pb2.Audio(pcm=omni_pb2.RawPcm(data=pcm, sample_rate=rate,
                                                                  encoding=omni_pb2.PCM_ENCODING_S16LE)))


def test_three_turns_with_audio_in_and_out_are_generate_over_the_conversation(native_mesh):
    """Each turn's answer is, token for token, what Generate answers to the conversation so far: the earlier
    turns' audio and text, and the assistant's earlier answers as the transcripts the session sent."""
    rate = 16000  # the audio tower's: the session's audio reaches the prompt as sent
    s = settings(rate=rate, instructions="You are terse.", return_codec_codes=True)
    clips = [speech_clip(0.8, seed=i, rate=rate) for i in range(3)]
    extra = [None, omni_pb2.Part(text="And this?"), omni_pb2.Part(image=omni_pb2.Image(data=png(3)))]

    async def converse():
        async with Conversation(native_mesh.gateway_address) as c:
            info = await c.start(s)
            assert info.settings.instructions == "You are terse." and info.session_id
            answers = []
            for clip, part in zip(clips, extra):
                if part is not None:
                    await c.send(item=user(part))
                await c.audio(clip, rate)
                await c.send(commit=omni_pb2.Commit())
                answers.append(await c.turn())
            return answers

    answers = run(converse())
    history = [omni_pb2.Message(role=omni_pb2.ROLE_SYSTEM, parts=[omni_pb2.Part(text="You are terse.")])]
    for i, (a, clip, part) in enumerate(zip(answers, clips, extra)):
        assert a.done.status == omni_pb2.TURN_STATUS_COMPLETED and not a.errors, a.kinds
        assert a.kinds[:2] == ["committed", "started"] and "audio" in a.kinds and "text" in a.kinds
        history.append(user(*([part] if part is not None else []), pcm_part(clip, rate)))
        req = omni_pb2.GenerateRequest(messages=history, output_modalities=[omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO],
                                       sampling=s.sampling, talker_sampling=s.talker_sampling, return_codec_codes=True)
        ref = generate(native_mesh.gateway_address, req)
        assert a.token_ids == ref.token_ids, f"turn {i}"
        assert a.frames == len(ref.codes) and a.samples == ref.samples, f"turn {i}"
        assert a.done.usage.prompt_tokens == ref.finished.usage.prompt_tokens, f"turn {i}"
        assert a.done.transcript and a.done.transcript in a.text
        history.append(omni_pb2.Message(role=omni_pb2.ROLE_ASSISTANT, parts=[omni_pb2.Part(text=a.done.transcript)]))
    assert answers[0].done.usage.prompt_tokens < answers[1].done.usage.prompt_tokens < answers[2].done.usage.prompt_tokens


@pytest.fixture(scope="module")
def tokenizer(native_mesh):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(native_mesh.cfg.model.dir)


def prompt_tokens(mesh, messages: list[omni_pb2.Message]) -> int:
    """The prompt tokens Generate reports for `messages`."""
    req = omni_pb2.GenerateRequest(messages=messages)
    req.sampling.max_tokens = 1
    return generate(mesh.gateway_address, req).finished.usage.prompt_tokens


def spoken(tokenizer, answer) -> str:
    return tokenizer.decode(answer.token_ids[:answer.frames], skip_special_tokens=True).strip()


async def hold_busy(c: Conversation, load: Load) -> list:
    """Events read until the thinker and the talker both hold the turn being answered."""
    got = await c.until("audio")
    while not await load.busy("thinker0", "talker0"):
        got += await c.until("audio")
    return got


def test_turn_detection_commits_on_silence(native_mesh):
    """Speech then silence, and no commit from the client: the session commits the turn itself, from a little
    before the speech started to the end of the silence that ended it, and answers; silence alone starts nothing."""

    async def converse():
        async with Conversation(native_mesh.gateway_address) as c:
            info = await c.start(settings(vad=True))
            t = info.settings.turn_detection
            assert (t.aggressiveness, t.speech_ms, t.silence_ms) == (2, 150, 500)  # the deployment's defaults
            answers = []
            for seed in range(2):
                await c.audio(np.zeros(int(0.5 * IN_RATE), "<i2").tobytes() + speech_clip(1.0, seed, silence_s=0.8))
                answers.append(await c.turn())
            await c.audio(np.zeros(2 * IN_RATE, "<i2").tobytes())
            await c.send(clear=omni_pb2.Clear())
            quiet = await c.until("cleared")
            return answers, quiet

    answers, quiet = run(converse())
    for i, a in enumerate(answers):
        assert a.kinds[:4] == ["speech_started", "speech_stopped", "committed", "started"], a.kinds
        started, stopped = a.events[0].speech_started.audio_start_seconds, a.events[1].speech_stopped.audio_end_seconds
        at = 0.5 + 2.3 * i  # where this turn's speech starts in the session's audio
        assert at - 0.1 <= started <= at + 0.2 and at + 1.0 < stopped <= at + 1.0 + 0.8, (started, stopped)
        assert 1.0 < a.events[2].committed.audio_seconds < 1.0 + 0.8 + 0.5
        assert a.events[0].speech_started.item_id == a.events[1].speech_stopped.item_id == a.events[2].committed.item_id
        assert a.done.status == omni_pb2.TURN_STATUS_COMPLETED and a.audio and a.token_ids
    assert answers[1].done.usage.prompt_tokens > answers[0].done.usage.prompt_tokens
    assert answers[0].events[2].committed.item_id != answers[1].events[2].committed.item_id
    assert [e.WhichOneof("event") for e in quiet] == ["cleared"]


def test_cancel_stops_every_stage_at_once_and_keeps_what_was_said(native_mesh, tokenizer):
    """A cancel mid-answer: the thinker's and the talker's work (and every other stage's calls) are gone within
    FREED_S, the turn ends CANCELLED with the transcript of the audio sent, and the next turn's prompt holds that
    transcript, as Generate over the same conversation shows."""
    rate = 16000
    clips = [speech_clip(0.6, seed=i, rate=rate) for i in range(2)]

    async def converse():
        load = Load(native_mesh)
        async with Conversation(native_mesh.gateway_address) as c:
            await c.start(settings(long=True, tokens=250, frames=1000, rate=rate, return_codec_codes=True))
            await c.audio(clips[0], rate)
            await c.send(commit=omni_pb2.Commit())
            got = await hold_busy(c, load)
            answer_item = next(e.started.item_id for e in got if e.HasField("started"))
            await c.send(delete_item=omni_pb2.DeleteItem(item_id=answer_item))
            got += await c.until("error")
            t0 = time.perf_counter()
            await c.send(cancel=omni_pb2.Cancel())
            freed = await load.freed_within(t0)
            first = Answer(got + await c.until("done"))
            await c.send(settings=settings(rate=rate, return_codec_codes=True))
            await c.until("session")
            await c.audio(clips[1], rate)
            await c.send(commit=omni_pb2.Commit())
            second = await c.turn()
        await load.close()
        return freed, first, second


    (seconds, held), first, second = run(converse())
    assert seconds < FREED_S and all(v == (0, 0) for v in held.values()), (seconds, held)
    assert first.done.status == omni_pb2.TURN_STATUS_CANCELLED and first.frames > 0
    assert first.errors[0].code == "FAILED_PRECONDITION" and "answer in progress" in first.errors[0].message
    assert len(first.token_ids) > first.frames  # the thinker was ahead of the speech: its text past it is not kept
    assert first.done.transcript == spoken(tokenizer, first)
    u = first.done.usage
    assert u.audio_frames == first.frames and len(first.token_ids) <= u.completion_tokens < 250
    assert u.prompt_tokens == prompt_tokens(native_mesh, [user(pcm_part(clips[0], rate))])
    assert second.done.status == omni_pb2.TURN_STATUS_COMPLETED
    history = [user(pcm_part(clips[0], rate)),
               omni_pb2.Message(role=omni_pb2.ROLE_ASSISTANT, parts=[omni_pb2.Part(text=first.done.transcript)]),
               user(pcm_part(clips[1], rate))]
    s = settings(rate=rate)
    ref = generate(native_mesh.gateway_address, omni_pb2.GenerateRequest(
        messages=history, output_modalities=[omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO], sampling=s.sampling,
        talker_sampling=s.talker_sampling))
    assert second.token_ids == ref.token_ids and second.done.usage.prompt_tokens == ref.finished.usage.prompt_tokens


def test_speaking_over_an_answer_stops_it(native_mesh, tokenizer):
    """Barge-in: speech that starts while the assistant answers stops the answer everywhere within FREED_S of the
    speech reaching the gateway; the turn ends INTERRUPTED with what was said, and the new speech is the next turn."""

    async def converse():
        load = Load(native_mesh)
        async with Conversation(native_mesh.gateway_address) as c:
            await c.start(settings(vad=True, long=True, tokens=250, frames=1000, return_codec_codes=True))
            await c.audio(speech_clip(0.6, 0, silence_s=0.8))
            got = await hold_busy(c, load)
            t0 = time.perf_counter()
            await c.audio(speech_clip(0.8, 1))  # no silence after it yet: no next turn starts while we look
            freed = await load.freed_within(t0)
            first = Answer(got + await c.until("done"))
            await c.send(settings=settings(vad=True, return_codec_codes=True))
            await c.until("session")
            await c.audio(np.zeros(IN_RATE, "<i2").tobytes())
            second = await c.turn()
        await load.close()
        return freed, first, second


    (seconds, held), first, second = run(converse())
    assert seconds < FREED_S and all(v == (0, 0) for v in held.values()), (seconds, held)
    assert first.done.status == omni_pb2.TURN_STATUS_INTERRUPTED and "speech_started" in first.kinds
    assert first.done.transcript == spoken(tokenizer, first)
    # the prompt held the committed audio (16 kHz in the session), whatever its samples: Generate counts the same
    committed = next(e.committed for e in first.events if e.HasField("committed"))
    silent = np.zeros(round(committed.audio_seconds * 16000), "<i2").tobytes()
    u = first.done.usage
    assert u.prompt_tokens == prompt_tokens(native_mesh, [user(pcm_part(silent, 16000))])
    assert len(first.token_ids) <= u.completion_tokens < 250 and u.audio_frames == first.frames
    kinds = first.kinds[len(first.kinds) - 1 - first.kinds[::-1].index("speech_started"):]
    assert kinds == ["speech_started", "done"], kinds  # nothing more of the answer after the user spoke
    assert second.kinds[:3] == ["speech_stopped", "committed", "started"] and second.done.status == omni_pb2.TURN_STATUS_COMPLETED


def test_a_client_that_leaves_frees_everything(native_mesh):
    from client_util import metric

    async def converse():
        load = Load(native_mesh)
        c = Conversation(native_mesh.gateway_address)
        await c.start(settings(long=True, tokens=250, frames=1000))
        await c.audio(speech_clip(0.6))
        await c.send(commit=omni_pb2.Commit())
        await hold_busy(c, load)
        t0 = time.perf_counter()
        await c.__aexit__()
        freed = await load.freed_within(t0)
        await load.close()
        return freed

    seconds, held = run(converse())
    assert seconds < 1.0 and all(v == (0, 0) for v in held.values()), (seconds, held)
    port = native_mesh.cfg.gateway.replicas[0].metrics_port
    assert metric(port, "omni_inflight_requests", method="Converse") == 0


def test_items_deleted_and_an_answer_cut_leave_the_conversation_as_told(native_mesh, tokenizer):
    """Each user message and answer is an item, named by the client or by the session: deleting some and cutting an
    answer to the audio heard leave the next prompt the conversation so changed, as Generate over it shows; unknown
    ids and bad cuts are errors that change nothing."""
    rate = 16000
    s = settings(long=True, tokens=12, frames=12, rate=rate, return_codec_codes=True)
    clips = [speech_clip(0.5, seed=20 + i, rate=rate) for i in range(3)]

    async def converse():
        async with Conversation(native_mesh.gateway_address) as c:
            await c.start(s)
            answers, errors, events = [], {}, {}
            for i, clip in enumerate(clips[:2]):
                await c.audio(clip, rate)
                await c.send(commit=omni_pb2.Commit(item_id="mine" if i == 0 else ""))
                answers.append(await c.turn())
            ids = [(next(e.committed.item_id for e in a.events if e.HasField("committed")),
                    next(e.started.item_id for e in a.events if e.HasField("started"))) for a in answers]
            half = answers[0].samples / 24000 / 2

            async def send(name, expect, **event):
                await c.send(**event)
                got = (await c.until(expect))[-1]
                (errors if expect == "error" else events)[name] = getattr(got, expect)

            await send("unknown", "error", delete_item=omni_pb2.DeleteItem(item_id="nope"))
            await send("no id", "error", truncate_item=omni_pb2.TruncateItem())
            await send("cut a user item", "error", truncate_item=omni_pb2.TruncateItem(item_id="mine", audio_end_seconds=0.1))
            await send("cut past the audio", "error", truncate_item=omni_pb2.TruncateItem(item_id=ids[0][1], audio_end_seconds=3 * half))
            await c.audio(clips[2], rate)
            await send("taken id", "error", commit=omni_pb2.Commit(item_id=ids[1][1]))
            await send("delete", "item_deleted", delete_item=omni_pb2.DeleteItem(item_id="mine"))
            await send("delete again", "error", delete_item=omni_pb2.DeleteItem(item_id="mine"))
            await send("delete answer", "item_deleted", delete_item=omni_pb2.DeleteItem(item_id=ids[1][1]))
            await send("cut", "item_truncated", truncate_item=omni_pb2.TruncateItem(item_id=ids[0][1], audio_end_seconds=half))
            await c.send(commit=omni_pb2.Commit())  # the audio held since the refused commit
            return ids, answers, errors, events, await c.turn()

    ids, answers, errors, events, last = run(converse())
    assert ids[0][0] == "mine" and len({x for pair in ids for x in pair}) == 4, ids
    assert all(a.done.status == omni_pb2.TURN_STATUS_COMPLETED and a.frames == 12 for a in answers)
    expect = {"unknown": ("NOT_FOUND", "'nope'"), "no id": ("NOT_FOUND", "no item"),
              "cut a user item": ("INVALID_ARGUMENT", "user message"), "cut past the audio": ("INVALID_ARGUMENT", "outside"),
              "taken id": ("INVALID_ARGUMENT", "already in the conversation"), "delete again": ("NOT_FOUND", "'mine'")}
    for name, (code, words) in expect.items():
        assert errors[name].code == code and words in errors[name].message, (name, errors[name])
    assert events["delete"].item_id == "mine" and events["delete answer"].item_id == ids[1][1]
    cut = events["cut"]
    heard = tokenizer.decode(answers[0].token_ids[:6], skip_special_tokens=True).strip()  # 6 of its 12 frames
    assert cut.item_id == ids[0][1] and cut.transcript == heard and heard != answers[0].done.transcript
    history = ([omni_pb2.Message(role=omni_pb2.ROLE_ASSISTANT, parts=[omni_pb2.Part(text=heard)])] if heard else []) \
        + [user(pcm_part(clips[1], rate)), user(pcm_part(clips[2], rate))]
    ref = generate(native_mesh.gateway_address, omni_pb2.GenerateRequest(
        messages=history, output_modalities=[omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO], sampling=s.sampling,
        talker_sampling=s.talker_sampling))
    assert last.done.status == omni_pb2.TURN_STATUS_COMPLETED and last.token_ids == ref.token_ids
    assert last.done.usage.prompt_tokens == ref.finished.usage.prompt_tokens


def test_eight_sessions_at_once(native_mesh):
    async def session(i):
        async with Conversation(native_mesh.gateway_address) as c:
            await c.start(settings())
            answers = []
            for turn in range(2):
                await c.audio(speech_clip(0.5, seed=10 * i + turn))
                await c.send(commit=omni_pb2.Commit())
                answers.append(await c.turn(timeout=120))
            return answers

    async def all_of_them():
        load = Load(native_mesh)
        sessions = await asyncio.gather(*(session(i) for i in range(8)))
        freed = await load.freed_within(time.perf_counter())
        await load.close()
        return sessions, freed

    sessions, (_, held) = run(all_of_them())
    for answers in sessions:
        assert all(a.done.status == omni_pb2.TURN_STATUS_COMPLETED and a.audio and not a.errors for a in answers)
        assert answers[0].done.usage.prompt_tokens < answers[1].done.usage.prompt_tokens
    assert all(v == (0, 0) for v in held.values()), held


def test_the_command_line_client_holds_a_conversation(native_mesh, tmp_path):
    """`services.client --converse` speaks each file as a turn of one session and writes each answer's speech: the
    first answer is Generate's over that audio, sample for sample, and the second turn's prompt holds the first."""
    import re
    import subprocess
    import sys
    import wave

    from services.runtime.config import REPO_ROOT

    rate = 16000  # the audio tower's: the file's samples reach the prompt as they are
    clips = [speech_clip(0.5, seed=30 + i, rate=rate) for i in range(2)]
    files = []
    for i, clip in enumerate(clips):
        files.append(tmp_path / f"turn{i}.wav")
        with wave.open(str(files[-1]), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(rate)
            w.writeframes(clip)
    cmd = [sys.executable, "-m", "services.client", "--address", native_mesh.gateway_address, "--speech",
           str(tmp_path / "answer.wav"), "--max-tokens", "6", "--max-frames", "10", "--temperature", "0"]
    for f in files:
        cmd += ["--converse", str(f)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    summaries = [line for line in done.stderr.splitlines() if line.startswith("[TURN_STATUS_COMPLETED]")]
    prompts = [int(re.match(r"\[\w+\] (\d+) prompt", line).group(1)) for line in summaries]
    assert len(prompts) == 2 and prompts[0] < prompts[1], done.stderr
    answers = []
    for i in (1, 2):
        with wave.open(str(tmp_path / f"answer-{i}.wav")) as w:
            assert (w.getnchannels(), w.getframerate()) == (1, 24000)
            answers.append(w.readframes(w.getnframes()))
    assert all(answers)
    s = settings(rate=rate)
    ref = generate(native_mesh.gateway_address, omni_pb2.GenerateRequest(
        messages=[user(pcm_part(clips[0], rate))], output_modalities=[omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO],
        sampling=s.sampling, talker_sampling=s.talker_sampling))
    assert prompts[0] == ref.finished.usage.prompt_tokens
    assert np.array_equal(np.frombuffer(answers[0], "<i2"), np.round(np.concatenate(ref.pcm) * 32767).astype("<i2"))
    assert done.stdout.splitlines()[0] == ref.text


def test_bad_events_get_errors_and_the_session_goes_on(native_mesh):
    """Each bad event gets an error naming its problem; the session keeps its settings, its conversation and its
    audio, and answers the next good turn."""
    good = settings(speech=False)

    async def converse():
        async with Conversation(native_mesh.gateway_address) as c:
            await c.start(good)
            errors = {}

            async def refused(name, expect="error", **event):
                await c.send(**event)
                got = await c.until(expect)
                errors[name] = next((e.error for e in got if e.HasField("error")), None)

            await refused("odd chunk", audio=b"\x01\x02\x03")
            await refused("empty chunk", audio=b"")
            await refused("no event")
            await refused("rate", settings=settings(rate=1000))
            await refused("encoding", settings=omni_pb2.SessionSettings(input_encoding=7))
            await refused("voice", settings=settings(voice="nobody"))
            await refused("vad", settings=omni_pb2.SessionSettings(
                turn_detection=omni_pb2.TurnDetection(enabled=True, aggressiveness=9)))
            await refused("nothing to commit", commit=omni_pb2.Commit())
            await refused("nothing to cancel", cancel=omni_pb2.Cancel())
            await refused("assistant item", item=omni_pb2.Message(role=omni_pb2.ROLE_ASSISTANT, parts=[omni_pb2.Part(text="x")]))
            await refused("empty item", item=omni_pb2.Message())
            await refused("reserved text", item=user(omni_pb2.Part(text="<|im_end|>")))
            await refused("too much audio", audio=bytes(int(21 * IN_RATE) * 2))
            # a corrupt image: the turn fails and leaves the conversation; the next turn does not carry it
            await c.send(item=user(omni_pb2.Part(image=omni_pb2.Image(data=b"\x89PNG garbage"))))
            await c.send(commit=omni_pb2.Commit())
            failed = await c.turn()
            # an F32 stream with a NaN in it
            await c.send(settings=settings(speech=False, input_encoding=omni_pb2.PCM_ENCODING_F32LE))
            await c.until("session")
            await refused("nan", audio=np.array([0.1, np.nan], "<f4").tobytes())
            await refused("over one", audio=np.array([0.1, 2.0], "<f4").tobytes())
            await c.send(settings=good)
            await c.until("session")
            await c.audio(speech_clip(0.5))
            await c.send(commit=omni_pb2.Commit())
            await c.until("started")
            await refused("commit while answering", commit=omni_pb2.Commit())
            answer = await c.turn()
            return errors, failed, answer

    errors, failed, answer = run(converse())
    expect = {
        "odd chunk": ("INVALID_ARGUMENT", "not a whole number of 2-byte samples", "audio"),
        "empty chunk": ("INVALID_ARGUMENT", "empty", "audio"),
        "no event": ("INVALID_ARGUMENT", "the event is empty", ""),
        "rate": ("INVALID_ARGUMENT", "input_sample_rate 1000", "settings"),
        "encoding": ("INVALID_ARGUMENT", "input_encoding 7", "settings"),
        "voice": ("INVALID_ARGUMENT", "unknown voice nobody", "settings"),
        "vad": ("INVALID_ARGUMENT", "aggressiveness must be 0 to 3", "settings"),
        "nothing to commit": ("INVALID_ARGUMENT", "nothing to commit", "commit"),
        "nothing to cancel": ("FAILED_PRECONDITION", "no answer is in progress", "cancel"),
        "assistant item": ("INVALID_ARGUMENT", "ROLE_ASSISTANT", "item"),
        "empty item": ("INVALID_ARGUMENT", "no parts", "item"),
        "reserved text": ("INVALID_ARGUMENT", "reserved token", "item"),
        "too much audio": ("RESOURCE_EXHAUSTED", "commit or clear", "audio"),
        "nan": ("INVALID_ARGUMENT", "NaN", "audio"),
        "over one": ("INVALID_ARGUMENT", "[-1, 1]", "audio"),
        "commit while answering": ("FAILED_PRECONDITION", "answer is in progress", "commit"),
    }
    for name, (code, words, event) in expect.items():
        e = errors[name]
        assert e is not None and e.code == code and words in e.message and e.event == event, (name, e)
    assert failed.done.status == omni_pb2.TURN_STATUS_FAILED
    assert failed.errors[0].code == "INVALID_ARGUMENT" and "image" in failed.errors[0].message, failed.errors
    assert answer.done.status == omni_pb2.TURN_STATUS_COMPLETED and answer.token_ids
    one_turn = generate(native_mesh.gateway_address, omni_pb2.GenerateRequest(
        messages=[user(omni_pb2.Part(audio=omni_pb2.Audio(pcm=omni_pb2.RawPcm(
            data=speech_clip(0.5), sample_rate=IN_RATE, encoding=omni_pb2.PCM_ENCODING_S16LE))))],
        sampling=good.sampling))
    assert answer.done.usage.prompt_tokens == one_turn.finished.usage.prompt_tokens  # nothing of the failed turn


def test_a_malformed_event_is_an_error_event(native_mesh):
    async def converse():
        async with grpc.aio.insecure_channel(native_mesh.gateway_address) as ch:
            call = ch.stream_stream("/omni.v1.Omni/Converse", request_serializer=None,
                                    response_deserializer=omni_pb2.ConverseResponse.FromString)()
            first = await call.read()
            await call.write(b"\x0a\xff\xff\xff\x0f garbage")
            error = await call.read()
            await call.write(omni_pb2.ConverseRequest(clear=omni_pb2.Clear()).SerializeToString())
            cleared = await call.read()
            call.cancel()
            return first, error, cleared

    first, error, cleared = run(converse())
    assert first.HasField("session")
    assert error.error.code == "INVALID_ARGUMENT" and "malformed omni.v1.ConverseRequest" in error.error.message
    assert cleared.HasField("cleared")


@pytest.fixture(scope="module")
def budget_gateway(native_mesh, tmp_path_factory):
    """A second gateway in front of the same stages, keeping few tokens of a conversation."""
    import yaml

    from conftest import free_ports
    from services.launch import Mesh

    tmp = tmp_path_factory.mktemp("budget")
    cfg = yaml.safe_load(native_mesh.config_path.read_text())
    port, metrics_port = free_ports(2)
    cfg["gateway"] = {"replicas": [{"port": port, "metrics_port": metrics_port}], "session_context_tokens": BUDGET}
    (tmp / "mesh.yaml").write_text(yaml.safe_dump(cfg))
    with Mesh(tmp / "mesh.yaml", log_dir=tmp, stages=("gateway",)) as m:
        yield m


BUDGET = 60  # tokens: about two turns of half a second of speech and a short answer


def test_the_oldest_turns_leave_a_conversation_past_its_budget(budget_gateway):
    """Past the budget the oldest turn is dropped, with a truncated event; the next prompt is Generate's over the
    turns kept."""
    rate = 16000
    s = settings(speech=False, rate=rate)
    clips = [speech_clip(0.5, seed=i, rate=rate) for i in range(4)]

    async def converse():
        async with Conversation(budget_gateway.gateway_address) as c:
            await c.start(s)
            answers, truncations = [], []
            for clip in clips:
                await c.audio(clip, rate)
                await c.send(commit=omni_pb2.Commit())
                answers.append(await c.turn())
                await c.send(clear=omni_pb2.Clear())  # the truncated event, if any, comes before this one's
                truncations.append([e.truncated for e in await c.until("cleared") if e.HasField("truncated")])
            return answers, truncations

    answers, truncations = run(converse())
    assert all(a.done.status == omni_pb2.TURN_STATUS_COMPLETED for a in answers)
    kept, before = [], []  # turns in the conversation; and as each turn was answered
    for i, t in enumerate(truncations):
        before.append(list(kept))
        kept.append(i)
        for event in t:
            assert event.turns_dropped >= 1 and event.tokens_dropped > 0
            del kept[:event.turns_dropped]
            assert event.turns_kept == len(kept)
    assert 0 not in before[3], truncations
    history = []
    for i in before[3]:
        history += [user(pcm_part(clips[i], rate)),
                    omni_pb2.Message(role=omni_pb2.ROLE_ASSISTANT, parts=[omni_pb2.Part(text=answers[i].done.transcript)])]
    ref = generate(budget_gateway.gateway_address, omni_pb2.GenerateRequest(
        messages=history + [user(pcm_part(clips[3], rate))], sampling=s.sampling))
    assert answers[3].token_ids == ref.token_ids
    assert answers[3].done.usage.prompt_tokens == ref.finished.usage.prompt_tokens


def test_a_long_session_keeps_within_a_requests_media_limit(native_mesh):
    """Each turn's audio is a media item of the next prompts: past the deployment's max_media_items (4 here) the
    oldest turns leave, and every turn is still answered."""
    limit = native_mesh.cfg.limits.max_media_items

    async def converse():
        async with Conversation(native_mesh.gateway_address) as c:
            await c.start(settings(speech=False, tokens=2))
            answers = []
            for i in range(limit + 2):
                await c.audio(speech_clip(0.3, seed=i))
                await c.send(commit=omni_pb2.Commit())
                answers.append(await c.turn())
            return answers

    answers = run(converse())
    assert all(a.done.status == omni_pb2.TURN_STATUS_COMPLETED and not a.errors for a in answers), \
        [(a.done.status, a.errors) for a in answers]
    truncated = [[e.truncated for e in a.events if e.HasField("truncated")] for a in answers]
    assert not any(truncated[:limit]) and all(t and t[0].turns_dropped == 1 for t in truncated[limit:]), truncated
    assert answers[limit].kinds[:3] == ["committed", "truncated", "started"]
