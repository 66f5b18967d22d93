"""bench.stages' speech cells: the talker alone, fed synthetic thinker states (TalkerFeed, bench.profile_step's too),
frames/s by batch split into talker / code predictor / code2wav; code2wav alone by precision against float32."""

import math
import time

import torch

from bench.timing import host_split, laps, timed
from bench.workloads import FRAMES_PER_SECOND, ascii_prompt
from services.llm.sampling import SamplingParams
from services.model.load import DTYPES
from services.model.positions import Layout
from services.model.spec import OmniSpec
from services.runtime import heap
from services.runtime.config import MeshConfig

TALKER_SAMPLING = dict(temperature=0.9, top_p=1.0, top_k=50, repetition_penalty=1.05, ignore_eos=True)


class TalkerFeed:
    """Speech requests for a talker engine, fed synthetic thinker states: a chat prompt of `prompt_bytes`
    ASCII bytes, then every state up front (one text token per frame: the text stays ahead of the speech)."""

    def __init__(self, engine, cfg: MeshConfig, seed: int, prompt_bytes: int):
        from transformers import AutoTokenizer

        self.engine, self.spec = engine, OmniSpec.load(cfg.model.dir)
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


def talker_cells(cfg: MeshConfig, device: str, args):
    from services.talker.server import make_engine

    engine = make_engine(cfg, device)
    dev, feed = engine.device, TalkerFeed(engine, cfg, args.seed, args.talker_prompt_bytes)

    def ready(seqs) -> list:
        return [s for s in seqs if engine.ready(s)]

    def run(seqs) -> dict:
        """Steps until every sequence has its first frame, drained; then every later step back to back, drained once
        at the end (a drain between steps would undo what overlaps). The decode steps' figures."""
        def prompts():  # frames launched but not read yet count (an overlapped step's)
            while (now := ready(seqs)) and not all(s.done or s.frames or s.frames_unread for s in seqs):
                engine.step(now)

        prefill_s, _ = timed(prompts, dev)
        before, walls, waited, split = sum(len(s.frames) for s in seqs), [], engine.waited_s, laps(engine)

        def decode():
            t = time.perf_counter()
            while now := ready(seqs):
                engine.step(now)
                walls.append(-t + (t := time.perf_counter()))

        seconds, _ = timed(decode, dev)
        steps, decoded = max(len(walls), 1), sum(len(s.frames) for s in seqs) - before
        walls.sort()
        return {"decode_frames": decoded, "seconds": seconds, "frames_per_s": decoded / seconds,
                "audio_s_per_s": decoded / FRAMES_PER_SECOND / seconds, "prefill_ms": 1000 * prefill_s, "steps": steps,
                "step_ms": 1000 * seconds / steps, "wait_ms_per_step": 1000 * (engine.waited_s - waited) / steps,
                # a median hides a one-off stall (a compile, an allocation, the collector): the slowest step beside it
                "step_ms_p50": 1000 * walls[len(walls) // 2] if walls else None,
                "step_ms_max": 1000 * walls[-1] if walls else None, **host_split(engine, split, steps)}

    warm = feed.batch(1, 3)
    run(warm)
    for s in warm:
        engine.free(s)
    if args.gc_freeze:
        heap.freeze()  # as a stage server does before it serves
    for b in args.batches:
        seqs = feed.batch(b, args.frames)
        cell = run(seqs)
        split = {part: sum(s.seconds[part] for s in seqs) for part in ("talker", "code_predictor", "code2wav")}
        for s in seqs:
            engine.free(s)
        # frames_per_s: the frames the decode steps made, over their time (the prompts' steps and first frames apart)
        yield {"stage": "talker", "mode": "decode", "batch": b, "frames": sum(len(s.frames) for s in seqs), **cell,
               **{f"{k}_share": v / max(sum(split.values()), 1e-12) for k, v in split.items()}}


def code2wav_cells(cfg: MeshConfig, device: str, args):
    """code2wav alone in float32 and in each of --code2wav-dtypes (the same seeded weights, rounded), on the same
    random codes: chunks of each of --code2wav-frames new frames after --code2wav-context frames of left context,
    for each of --batches, timed per call (replayed from a CUDA graph on a GPU, as the talker runs it); the samples
    after the left context (what the talker keeps) held to float32's: relative L2 and SNR in dB. NAME+native runs
    the talker's own decoder (services/talker/code2wav.py: from the first row the kept samples need)."""
    from services.model.load import load_component, load_config as model_config
    from services.talker.code2wav import NativeCode2Wav

    dev = torch.device(device)
    dtypes = ["float32"] + [d for d in args.code2wav_dtypes.split(",") if d and d != "float32"]

    def model_for(name: str):
        dtype, *mods = name.split("+")
        if dtype not in DTYPES or not set(mods) <= {"native"}:
            raise SystemExit(f"--code2wav-dtypes: unknown precision {name!r} (a precision, then +native)")
        model = load_component("code2wav", cfg.model.dir, dev, DTYPES[dtype], cfg.model.load_format)
        model.requires_grad_(False)
        return NativeCode2Wav(model) if mods else model

    models = {d: model_for(d) for d in dtypes}
    c2w = model_config(cfg.model.dir).code2wav_config
    samples = int(models["float32"].total_upsample)
    gen = torch.Generator().manual_seed(args.seed)
    for new in args.code2wav_frames:
        frames, skip = new + args.code2wav_context, args.code2wav_context * samples
        for b in args.batches:
            codes = torch.randint(0, c2w.codebook_size, (b, c2w.num_quantizers, frames), generator=gen).to(dev)
            ref = None
            for d in dtypes:
                model = models[d]
                start = model.first_row(skip) if isinstance(model, NativeCode2Wav) else 0
                run = (lambda model=model, start=start: model(codes, start)) if start else (lambda model=model: model(codes))
                with torch.no_grad():
                    if dev.type == "cuda":
                        from bench.moe import capture

                        graph, out = capture(run), run()
                        call = lambda graph=graph: graph.replay()  # noqa: E731
                    else:
                        call, out = run, run()
                    # a native decoder starts at row `start`: its output begins that many rows' samples later
                    wav = out[..., skip - start * getattr(model, "row_samples", 0):].float().clone()
                    reps = max(1, args.decode_steps)
                    seconds, _ = timed(lambda: [call() for _ in range(reps)], dev)
                ref = wav if d == "float32" else ref
                err = ((wav - ref).norm() / ref.norm()).item()
                yield {"stage": "code2wav", "mode": d, "item": f"{frames} frames", "batch": b, "step_ms": 1000 * seconds / reps,
                       "audio_s_per_s": b * new / FRAMES_PER_SECOND * reps / seconds, "rel_l2": err,
                       "snr_db": None if err == 0 else -20 * math.log10(err)}
