"""What every talker engine shares: a request's prompt built from the thinker's states, the text each frame adds,
and chunked code2wav. Engines differ in how they run the talker and code predictor."""

import time
from collections import deque
from dataclasses import replace

import numpy as np
import torch

from services.llm import graphs
from services.llm.host import Laps, mark, reached, seconds_between, upload, upload_into, wait_for
from services.model.load import load_component
from services.model.positions import mrope_positions, tokens_from_config
from services.model.spec import OmniSpec
from services.runtime.config import ModelConfig
from services.runtime.errors import InvalidArgument
from services.talker.chunks import LEFT_CONTEXT, Vocoding, chunk_plan, decoded_tail
from services.talker.code2wav import NativeCode2Wav
from services.talker.seq import PREDICTOR_SAMPLING, SpeechChunk, TalkerSeq


class SpeechEngine:
    """The engine protocol's request handling, shared; subclasses implement `step`."""

    def __init__(self, talker, model: ModelConfig, chunks: list[int], device, dtype, native_code2wav: bool):
        """`native_code2wav`: our decoder (code2wav.py), else transformers'."""
        self.device, self.dtype, self.talker = torch.device(device), dtype, talker
        self.code2wav = load_component("code2wav", model.dir, device, dtype, model.load_format).requires_grad_(False)
        self.tail = decoded_tail(self.code2wav)  # F frames decode to F * samples_per_frame - tail samples
        if native_code2wav:
            self.code2wav = NativeCode2Wav(self.code2wav)
        self.spec = spec = OmniSpec.load(model.dir)
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
        self.plan = chunk_plan(chunks, LEFT_CONTEXT)  # (frames code2wav sees, new frames) until they repeat
        self.samples_per_frame = int(self.code2wav.total_upsample)
        self.sample_rate = 24000
        # frames (context included) -> (codes buffer, graphs, the decoder row they start at)
        self.c2w_graphs: dict[int, tuple[torch.Tensor, object, int]] = {}
        # Off the frame loop's stream: the device runs code2wav beside the next frames, the host reads it when done
        self.vocode_stream: torch.cuda.Stream | None = None
        self.vocoding: deque[Vocoding] = deque()  # in launch order, the order they complete in
        self.live: set[int] = set()  # chunks of freed requests are dropped
        self.waited_s = 0.0
        if not hasattr(self, "laps"):
            self.laps = Laps()

    def chunk_shapes(self) -> list[int]:
        """The frame counts (left context included) code2wav sees for every chunk but a request's last."""
        return sorted({frames for frames, _ in self.plan})

    def capture_code2wav(self, max_batch: int) -> None:
        """code2wav per chunk shape as CUDA graphs (eagerly the host lags the device); rows are independent."""
        sizes = graphs.ladder(max_batch)
        for frames in self.chunk_shapes():
            codes = torch.zeros(sizes[-1], self.groups, frames, dtype=torch.long, device=self.device)
            # The least left context a chunk of this length has in the plan
            start = min(self._start(self._skip(frames - new)) for f, new in self.plan if f == frames)
            ladder = graphs.Ladder(sizes, lambda b, codes=codes, start=start: self._waveforms(codes[:b], start), self.device)
            self.c2w_graphs[frames] = codes, ladder, start

    def _skip(self, context: int) -> int:
        """Samples a chunk drops: its context's but the last `tail`, which the chunk before could not decode."""
        return context * self.samples_per_frame - self.tail if context else 0

    def _start(self, skip: int) -> int:
        """The first decoder row the waveform from sample `skip` needs (transformers' module starts at row 0)."""
        return self.code2wav.first_row(skip) if isinstance(self.code2wav, NativeCode2Wav) else 0

    def _waveforms(self, codes: torch.Tensor, start: int) -> torch.Tensor:
        return self.code2wav(codes, start) if start else self.code2wav(codes)

    def _code2wav(self, codes: list, skip: int = 0) -> torch.Tensor:
        """Waveforms [B, 1, samples] of code rows [B][frames][groups] of one length from sample `skip` on, from a graph
        where one fits. A shorter last chunk takes a longer graph, zero codes after its frames: the samples it keeps
        read no later frame (decoded_tail), and eagerly many last chunks would stall the frame loop."""
        n, frames, start = len(codes), len(codes[0]), self._start(skip)
        fits = [f for f, (_, ladder, at) in self.c2w_graphs.items() if f >= frames and n <= ladder.max_batch and at <= start]
        if not fits:
            wav = self._waveforms(upload(codes, self.device, torch.long).transpose(1, 2), start)
        else:
            buf, ladder, start = self.c2w_graphs[min(fits)]
            b = ladder.size_for(n)
            rows = np.asarray(codes, dtype=np.int64).transpose(0, 2, 1)  # numpy: torch.tensor() is element by element
            if frames < buf.shape[2]:
                rows = np.pad(rows, ((0, 0), (0, 0), (0, buf.shape[2] - frames)))
            upload_into(buf[:n], rows)
            if b > n:
                buf[n:b].zero_()
            wav = ladder.replay(b)[:n]
        first = start * self.code2wav.row_samples if start else 0  # where `wav` starts
        return wav[..., skip - first:frames * self.samples_per_frame - self.tail - first]

    def add(self, seq: TalkerSeq) -> None:
        if seq.params.max_tokens < 1:
            raise InvalidArgument("talker max frames must be at least 1")
        self.live.add(id(seq))
        if seq.params.temperature > 0:  # the predictor samples from a seed of its own
            seed = seq.params.seed + 1 if seq.params.seed else 0
            seq.predictor_params = replace(PREDICTOR_SAMPLING, seed=seed)

    def ready(self, seq: TalkerSeq) -> bool:
        if seq.done:
            return False
        ended = seq.text_ended  # read first: every state sent before the end is then in the inbox
        self._ingest(seq)
        seq.text_done = ended
        if not self.started(seq):
            if seq.n_states >= len(seq.prompt_ids) + 1 or seq.text_done:
                seq.mark("ready")
                return True
            return False
        return self.runnable(seq) or seq.vocoding > 0  # audio on its way: a step hands it out

    def started(self, seq: TalkerSeq) -> bool:
        raise NotImplementedError

    def wait(self, m) -> None:
        t, c = time.perf_counter(), time.thread_time()
        wait_for(m)
        t = time.perf_counter() - t
        self.waited_s += t
        self.laps.waited(t, time.thread_time() - c)

    def runnable(self, seq: TalkerSeq) -> bool:
        """A started request can step: the text its next frame adds is known."""
        return self._trailing_known(seq)

    def free(self, seq: TalkerSeq) -> None:
        seq.embeds.clear()
        seq.hidden.clear()
        self.live.discard(id(seq))

    def suppressed(self, seq: TalkerSeq) -> torch.Tensor:
        return self.suppress_with_eos if seq.params.ignore_eos else self.suppress

    def _ingest(self, seq: TalkerSeq) -> None:
        while seq.inbox:
            embeds, hidden = seq.inbox.popleft()
            seq.embeds.append(self._to_device(embeds))
            seq.hidden.append(self._to_device(hidden))
            seq.n_states += len(embeds)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A state on this engine's device, from the host through pinned memory (host.py)."""
        if t.device == self.device or self.device.type != "cuda":
            return t.to(self.device, self.dtype)
        return upload(t, self.device, self.dtype)

    def _trailing_known(self, seq: TalkerSeq) -> bool:
        # Frame t adds the text of position L + 1 + t (or tts_eos / tts_pad once the text has run out)
        return seq.text_done or seq.n_states > len(seq.prompt_ids) + 1 + len(seq.frames)

    def _states(self, seq: TalkerSeq) -> tuple[torch.Tensor, torch.Tensor]:
        if len(seq.embeds) > 1:
            seq.embeds[:] = [torch.cat(seq.embeds)]
            seq.hidden[:] = [torch.cat(seq.hidden)]
        return seq.embeds[0], seq.hidden[0]

    def prompt_inputs(self, seq: TalkerSeq) -> tuple[torch.Tensor, torch.Tensor]:
        """The talker's prompt [L, D] and its M-RoPE positions [3, L] (sets seq.tts and seq.rope_delta)."""
        tk, raw = self.talker, self.spec.raw
        # The layout is worked out on the host, so nothing waits for a frame step still running
        ids = seq.prompt_ids.cpu()
        n = len(ids)
        embeds, hidden = self._states(seq)
        # User turns only, multimodal positions from the accept layer, text from the input embedding
        positions = torch.arange(n)
        starts = torch.where(ids == raw["im_start_token_id"], positions, torch.full_like(positions, -1))
        role = ids[(torch.cummax(starts, 0).values.clamp_min(0) + 1).clamp_max(n - 1)]
        user = role == raw["user_token_id"]
        mm = torch.isin(ids, self.mm_ids)
        rows = upload(torch.cat([mm.nonzero()[:, 0], (~mm).nonzero()[:, 0], user.nonzero()[:, 0]]), self.device)
        mm_rows, text_rows, user_rows = rows.split([int(mm.sum()), n - int(mm.sum()), int(user.sum())])
        projected = torch.empty(n, tk.config.text_config.hidden_size, device=self.device, dtype=self.dtype)
        if len(mm_rows):
            projected[mm_rows] = tk.hidden_projection(hidden[mm_rows])
        projected[text_rows] = tk.text_projection(embeds[text_rows])
        user_embeds, user_ids = projected[user_rows], ids[user]
        # Assistant prefix: <|im_start|> assistant \n, tts_pad x4, tts_bos, first text token, each summed with
        # the codec stream zeros x3, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos
        a = int(torch.nonzero((ids[:-1] == raw["im_start_token_id"]) & (ids[1:] == raw["assistant_token_id"]))[-1])
        seq.tts = tk.text_projection(self._to_device(seq.tts_embeds)[None])[0]
        bos, _, pad = seq.tts
        assistant = tk.text_projection(embeds[a:n + 1][None])[0]
        text = torch.cat([assistant[:3], pad.expand(4, -1), bos[None], assistant[3:4]])
        c = self.codec
        codec_ids = upload([c["codec_nothink_id"], c["codec_think_bos_id"], c["codec_think_eos_id"], seq.speaker_id,
                            c["codec_pad_id"], c["codec_bos_id"]], self.device, torch.long)
        codec = torch.cat([torch.zeros(3, text.shape[1], device=self.device, dtype=self.dtype), tk.get_input_embeddings()(codec_ids)])
        talker_ids = torch.cat([user_ids, torch.full((9,), self.tts_pad_id)])
        # transformers' generate() gives its talker no use_audio_in_video: get_rope_index's counts under False
        pos, seq.rope_delta = mrope_positions(talker_ids.numpy(), seq.layout, self.rope_tokens, use_audio_in_video=False)
        return torch.cat([user_embeds, text + codec]), upload(torch.from_numpy(pos), self.device)

    def trailing(self, seq: TalkerSeq, t: int) -> torch.Tensor:
        """The text added to frame t's input [1, D]: thinker position L + 1 + t, then tts_eos, then tts_pad."""
        return self.trailing_rows([(seq, t)])

    def trailing_rows(self, frames: list[tuple[TalkerSeq, int]]) -> torch.Tensor:
        """`trailing` for many (request, frame) pairs [N, D], one text projection for all."""
        text, tts = [], []  # (row, thinker input embedding) / (row, projected tts row)
        for row, (seq, t) in enumerate(frames):
            pos = len(seq.prompt_ids) + 1 + t
            if pos < seq.n_states:
                text.append((row, self._states(seq)[0][pos]))
            else:
                tts.append((row, seq.tts[1] if pos == seq.n_states else seq.tts[2]))
        if not tts:
            return self.talker.text_projection(torch.stack([e for _, e in text])[None])[0]
        if not text:
            return torch.stack([e for _, e in tts])
        out = torch.empty(len(frames), frames[0][0].tts.shape[1], device=self.device, dtype=self.dtype)
        rows = upload([r for r, _ in text] + [r for r, _ in tts], self.device, torch.long)
        out[rows[:len(text)]] = self.talker.text_projection(torch.stack([e for _, e in text])[None])[0]
        out[rows[len(text):]] = torch.stack([e for _, e in tts])
        return out

    def _next_chunk(self, seq: TalkerSeq) -> tuple[int, int, int] | None:
        """(start, end, left context) of the next chunk ready for audio, or what is left once the request is done."""
        if seq.decoded >= len(seq.frames):
            return None
        start, need = 0, 0
        for _, need in self.plan:  # chunks are whole but the last: one starts where the plan says
            if start >= seq.decoded:
                break
            start += need
        need = need if start == seq.decoded else self.plan[-1][1]  # past the plan, its steady size
        if len(seq.frames) - seq.decoded < need and not seq.done:
            return None
        start = seq.decoded
        return start, min(len(seq.frames), start + need), min(LEFT_CONTEXT, start)

    def vocode(self, seqs: list[TalkerSeq], wait: bool = False) -> dict[int, tuple[TalkerSeq, list[SpeechChunk]]]:
        """Launches code2wav for every ready chunk, then hands out those on the host: {id(request): (request, chunks)}.
        Waits only for a finished request's audio or, with `wait`, the oldest launch."""
        while jobs := [(s, c) for s in seqs if (c := self._next_chunk(s)) is not None]:
            groups: dict[tuple[int, int], list] = {}
            for s, (start, end, ctx) in jobs:
                groups.setdefault((end - start, ctx), []).append((s, start, end, ctx))
            for group in groups.values():
                self.vocoding.append(self._launch(group))
        if self.vocoding and any(s.done and s.vocoding for s in seqs):
            self.wait(self.vocoding[-1].end)  # one stream: everything launched before it is complete too
        elif self.vocoding and wait:
            self.wait(self.vocoding[0].end)
        out: dict[int, tuple[TalkerSeq, list[SpeechChunk]]] = {}
        while self.vocoding and reached(self.vocoding[0].end):
            job = self.vocoding.popleft()
            seconds = seconds_between(job.begin, job.end)
            for (s, start, end), wav in zip(job.chunks, job.pcm.numpy()):
                s.vocoding -= 1
                if id(s) in self.live:
                    s.mark("first_audio")
                    s.seconds["code2wav"] += seconds / len(job.chunks)
                    out.setdefault(id(s), (s, []))[1].append(SpeechChunk(wav, s.frames[start:end], start))
        return out

    def _launch(self, group: list) -> Vocoding:
        """code2wav for one group of chunks, on the side stream into pinned memory where there is one."""
        codes = [s.frames[start - ctx:end] for s, start, end, ctx in group]
        skip = self._skip(group[0][3])
        for s, _, end, _ in group:
            s.decoded = end
            s.vocoding += 1
        chunks = [(s, start, end) for s, start, end, _ in group]
        if self.vocode_stream is None:
            begin = time.perf_counter()
            pcm = self._code2wav(codes, skip)[:, 0].float().cpu()
            return Vocoding(chunks, pcm, begin, time.perf_counter())
        with torch.cuda.stream(self.vocode_stream):
            begin = mark(self.device)
            wavs = self._code2wav(codes, skip)[:, 0].float()
            pcm = torch.empty(wavs.shape, dtype=torch.float32, pin_memory=True)
            pcm.copy_(wavs, non_blocking=True)  # wavs' memory is this stream's: not reused before the copy runs
            return Vocoding(chunks, pcm, begin, mark(self.device))
