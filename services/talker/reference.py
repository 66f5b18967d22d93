"""The reference talker engine: transformers' own talker, code predictor and code2wav, one request per forward.

It follows transformers' generate() step for step, except that it starts with the thinker's first states and
takes a text token per frame as they come, and decodes speech in chunks with left context."""

import time

import torch
from transformers import DynamicCache

from services.llm.sampling import SamplingParams, sample_next
from services.model.load import DTYPES, load_component
from services.runtime.config import ModelConfig, TalkerConfig
from services.talker.seq import PREDICTOR_SAMPLING, TalkerSeq, TalkerStep
from services.talker.speech import SpeechEngine


class ReferenceTalker(SpeechEngine):
    def __init__(self, model: ModelConfig, cfg: TalkerConfig, device: str = "cpu"):
        dtype = DTYPES[model.dtype]
        talker = load_component("talker", model.dir, device, dtype, model.load_format)
        super().__init__(talker, model, cfg.chunks, device, dtype, native_code2wav=False)

    def add(self, seq: TalkerSeq) -> None:
        super().add(seq)
        seq.generator = seq.params.generator(self.device)
        if seq.predictor_params is not None:
            seq.predictor_generator = seq.predictor_params.generator(self.device)

    def started(self, seq: TalkerSeq) -> bool:
        return seq.cache is not None

    def free(self, seq: TalkerSeq) -> None:
        super().free(seq)
        seq.cache = None

    @torch.no_grad()
    def step(self, seqs: list[TalkerSeq]) -> list[tuple[TalkerSeq, TalkerStep]]:
        return [(seq, self._step(seq)) for seq in seqs]

    def _step(self, seq: TalkerSeq) -> TalkerStep:
        if seq.cache is None:
            if seq.n_states < len(seq.prompt_ids) + 1:  # the thinker ended before its first text token
                seq.done = True
                return TalkerStep([], finished=True)
            t0 = time.perf_counter()
            seq.mark("admitted")
            inputs, positions = self.prompt_inputs(seq)
            seq.cache = DynamicCache(config=self.talker.model.config)
            self._forward(seq, inputs[None], positions[:, None])
            seq.seconds["talker"] += time.perf_counter() - t0
        else:
            self._decode(seq)
        return TalkerStep(self.vocode([seq]).get(id(seq), (seq, []))[1], finished=seq.done)

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
        code0 = sample_next(logits, seq.params, len(seq.frames), history, self.suppressed(seq), seq.generator)
        if code0 == self.codec_eos:
            seq.done, seq.eos, seq.code0 = True, True, None
        else:
            seq.code0 = code0

    def _decode(self, seq: TalkerSeq) -> None:
        t0 = time.perf_counter()
        frame, residual_embeds = self._predict(seq)
        t1 = time.perf_counter()
        seq.seconds["code_predictor"] += t1 - t0
        t = len(seq.frames)
        seq.frames.append(frame)
        seq.mark("first_frame")
        seq.code0 = None
        if len(seq.frames) >= seq.params.max_tokens:
            seq.done = True
            return
        inputs = residual_embeds.sum(1, keepdim=True) + self.trailing(seq, t)
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
