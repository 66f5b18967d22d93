"""The native talker's frames (NativeTalker inherits `FrameSteps`): the first codes of a step's caught-up requests
drawn on the device, the code predictor launched for those frames straight after with their codes on their way to
host memory (`LaunchedFrames`), and those codes read back, in the step or, overlapped, in the next."""

from dataclasses import dataclass

import torch

from services.llm.host import mark, seconds_between, upload
from services.llm.sampling import CANDIDATES, sample_batch
from services.talker.seq import TalkerSeq


class FrameSteps:
    """NativeTalker's frame launches and reads (its attributes: predictor, states, seen, laps, ...)."""

    def _launch_frames(self, seqs: list[TalkerSeq], code0: torch.Tensor, hidden: torch.Tensor, since) -> "LaunchedFrames":
        """The frames whose first codes `code0` [B] the talker's step just sampled (on the device, not yet read)
        from its states `hidden` [B, D]: the code predictor queued straight after that step, its codes on their
        way to host memory. Each request that may go on keeps its frame's summed code embeddings for its next
        input (one whose frame turns out to be the end code is stopped when the codes are read)."""
        launched = mark(self.device)
        codes, embeds = self.predictor.run(seqs, code0, hidden)
        sums = embeds.sum(1)
        host = codes
        if codes.is_cuda:  # the next replay overwrites the predictor's outputs: copied out before it
            host = torch.empty(codes.shape, dtype=codes.dtype, pin_memory=True)
            host.copy_(codes, non_blocking=True)
        finished = mark(self.device)  # on a GPU the host no longer waits between the talker and the predictor
        for seq, summed in zip(seqs, sums):
            seq.frames_unread += 1
            if len(seq.frames) + seq.frames_unread < seq.params.max_tokens:
                seq.next_embed = summed
        self.laps.lap("queue")
        return LaunchedFrames(seqs, host, (since, launched, finished))

    def _read(self, frames: "LaunchedFrames") -> list[TalkerSeq]:
        """A launched frame step's codes, read (the step's one wait on the device): each request's frame kept,
        or its end; rows of requests ended or freed since are dropped. Returns the requests read."""
        since, launched, finished = frames.marks
        self.wait(finished)
        rows = frames.codes.tolist()
        n = len(frames.seqs)
        talker, predictor = seconds_between(since, launched) / n, seconds_between(launched, finished) / n
        read = []
        for seq, row in zip(frames.seqs, rows):
            seq.frames_unread -= 1
            if seq.done or self.states.get(id(seq)) is None:
                continue
            read.append(seq)
            seq.seconds["talker"] += talker
            seq.seconds["code_predictor"] += predictor
            if row[0] == self.codec_eos:
                seq.done, seq.eos, seq.next_embed = True, True, None
                continue
            seq.frames.append(row)
            seq.mark("first_frame")
            if len(seq.frames) >= seq.params.max_tokens:
                seq.done = True
        return read

    def _sample_first(self, seqs: list[TalkerSeq], logits: torch.Tensor) -> torch.Tensor:
        """First codes [B] of the next frames of `seqs`, drawn on the device: the repetition penalty over the
        codes each request drew before (its row of `seen`, read or not), then `sample_batch` (suppressed ids,
        the end code banned below min_tokens, seeded draws); each drawn code marked seen."""
        slots = upload([self.states[id(s)].slot for s in seqs], self.device, torch.long)
        pens = [s.params.repetition_penalty for s in seqs]
        if any(p != 1.0 for p in pens):
            pen = upload(pens, self.device, torch.float32)[:, None]
            logits = logits.float()
            logits = torch.where(self.seen[slots], torch.where(logits < 0, logits * pen, logits / pen), logits)
        frames = [len(s.frames) + s.frames_unread for s in seqs]
        code0 = sample_batch(logits, [s.params for s in seqs], None, frames, [self.suppressed(s) for s in seqs],
                             counters=frames)
        self.seen[slots, code0] = self.drawn_mark
        return code0

    def _first_drawable(self, seqs: list[TalkerSeq]) -> bool:
        """Whether the captured step's draw gives every row of `seqs` the first code `_sample_first` gives it
        (graph_sampling): greedy or a top-k below CANDIDATES, no stop ids banned for a minimum length, and the
        mask of codes drawn still the one the graphs read (it is replaced when more requests start than it holds)."""
        return self.graph_sampling and self.draws_captured and self.seen is self.decode.seen and all(
            (s.params.temperature == 0 or 0 < s.params.top_k < CANDIDATES)
            and not (len(s.frames) + s.frames_unread < s.params.min_tokens and s.params.stop_token_ids) for s in seqs)


@dataclass(eq=False)
class LaunchedFrames:
    """A frame step launched: its requests in row order, their codes [B, G] (pinned host memory a copy lands in,
    on a GPU), and the step's timeline marks (talker start, predictor start, end)."""
    seqs: list
    codes: torch.Tensor
    marks: tuple
