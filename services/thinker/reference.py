"""The reference thinker engine: transformers' own thinker LM, one request per forward, a DynamicCache each.
The baseline faster engines are measured and tested against."""

import time

import torch
from transformers import DynamicCache

from services.llm.sampling import sample_next
from services.model.load import DTYPES, load_component
from services.model.spec import OmniSpec
from services.runtime.config import ModelConfig
from services.thinker.seq import ThinkerSeq, ThinkerStep, accept, validate


class ReferenceThinker:
    def __init__(self, model: ModelConfig, device: str = "cpu"):
        self.device, self.dtype = torch.device(device), DTYPES[model.dtype]
        self.lm = load_component("thinker", model.dir, device, self.dtype, model.load_format)
        spec = OmniSpec.load(model.dir)
        self.accept_layer = spec.talker["accept_hidden_layer"] if spec.has_talker else None
        self.vocab = spec.thinker["text_config"]["vocab_size"]
        self.hidden_size = spec.thinker_hidden

    @property
    def embed(self) -> torch.nn.Embedding:
        return self.lm.model.embed_tokens

    def add(self, seq: ThinkerSeq) -> None:
        validate(seq, self.vocab, self.hidden_size, self.accept_layer is not None)
        seq.generator = seq.params.generator(self.device)

    def ready(self, seq: ThinkerSeq) -> bool:
        return not seq.done

    def free(self, seq: ThinkerSeq) -> None:
        seq.cache = None

    @torch.no_grad()
    def step(self, seqs: list[ThinkerSeq]) -> list[tuple[ThinkerSeq, ThinkerStep]]:
        return [(seq, self._step(seq)) for seq in seqs]

    def _prefill_inputs(self, seq: ThinkerSeq):
        ids = seq.prompt_ids.to(self.device)
        n = len(ids)
        embeds = self.embed(ids)
        visual = torch.zeros(n, dtype=torch.bool, device=self.device)
        taps: list[list[torch.Tensor]] = []
        for span in sorted(seq.spans, key=lambda s: s.offset):
            rows = len(span.embeds)
            embeds[span.offset:span.offset + rows] = span.embeds.to(self.device, self.dtype)
            if span.deepstack:
                visual[span.offset:span.offset + rows] = True
                taps.append([d.to(self.device, self.dtype) for d in span.deepstack])
        deepstack = [torch.cat(level) for level in zip(*taps)] if taps else None
        pos = seq.positions if seq.positions is not None else torch.arange(n, dtype=torch.float32).expand(3, n)
        text_row = torch.arange(n, dtype=torch.float32)[None]
        position_ids = torch.cat([text_row, pos.float()])[:, None].to(self.device)  # [4, 1, L]
        return embeds[None], position_ids, deepstack, (visual[None] if taps else None)

    def _step(self, seq: ThinkerSeq) -> ThinkerStep:
        t0 = time.perf_counter()
        seq.started = seq.started or t0
        prefill = seq.cache is None
        if prefill:
            embeds, position_ids, deepstack, visual_mask = self._prefill_inputs(seq)
            seq.cache = DynamicCache(config=self.lm.model.config)
            start = 0
        else:
            start = seq.n_cached
            embeds = self.embed(torch.tensor([[seq.generated[-1]]], device=self.device))
            p = start + seq.rope_delta
            position_ids = torch.tensor([[start], [p], [p], [p]], dtype=torch.float32, device=self.device)[:, None]
            deepstack = visual_mask = None
        total = start + embeds.shape[1]
        out = self.lm.model(
            inputs_embeds=embeds, position_ids=position_ids, past_key_values=seq.cache, use_cache=True,
            attention_mask=torch.ones(1, total, dtype=torch.long, device=self.device),
            output_hidden_states=seq.return_states, deepstack_visual_embeds=deepstack, visual_pos_masks=visual_mask,
        )
        # All positions through lm_head, as generate() does, so float results match it
        logits = self.lm.lm_head(out.last_hidden_state)[0, -1]
        p = seq.params
        history = None
        if p.repetition_penalty != 1.0:
            history = torch.cat([seq.prompt_ids, torch.tensor(seq.generated, dtype=torch.long)]).to(self.device)
        token = sample_next(logits, p, len(seq.generated), history, None, seq.generator)
        result = ThinkerStep(token_ids=[], state_start=start)
        if seq.return_states:
            result.embeds = out.hidden_states[0][0]
            result.hidden = out.hidden_states[self.accept_layer][0]
        if prefill and seq.embed_token_ids:
            result.token_embeds = self.embed(torch.tensor(seq.embed_token_ids, device=self.device))
        accept(seq, result, token)
        elapsed = time.perf_counter() - t0
        if prefill:
            seq.prefill_seconds += elapsed
        else:
            seq.decode_seconds += elapsed
        return result
