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
from converse_client import IN_RATE, Conversation, Load, settings, speech_clip
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
