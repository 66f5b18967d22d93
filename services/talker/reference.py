"""The reference talker engine: transformers' own talker, code predictor and code2wav, one request per forward.

It follows transformers' `Qwen3OmniMoeForConditionalGeneration.generate()` step for step, except that
it starts as soon as the thinker's first states arrive and consumes one text token per frame as the
thinker produces them, instead of waiting for the whole text. Speech is decoded in chunks with left
context as frames come.
"""

import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from transformers import DynamicCache

from services.llm.mrope import Layout, mrope_positions, tokens_from_config
from services.llm.sampling import SamplingParams, sample_next
from services.model.load import load_component
from services.model.spec import OmniSpec
from services.runtime.errors import InvalidArgument

# The code predictor's own sampling in transformers (fixed there, whatever the talker's settings).
PREDICTOR_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.8)


@dataclass
class TalkerSeq:
    request_id: str
    prompt_ids: torch.Tensor  # [L] the thinker's prompt
    layout: Layout
    speaker_id: int
    params: SamplingParams  # max_tokens counts frames
    tts_embeds: torch.Tensor  # [3, H_thinker]: thinker input embeddings of tts bos, eos, pad
    # thinker states in order as they arrive: (embeds [n, H], hidden [n, H]); text_ended once the thinker is done
    inbox: deque = field(default_factory=deque)
    text_ended: bool = False
    # engine state
    text_done: bool = False  # text_ended as seen after taking in every state sent before it
    done: bool = False
    eos: bool = False
    embeds: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    n_states: int = 0
    cache: DynamicCache | None = None
    n_cached: int = 0
    rope_delta: float = 0.0
    code0: int | None = None  # sampled, its frame not yet predicted
    past_hidden: torch.Tensor | None = None  # [1, 1, D] talker output at the last position
    frames: list[list[int]] = field(default_factory=list)
    decoded: int = 0  # frames already turned into audio
    generator: torch.Generator | None = None
    predictor_generator: torch.Generator | None = None
    tts: torch.Tensor | None = None  # [3, D] projected tts bos, eos, pad
    seconds: dict = field(default_factory=lambda: {"talker": 0.0, "code_predictor": 0.0, "code2wav": 0.0})


@dataclass
class SpeechChunk:
    pcm: np.ndarray  # float32 mono
    codes: list[list[int]]  # frames x codebooks
    first_frame: int


@dataclass
class TalkerStep:
    chunks: list[SpeechChunk]
    finished: bool = False


class ReferenceTalker:
    def __init__(self, model_dir, device: str = "cpu", dtype: torch.dtype = torch.float32, load_format: str = "auto",
                 seed: int = 0, first_chunk_frames: int = 5, chunk_frames: int = 25, left_context_frames: int = 25):
        self.device, self.dtype = torch.device(device), dtype
        self.talker = load_component("talker", model_dir, device, dtype, load_format, seed)
        self.code2wav = load_component("code2wav", model_dir, device, dtype, load_format, seed)
        self.spec = spec = OmniSpec.load(model_dir)
        tc = spec.talker
        self.voices = spec.voices
        self.codec = {k: tc[k] for k in ("codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id", "codec_pad_id", "codec_bos_id")}
        self.codec_eos = tc["codec_eos_token_id"]
        vocab = tc["text_config"]["vocab_size"]
        self.suppress = torch.tensor([i for i in range(vocab - 1024, vocab) if i != self.codec_eos], device=self.device)
        self.suppress_with_eos = torch.arange(vocab - 1024, vocab, device=self.device)  # fixed-length speech
        self.groups = tc["num_code_groups"]
        self.mm_ids = torch.tensor([spec.thinker[k] for k in ("audio_token_id", "image_token_id", "video_token_id")])
        self.rope_tokens = tokens_from_config(tc)
        self.tts_pad_id = spec.raw["tts_pad_token_id"]
        self.chunking = (first_chunk_frames, chunk_frames, left_context_frames)
        self.samples_per_frame = int(self.code2wav.total_upsample)
        self.sample_rate = 24000

    # -- engine protocol ---------------------------------------------------------------------------

    def add(self, seq: TalkerSeq) -> None:
        if seq.params.max_tokens < 1:
            raise InvalidArgument("talker max frames must be at least 1")
        seq.generator = seq.params.generator(self.device)
        if seq.params.temperature > 0:  # the predictor samples too, from its own stream of the request's seed
            seed = seq.params.seed + 1 if seq.params.seed else 0
            seq.predictor_generator = replace(PREDICTOR_SAMPLING, seed=seed).generator(self.device)

    def ready(self, seq: TalkerSeq) -> bool:
        if seq.done:
            return False
        ended = seq.text_ended  # read before taking in states: every state sent before the end is in the inbox
        self._ingest(seq)
        seq.text_done = ended
        if seq.cache is None:
            return seq.n_states >= len(seq.prompt_ids) + 1 or seq.text_done
        return self._trailing_known(seq)

    def free(self, seq: TalkerSeq) -> None:
        seq.cache = None
        seq.embeds.clear()
        seq.hidden.clear()

    @torch.no_grad()
    def step(self, seqs: list[TalkerSeq]) -> list[tuple[TalkerSeq, TalkerStep]]:
        return [(seq, self._step(seq)) for seq in seqs]

    # -- one request -------------------------------------------------------------------------------

    def _ingest(self, seq: TalkerSeq) -> None:
        while seq.inbox:
            embeds, hidden = seq.inbox.popleft()
            seq.embeds.append(embeds.to(self.device, self.dtype))
            seq.hidden.append(hidden.to(self.device, self.dtype))
            seq.n_states += len(embeds)

    def _trailing_known(self, seq: TalkerSeq) -> bool:
        # Frame t adds the text of position L + 1 + t (or tts_eos / tts_pad once the text has run out).
        return seq.text_done or seq.n_states > len(seq.prompt_ids) + 1 + len(seq.frames)

    def _step(self, seq: TalkerSeq) -> TalkerStep:
        if seq.cache is None:
            if seq.n_states < len(seq.prompt_ids) + 1:  # the thinker ended before its first text token
                seq.done = True
                return TalkerStep([], finished=True)
            self._prefill(seq)
        else:
            self._decode(seq)
        return TalkerStep(self._vocode(seq), finished=seq.done)

    def _states(self, seq: TalkerSeq) -> tuple[torch.Tensor, torch.Tensor]:
        if len(seq.embeds) > 1:
            seq.embeds[:] = [torch.cat(seq.embeds)]
            seq.hidden[:] = [torch.cat(seq.hidden)]
        return seq.embeds[0], seq.hidden[0]

    def _prefill(self, seq: TalkerSeq) -> None:
        t0 = time.perf_counter()
        tk, raw = self.talker, self.spec.raw
        ids = seq.prompt_ids.to(self.device)
        n = len(ids)
        embeds, hidden = self._states(seq)
        # User turns only, multimodal positions from the accept layer, text from the input embedding.
        positions = torch.arange(n, device=self.device)
        starts = torch.where(ids == raw["im_start_token_id"], positions, torch.full_like(positions, -1))
        role = ids[(torch.cummax(starts, 0).values.clamp_min(0) + 1).clamp_max(n - 1)]
        user = role == raw["user_token_id"]
        mm = torch.isin(ids, self.mm_ids.to(self.device))
        projected = torch.empty(n, tk.config.text_config.hidden_size, device=self.device, dtype=self.dtype)
        if mm.any():
            projected[mm] = tk.hidden_projection(hidden[:n][mm])
        projected[~mm] = tk.text_projection(embeds[:n][~mm])
        user_embeds, user_ids = projected[user], ids[user]
        # Assistant prefix: <|im_start|> assistant \n, tts_pad x4, tts_bos, first text token, each summed with
        # the codec stream zeros x3, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos.
        a = int(torch.nonzero((ids[:-1] == raw["im_start_token_id"]) & (ids[1:] == raw["assistant_token_id"]))[-1])
        seq.tts = tk.text_projection(seq.tts_embeds.to(self.device, self.dtype)[None])[0]
        bos, _, pad = seq.tts
        assistant = tk.text_projection(embeds[a:n + 1][None])[0]
        text = torch.cat([assistant[:3], pad.expand(4, -1), bos[None], assistant[3:4]])
        c = self.codec
        codec_ids = torch.tensor([c["codec_nothink_id"], c["codec_think_bos_id"], c["codec_think_eos_id"], seq.speaker_id,
                                  c["codec_pad_id"], c["codec_bos_id"]], device=self.device)
        codec = torch.cat([torch.zeros(3, text.shape[1], device=self.device, dtype=self.dtype), tk.get_input_embeddings()(codec_ids)])
        inputs = torch.cat([user_embeds, text + codec])[None]
        talker_ids = torch.cat([user_ids, torch.full((9,), self.tts_pad_id, device=self.device)])
        pos, seq.rope_delta = mrope_positions(talker_ids.cpu().numpy(), seq.layout, self.rope_tokens)
        seq.cache = DynamicCache(config=tk.model.config)
        self._forward(seq, inputs, torch.from_numpy(pos)[:, None].to(self.device))
        seq.seconds["talker"] += time.perf_counter() - t0

    def _forward(self, seq: TalkerSeq, inputs: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Runs the talker on `inputs` [1, n, D] and samples the next first-codebook code."""
        seq.n_cached += inputs.shape[1]
        out = self.talker.model(
            inputs_embeds=inputs, position_ids=position_ids, past_key_values=seq.cache, use_cache=True,
            attention_mask=torch.ones(1, seq.n_cached, dtype=torch.long, device=self.device),
        )
        seq.past_hidden = out.last_hidden_state[:, -1:]
        logits = self.talker.codec_head(out.last_hidden_state)[0, -1]
        history = torch.tensor([f[0] for f in seq.frames], dtype=torch.long, device=self.device)
        suppress = self.suppress_with_eos if seq.params.ignore_eos else self.suppress
        code0 = sample_next(logits, seq.params, len(seq.frames), history, suppress, seq.generator)
        if code0 == self.codec_eos:
            seq.done, seq.eos, seq.code0 = True, True, None
        else:
            seq.code0 = code0

    def _trailing(self, seq: TalkerSeq, t: int) -> torch.Tensor:
        """The text added to frame t's input: thinker position L + 1 + t, then tts_eos, then tts_pad."""
        pos = len(seq.prompt_ids) + 1 + t
        if pos < seq.n_states:
            embeds, _ = self._states(seq)
            return self.talker.text_projection(embeds[pos:pos + 1][None])[0]
        return seq.tts[1:2] if pos == seq.n_states else seq.tts[2:3]

    def _decode(self, seq: TalkerSeq) -> None:
        t0 = time.perf_counter()
        frame, residual_embeds = self._predict(seq)
        t1 = time.perf_counter()
        seq.seconds["code_predictor"] += t1 - t0
        t = len(seq.frames)
        seq.frames.append(frame)
        seq.code0 = None
        if len(seq.frames) >= seq.params.max_tokens:
            seq.done = True
            return
        inputs = residual_embeds.sum(1, keepdim=True) + self._trailing(seq, t)
        p = seq.n_cached + seq.rope_delta
        self._forward(seq, inputs, torch.full((3, 1, 1), p, dtype=torch.float32, device=self.device))
        seq.seconds["talker"] += time.perf_counter() - t1

    def _predict(self, seq: TalkerSeq) -> tuple[list[int], torch.Tensor]:
        """Codebooks 1.. of the frame whose first code is `seq.code0`, and the frame's code embeddings [1, G, D]."""
        cp = self.talker.code_predictor
        first = self.talker.get_input_embeddings()(torch.tensor([[seq.code0]], device=self.device))
        cache = DynamicCache(config=cp.model.config)
        inputs = torch.cat([seq.past_hidden, first], dim=1)
        params = SamplingParams() if seq.predictor_generator is None else PREDICTOR_SAMPLING
        codes, embeds = [seq.code0], [first]
        for i in range(self.groups - 1):
            h = cp.model(inputs_embeds=inputs, past_key_values=cache, use_cache=True).last_hidden_state
            code = sample_next(cp.lm_head[i](h)[0, -1], params, 0, generator=seq.predictor_generator)
            codes.append(code)
            inputs = cp.model.codec_embedding[i](torch.tensor([[code]], device=self.device))
            embeds.append(inputs)
        return codes, torch.cat(embeds, dim=1)

    def _vocode(self, seq: TalkerSeq) -> list[SpeechChunk]:
        """Decodes the frames ready for audio: a small first chunk, then chunks with left context."""
        first, size, context = self.chunking
        chunks = []
        while seq.decoded < len(seq.frames):
            need = first if seq.decoded == 0 else size
            if len(seq.frames) - seq.decoded < need and not seq.done:
                break
            t0 = time.perf_counter()
            start, end = seq.decoded, min(len(seq.frames), seq.decoded + need)
            ctx = min(context, start)
            codes = torch.tensor(seq.frames[start - ctx:end], device=self.device).T[None]  # [1, G, frames]
            wav = self.code2wav(codes)[0, 0, ctx * self.samples_per_frame:]
            chunks.append(SpeechChunk(wav.float().cpu().numpy(), seq.frames[start:end], start))
            seq.decoded = end
            seq.seconds["code2wav"] += time.perf_counter() - t0
        return chunks
