"""bench.stages' talker cells: the talker engine alone, fed synthetic thinker states, its frames/s by batch and their
split into talker / code predictor / code2wav (`python -m bench.stages --stages talker`); and the feed itself,
which bench.profile_step's talker steps take too."""

import time

import torch

from bench.hostprof import host_state, host_use
from bench.workloads import FRAMES_PER_SECOND, ascii_prompt
from services.llm.host import laps_per_step
from services.llm.mrope import Layout
from services.llm.sampling import SamplingParams
from services.runtime import heap
from services.runtime.config import MeshConfig
from services.runtime.heap import Pauses

TALKER_SAMPLING = dict(temperature=0.9, top_p=1.0, top_k=50, repetition_penalty=1.05, ignore_eos=True)


class TalkerFeed:
    """Speech requests for a talker engine, fed synthetic thinker states: a chat prompt of `prompt_bytes`
    ASCII bytes, then every state up front (one text token per frame: the text stays ahead of the speech)."""

    def __init__(self, engine, cfg: MeshConfig, seed: int, prompt_bytes: int):
        from transformers import AutoTokenizer

        self.engine, self.spec = engine, engine.spec
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.dir)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": ascii_prompt(seed, prompt_bytes)}],
                                            add_generation_prompt=True, tokenize=True)
        self.ids = torch.tensor(ids if isinstance(ids, list) else ids["input_ids"], dtype=torch.long)
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, b: int, frames: int) -> list:
        from services.talker.seq import TalkerSeq

        hidden, seqs = self.spec.thinker_hidden, []
        for i in range(b):
            n = len(self.ids) + 1 + frames
            states = (torch.randn(n, hidden, generator=self.gen) / hidden**0.5, torch.randn(n, hidden, generator=self.gen))
            seq = TalkerSeq(f"bench-{i}", self.ids, Layout(), self.spec.voices[self.spec.default_voice],
                            SamplingParams(max_tokens=frames, seed=i + 1, **TALKER_SAMPLING),
                            tts_embeds=torch.randn(3, hidden, generator=self.gen) / hidden**0.5)
            seq.inbox.append(states)
            seq.text_ended = True
            self.engine.add(seq)
            seqs.append(seq)
        return seqs


def step_spread(walls: list[float]) -> dict:
    """Decode steps' wall times: their median, 90th percentile and slowest in ms, and which steps were slowest
    (a one-off cost inside the run, a compile or an allocation, shows as a few long steps; a slow host as a
    slow median)."""
    if not walls:
        return {}
    ordered = sorted(walls)
    slowest = sorted(range(len(walls)), key=walls.__getitem__)[-3:][::-1]
    return {"step_ms_p50": 1000 * ordered[len(ordered) // 2], "step_ms_p90": 1000 * ordered[(9 * len(ordered)) // 10],
            "step_ms_max": 1000 * ordered[-1], "slowest_steps": slowest}


def talker_cells(cfg: MeshConfig, device: str, args):
    from bench.stages import timed
    from services.talker.server import make_engine

    engine = make_engine(cfg, device)  # the config's engine: reference or native
    dev = engine.device
    feed = TalkerFeed(engine, cfg, args.seed, args.talker_prompt_bytes)
    batch = feed.batch

    def made(seqs) -> int:
        """Frames read, and launched with their codes not yet read (the native talker's, overlapped)."""
        return sum(len(s.frames) + s.frames_unread for s in seqs)

    def run(seqs) -> tuple[float, float, int, int, float]:
        """(prefill seconds: steps until every sequence has its first frame (its prompt computed: more than one
        step's tokens for many requests), drained; decode seconds: every later step back to back, the device
        drained once at the end; decode steps; frames those steps made). No drain between steps: it would undo
        what overlaps, a frame step's launch with the previous one's device work (talker.overlap) and code2wav
        on its own stream; seconds of those steps the host spent blocked on the device)."""
        def prompts():
            while (ready := [s for s in seqs if engine.ready(s)]) and not all(s.done or made([s]) for s in seqs):
                engine.step(ready)

        prefill_s, _ = timed(prompts, dev)
        before, steps = made(seqs), 0
        walls.clear()

        def decode():
            nonlocal steps
            state, cpu_waited = host_state(), engine.laps.cpu_waited
            t = time.perf_counter()
            while ready := [s for s in seqs if engine.ready(s)]:
                engine.step(ready)
                steps += 1
                walls.append(-t + (t := time.perf_counter()))
            # the host thread's CPU ms a step outside its waits, involuntary switches a step, hypervisor steal
            run_stats.update(host_use(state, host_state(), engine.laps.cpu_waited - cpu_waited, steps))

        waited, laps = engine.waited_s, dict(engine.laps.seconds)
        with Pauses() as pauses:
            decode_s, _ = timed(decode, dev)
        run_stats.update(gc_passes=pauses.count, gc_ms=pauses.total_ms, gc_max_ms=pauses.max_ms,
                         # the host's ms a step by phase ("wait": blocked on the device)
                         host_split_ms=laps_per_step(laps, engine.laps.seconds, steps))
        return prefill_s, decode_s, steps, sum(len(s.frames) for s in seqs) - before, engine.waited_s - waited

    walls: list[float] = []  # each decode step's wall seconds, host side (the last run's)
    run_stats: dict = {}  # the last run's decode steps: the collector's passes, the host's phases
    stream = getattr(engine, "vocode_stream", None)

    def use(mode: str) -> None:
        """The native engine switched to `mode` (both switches are read per step)."""
        if mode == "config":
            return
        if not hasattr(engine, "overlap"):
            raise SystemExit(f"--talker-modes {mode}: the {cfg.talker.engine} talker has no such switches")
        base, inline = mode.removesuffix("-c2w-inline"), mode.endswith("-c2w-inline")
        base, graph_draw = base.removesuffix("-graph-draw"), base.endswith("-graph-draw")
        if base not in ("plain", "overlap"):
            raise SystemExit(f"unknown talker mode {mode!r}")
        if graph_draw and not getattr(engine, "draws_captured", False):
            raise SystemExit(f"--talker-modes {mode}: the talker's graphs hold no draw (--set talker.graph_sampling=true)")
        engine.overlap = base == "overlap"
        engine.vocode_stream = None if inline else stream
        engine.graph_sampling = graph_draw

    warm = batch(1, 3)
    run(warm)
    for s in warm:
        engine.free(s)
    if args.gc_freeze:
        heap.freeze()  # as a stage server does before it serves
    for b, mode in [(b, m) for b in args.batches for m in args.talker_modes.split(",")]:
        use(mode)
        seqs = batch(b, args.frames)
        overlapped = getattr(engine, "overlapped", 0)
        prefill_s, decode_s, steps, decoded, waited = run(seqs)
        overlapped = getattr(engine, "overlapped", 0) - overlapped
        wait_ms = 1000 * waited / max(steps, 1)
        frames = sum(len(s.frames) for s in seqs)
        split = {part: sum(s.seconds[part] for s in seqs) for part in ("talker", "code_predictor", "code2wav")}
        for s in seqs:
            engine.free(s)
        # frames_per_s: the frames the decode steps made, over their time (the prompts' steps and first frames apart)
        yield {"stage": "talker", "mode": "decode" if mode == "config" else f"decode {mode}", "batch": b, "frames": frames,
               "decode_frames": decoded, "seconds": decode_s,
               "frames_per_s": decoded / decode_s, "audio_s_per_s": decoded / FRAMES_PER_SECOND / decode_s,
               "prefill_ms": 1000 * prefill_s, "steps": steps, "overlapped_steps": overlapped, "step_ms": 1000 * decode_s / max(steps, 1),
               # of a step, the host's time waiting on the device (a frame step's codes, code2wav's audio, a plan's
               # copy) and the rest (on a GPU: the host's own work, which the device waits for where the wait is ~0)
               **({"wait_ms_per_step": wait_ms, "host_ms_per_step": 1000 * decode_s / max(steps, 1) - wait_ms}
                  if dev.type == "cuda" else {}),
               **step_spread(walls), **run_stats,
               **{f"{k}_s": v for k, v in split.items()},
               **{f"{k}_share": v / max(sum(split.values()), 1e-12) for k, v in split.items()}}
