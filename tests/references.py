"""Test inputs made on the spot, and transformers' own `generate()` on them: the reference the mesh must match."""

import io
import wave
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from omni.v1 import omni_pb2

ROLES = {"system": omni_pb2.ROLE_SYSTEM, "user": omni_pb2.ROLE_USER, "assistant": omni_pb2.ROLE_ASSISTANT}


def png(seed: int, width: int = 64, height: int = 48, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def wav(seed: int, seconds: float = 1.0, rate: int = 16000, channels: int = 1) -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    mono = 0.3 * np.sin(2 * np.pi * (200 + 300 * rng.random()) * t) + 0.05 * rng.standard_normal(len(t))
    data = (np.repeat(mono[:, None], channels, axis=1) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(data.tobytes())
    return buf.getvalue()


def video_file(seconds: float = 2.0, width: int = 160, height: int = 120, muxer: str = "mp4", codec: str = "libx264",
               sound: str = "", rate: int = 25, seed: int = 0) -> bytes:
    """A clip made by PyAV: moving noise over a gradient (every sampled frame differs), with a stereo tone as its
    soundtrack if `sound` names an audio encoder."""
    import av

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    with av.open(buf, "w", format=muxer) as out:
        v = out.add_stream(codec, rate=rate)
        v.width, v.height, v.pix_fmt = width, height, "yuv420p"
        a = out.add_stream(sound, rate=48000, layout="stereo") if sound else None
        for i in range(round(seconds * rate)):
            frame = av.VideoFrame.from_ndarray(np.roll(base, 3 * i, axis=1), format="rgb24")
            for packet in v.encode(frame):
                out.mux(packet)
        for packet in v.encode(None):
            out.mux(packet)
        if a is not None:
            t = np.arange(round(seconds * 48000)) / 48000
            pcm = (0.3 * np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)])).astype(np.float32)
            step = a.codec_context.frame_size or 960
            for at in range(0, pcm.shape[1], step):
                f = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[:, at:at + step]), format="fltp", layout="stereo")
                f.sample_rate, f.pts = 48000, at
                for packet in a.encode(f):
                    out.mux(packet)
            for packet in a.encode(None):
                out.mux(packet)
    return buf.getvalue()


def garbled_sound(data: bytes, muxer: str) -> bytes:
    """The same file remuxed with every audio packet's bytes replaced by noise: a soundtrack no decoder reads."""
    import av

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    with av.open(io.BytesIO(data)) as src, av.open(buf, "w", format=muxer) as out:
        streams = {s.index: out.add_stream_from_template(s) for s in src.streams}
        for p in src.demux():
            if p.size == 0:
                continue
            index = p.stream_index
            if p.stream.type == "audio":
                noise = av.Packet(rng.integers(0, 256, p.size, dtype=np.uint8).tobytes())
                noise.pts, noise.dts, noise.duration, noise.time_base = p.pts, p.dts, p.duration, p.time_base
                p = noise
            p.stream = streams[index]
            out.mux(p)
    return buf.getvalue()


def model_config(model_dir, **overrides):
    """The tiny model as a deployment names it (float32 on the CPU: equivalence holds there)."""
    from services.runtime.config import ModelConfig

    return ModelConfig(path=str(model_dir), dtype="float32", **overrides)


def native_thinker(model_dir, device: str = "cpu", **overrides):
    """The native thinker as served, but for `overrides` of its config section."""
    from services.runtime.config import ThinkerConfig
    from services.thinker.engine import NativeThinker

    return NativeThinker(model_config(model_dir), ThinkerConfig(**overrides), device)


def native_talker(model_dir, device: str = "cpu", **overrides):
    """The native talker as served, but for `overrides` of its config section."""
    from services.runtime.config import TalkerConfig
    from services.talker.engine import NativeTalker

    return NativeTalker(model_config(model_dir), TalkerConfig(**overrides), device)


def load_hf(model_dir):
    from transformers import logging
    from transformers.models.qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

    logging.set_verbosity_error()
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir).eval()
    model.talker.config.audio_config = model.config.thinker_config.audio_config  # see MODEL.md
    return model


def processor_expand(tokenizer, merge: int = 2):
    """transformers' own placeholder expansion (bench.hf_engine.processor_expand) of one text: (text, audio token
    counts, image grids, video grids, video seconds per grid, use_audio_in_video) -> the expanded text."""
    from bench.hf_engine import processor_expand as expand_all

    expand = expand_all(tokenizer, merge)
    return lambda text, *media: expand([text], *media)[0]


@dataclass
class Case:
    """A conversation: [(role, [("text", str) | ("image", png) | ("audio", wav) | ("video", ([png], fps))
    | ("video_file", bytes) | ("video_sound", bytes: a file heard too, use_audio_in_video)])]."""
    messages: list

    def request(self, speech: bool = False, max_tokens: int = 8, frames: int = 16, voice: str = "", greedy: bool = True,
                codes: bool = True) -> omni_pb2.GenerateRequest:
        msgs = []
        for role, parts in self.messages:
            out = []
            for kind, value in parts:
                if kind == "text":
                    out.append(omni_pb2.Part(text=value))
                elif kind == "image":
                    out.append(omni_pb2.Part(image=omni_pb2.Image(data=value)))
                elif kind == "audio":
                    out.append(omni_pb2.Part(audio=omni_pb2.Audio(file=value)))
                elif kind in ("video_file", "video_sound"):
                    out.append(omni_pb2.Part(video=omni_pb2.Video(file=value, use_audio_in_video=kind == "video_sound")))
                else:
                    frames_, fps = value
                    out.append(omni_pb2.Part(video=omni_pb2.Video(frames=[omni_pb2.Image(data=f) for f in frames_], fps=fps)))
            msgs.append(omni_pb2.Message(role=ROLES[role], parts=out))
        req = omni_pb2.GenerateRequest(
            messages=msgs, voice=voice, return_codec_codes=codes,
            output_modalities=[omni_pb2.MODALITY_TEXT] + ([omni_pb2.MODALITY_AUDIO] if speech else []),
        )
        req.sampling.max_tokens = max_tokens
        req.talker_sampling.max_tokens = frames
        if greedy:
            req.sampling.temperature = 0
            req.talker_sampling.temperature = 0
        return req


class Reference:
    """Runs transformers' generate() on a Case, preparing its inputs as Qwen3OmniMoeProcessor does."""

    def __init__(self, model_dir, hf):
        from transformers import AutoTokenizer, WhisperFeatureExtractor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from services.model.spec import OmniSpec
        from services.preprocess.media import PixelNorm, Preprocessor
        from services.runtime.config import Limits

        self.hf, self.spec = hf, OmniSpec.load(model_dir)
        self.video_pixels = PixelNorm(model_dir)  # our video patches are uint8, normalised where the encoder runs
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.images = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        self.audio = WhisperFeatureExtractor.from_pretrained(model_dir)
        self.pre = Preprocessor(model_dir, Limits())  # video only: transformers' video processor needs torchvision
        self.expand = processor_expand(self.tokenizer, self.images.merge_size)

    def inputs(self, case: Case) -> dict:
        import soundfile as sf
        from services.model.spec import audio_tokens

        messages, images, audios, videos, sound = [], [], [], [], set()
        for role, parts in case.messages:
            content = []
            for kind, value in parts:
                content.append({"type": "text", "text": value} if kind == "text" else
                               {"type": "video" if kind.startswith("video") else kind})
                if kind == "image":
                    images.append(Image.open(io.BytesIO(value)).convert("RGB"))
                elif kind == "audio":
                    audios.append(sf.read(io.BytesIO(value), dtype="float32")[0])
                elif kind == "video":
                    videos.append(self.pre.video(*value))
                    sound.add(False)
                elif kind.startswith("video"):  # its frames and sound are held to transformers' in tests/preprocess
                    videos.append(self.pre.video_file(value, 0.0))
                    sound.add(kind == "video_sound")
                    if kind == "video_sound":  # in the audio list where the processor takes its length: in turn
                        audios.append(videos[-1].soundtrack)
            messages.append({"role": role, "content": content})
        assert len(sound) <= 1, "transformers takes use_audio_in_video for a whole request"
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        kw = {"use_audio_in_video": sound == {True}}
        lengths, grids, vgrids, spg = [], [], [], []
        if images:
            out = self.images(images=images, return_tensors="pt")
            kw.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
            grids = out["image_grid_thw"].tolist()
        if audios:
            out = self.audio(audios, sampling_rate=16000, padding=True, truncation=False, return_attention_mask=True, return_tensors="pt")
            kw.update(input_features=out["input_features"], feature_attention_mask=out["attention_mask"])
            lengths = [audio_tokens(int(n)) for n in out["attention_mask"].sum(-1)]
        if videos:
            pixels = self.video_pixels(torch.from_numpy(np.concatenate([v.values for v in videos])), torch.float32)
            vgrids, spg = [v.grid_thw for v in videos], [v.second_per_grid for v in videos]
            kw.update(pixel_values_videos=pixels, video_grid_thw=torch.tensor(vgrids), video_second_per_grid=torch.tensor(spg))
        text = self.expand(text, lengths, grids, vgrids, spg, kw["use_audio_in_video"])
        ids = self.tokenizer(text, return_tensors="pt")["input_ids"]
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)

    @torch.no_grad()
    def generate(self, case: Case, max_tokens: int, speech: bool = False, frames: int = 16, voice: str = "ethan",
                 repetition_penalty: float | None = None):
        """(generated token ids, codec codes [frames x groups] or None, waveform or None); `repetition_penalty`:
        the talker's, in place of its generation config's."""
        kw = self.inputs(case)
        n = kw["input_ids"].shape[1]
        kw["thinker_eos_token_id"] = self.spec.raw["im_end_token_id"]
        if not speech:
            out = self.hf.generate(**kw, return_audio=False, thinker_max_new_tokens=max_tokens, thinker_do_sample=False)
            return out[0, n:].tolist(), None, None
        captured = {}
        decode = self.hf.code2wav.chunked_decode

        def capture(codes, **k):
            captured["codes"] = codes
            return decode(codes, **k)

        self.hf.code2wav.chunked_decode = capture
        try:
            extra = {} if repetition_penalty is None else {"talker_repetition_penalty": repetition_penalty}
            seqs, waveform = self.hf.generate(**kw, thinker_max_new_tokens=max_tokens, thinker_do_sample=False,
                                              talker_do_sample=False, talker_max_new_tokens=frames + 1, speaker=voice, **extra)
        finally:
            self.hf.code2wav.chunked_decode = decode
        codes = captured["codes"][0].T.tolist() if "codes" in captured else []
        return seqs[0, n:].tolist(), codes, waveform.reshape(-1).float().numpy()


def thinker_seq(reference: Reference, case: Case, max_tokens: int, return_states: bool = False):
    """The thinker request the mesh would send for `case`: prompt, M-RoPE positions, and embeddings
    from transformers' own towers at the placeholder runs."""
    from services.model.positions import Layout, mrope_positions, tokens_from_config
    from services.llm.sampling import SamplingParams
    from services.model.spec import audio_tokens
    from services.thinker.seq import Span, ThinkerSeq

    kw = reference.inputs(case)
    ids, th, spec = kw["input_ids"][0], reference.hf.thinker, reference.spec

    def runs(token: int) -> list[int]:
        return [i for i in range(len(ids)) if ids[i] == token and (i == 0 or ids[i - 1] != token)]

    spans, audio_lens = [], []
    with torch.no_grad():
        if "pixel_values" in kw:
            v = th.get_image_features(kw["pixel_values"], kw["image_grid_thw"])
            row = 0
            for offset, e in zip(runs(spec.thinker["image_token_id"]), v.pooler_output):
                spans.append(Span(offset, e, [d[row:row + len(e)] for d in v.deepstack_features]))
                row += len(e)
        if "input_features" in kw:
            a = th.get_audio_features(kw["input_features"], kw["feature_attention_mask"]).last_hidden_state
            audio_lens = [audio_tokens(int(n)) for n in kw["feature_attention_mask"].sum(-1)]
            row = 0
            for offset, n in zip(runs(spec.thinker["audio_token_id"]), audio_lens):
                spans.append(Span(offset, a[row:row + n]))
                row += n
    layout = Layout(image_grid_thw=[tuple(g.tolist()) for g in kw.get("image_grid_thw", [])], audio_tokens=audio_lens)
    positions, delta = mrope_positions(ids.tolist(), layout, tokens_from_config(spec.thinker))
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=(spec.raw["im_end_token_id"],))
    return ThinkerSeq("r", ids, params, torch.from_numpy(positions), delta, spans, return_states=return_states)


def hf_talker_sharing(model_dir, talker: torch.nn.Module, device) -> torch.nn.Module:
    """transformers' talker (talker LM, codec head, code predictor) holding the very tensors of our TalkerModel
    `talker`: only the rotary tables, which are not weights, are its own."""
    from services.model.load import build_component, load_config

    hf = build_component("talker", load_config(model_dir), "meta", next(talker.parameters()).dtype)
    missing, unexpected = hf.load_state_dict(talker.state_dict(), strict=False, assign=True)
    assert not unexpected and all("rotary_emb" in k for k in missing), (missing, unexpected)
    for parent in (hf.model, hf.code_predictor.model):
        with torch.device(device):
            parent.rotary_emb = type(parent.rotary_emb)(config=parent.rotary_emb.config)
    return hf.eval()


def mrope_rows(n: int) -> torch.Tensor:
    """Positions [3, n] whose three M-RoPE rows differ (as an image's do), so every rotary section is exercised."""
    t = torch.arange(n)
    return torch.stack([t, t // 2, t % 5])


def talker_logits(engine, x: torch.Tensor) -> torch.Tensor:
    """Our talker's codec logits [n, V] over input rows `x` [n, D] at `mrope_rows(n)`, through the engine's
    own attention backend and experts over its paged cache (a prompt's prefill)."""
    from services.llm.attention import SeqSlice
    from services.llm.context import step_context

    n, alloc = len(x), engine.scheduler.allocator
    blocks = alloc.allocate(-(-n // engine.scheduler.block_size))
    positions = mrope_rows(n).float().to(x.device)
    try:
        with torch.no_grad(), step_context(engine.attention.plan([SeqSlice(blocks, 0, n)]), engine.moe):
            return engine.talker.codec_head(engine.talker.model(x, positions)).float()
    finally:
        alloc.release(blocks)


def hf_talker_logits(hf, x: torch.Tensor, attention: str = "sdpa") -> torch.Tensor:
    hf.model.config._attn_implementation = attention
    positions = mrope_rows(len(x)).to(x.device)[:, None]
    with torch.no_grad():
        return hf.codec_head(hf.model(inputs_embeds=x[None], position_ids=positions).last_hidden_state[0]).float()


def predictor_logits(engine, hidden: torch.Tensor, code0: torch.Tensor) -> torch.Tensor:
    """Our code predictor's logits [B, V] for each frame's second code, from the talker's states `hidden` [B, D]
    and the first codes `code0` [B]: its first step, on its dense cache."""
    from services.llm.context import step_context

    b, cp = len(code0), engine.talker.code_predictor
    x = torch.stack([hidden, engine.talker.get_input_embeddings()(code0)], dim=1).reshape(2 * b, -1)
    positions = torch.arange(2, device=x.device).repeat(b).float().expand(3, -1)
    with torch.no_grad(), step_context(engine.predictor.attention.at(b, 0, 2), engine.moe):
        return cp.lm_head[0](cp.model(x, positions)[1::2]).float()


def hf_predictor_logits(hf, hidden: torch.Tensor, code0: torch.Tensor, attention: str = "sdpa") -> torch.Tensor:
    cp = hf.code_predictor
    cp.model.config._attn_implementation = attention
    x = torch.stack([hidden, hf.get_input_embeddings()(code0)], dim=1)
    with torch.no_grad():
        return cp.lm_head[0](cp.model(inputs_embeds=x).last_hidden_state[:, -1]).float()
