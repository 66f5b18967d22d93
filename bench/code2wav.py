"""bench.stages' code2wav cells: code2wav alone, in each precision and with each of its faster variants, against
float32 on the same codes (`python -m bench.stages --stages code2wav --code2wav-dtypes ...`)."""

import contextlib
import math

import torch

from bench.workloads import FRAMES_PER_SECOND
from services.runtime.config import MeshConfig
from services.runtime.protoconv import DTYPES


def code2wav_cells(cfg: MeshConfig, device: str, args):
    """code2wav alone in float32 and in each of --code2wav-dtypes (the same seeded weights, rounded): chunks of
    each streaming shape of the config's plan (frames with their left context) for each of --batches on the
    same random codes, timed per call (replayed from a CUDA graph on a GPU, as the talker runs it), and the
    samples after the chunk's left context (what the talker keeps) held to float32's: relative L2 and SNR in dB. What talker.code2wav_dtype is chosen by; a precision
    named with "+fuse" (bfloat16+fuse) runs with its activations fused, as talker.code2wav_fuse runs it, with
    "+native" its decoder run as talker.code2wav_native runs it (services/talker/code2wav.py: from the first row
    the kept samples need), and with
    "+tune" its graphs captured with cuDNN's convolution algorithms chosen by timing (no difference on an H200:
    bench/results/code2wav-1xh200-tune-6bc2f0d.json; the talker does not)."""
    from bench.stages import timed
    from services.llm.graphs import CapturedGraphs
    from services.model.load import load_component, load_config as model_config

    from services.talker.code2wav import NativeCode2Wav, fuse_activations_
    from services.talker.chunks import chunk_plan

    dev, tc = torch.device(device), cfg.talker
    new_frames = dict(chunk_plan(tc.first_chunk_frames, tc.chunk_frames, tc.left_context_frames, tc.chunk_growth))
    dtypes = ["float32"] + [d for d in args.code2wav_dtypes.split(",") if d and d != "float32"]

    def model_for(name: str):
        dtype, *mods = name.split("+")
        if dtype not in DTYPES or not set(mods) <= {"fuse", "native", "tune"} or {"fuse", "native"} <= set(mods):
            raise SystemExit(f"--code2wav-dtypes: unknown precision {name!r} (a precision, then +fuse or +native, +tune)")
        model = load_component("code2wav", cfg.model.dir, dev, DTYPES[dtype], cfg.model.load_format, cfg.model.seed)
        if "fuse" in mods:
            fuse_activations_(model)
        model.requires_grad_(False)
        return NativeCode2Wav(model) if "native" in mods else model

    models = {d: model_for(d) for d in dtypes}
    c2w_config = model_config(cfg.model.dir).code2wav_config
    groups, vocab = c2w_config.num_quantizers, c2w_config.codebook_size
    gen = torch.Generator().manual_seed(args.seed)
    for frames in sorted(new_frames):
        skip = (frames - new_frames[frames]) * int(next(iter(models.values())).total_upsample)  # the left context
        for b in args.batches:
            codes = torch.randint(0, vocab, (b, groups, frames), generator=gen).to(dev)
            ref = None
            for d in dtypes:
                model = models[d]
                start = model.first_row(skip) if isinstance(model, NativeCode2Wav) else 0
                run = lambda n, model=model, start=start: model(codes[:n], start) if start else model(codes[:n])  # noqa: E731
                with torch.no_grad():
                    if dev.type == "cuda":
                        with tuned_convolutions() if "+tune" in d else contextlib.nullcontext():
                            graph = CapturedGraphs([b], run, dev)
                        call = lambda graph=graph: graph.replay(b)  # noqa: E731
                    else:
                        call = lambda run=run: run(b)  # noqa: E731
                    # a graph's output is overwritten by its next replay; a native one starts at row `start`
                    wav = call()[..., skip - start * getattr(model, "row_samples", 0):].float().clone()
                    reps = max(1, args.decode_steps)
                    seconds, _ = timed(lambda: [call() for _ in range(reps)], dev)
                ref = wav if d == "float32" else ref
                err = ((wav - ref).norm() / ref.norm()).item()
                yield {"stage": "code2wav", "mode": d, "item": f"{frames} frames", "batch": b, "step_ms": 1000 * seconds / reps,
                       "audio_s_per_s": b * new_frames[frames] / FRAMES_PER_SECOND * reps / seconds, "rel_l2": err,
                       "snr_db": None if err == 0 else -20 * math.log10(err)}


@contextlib.contextmanager
def tuned_convolutions():
    """cuDNN chooses each convolution's algorithm by timing the candidates (torch.backends.cudnn.benchmark) inside
    this block, by its heuristics outside it: code2wav's "+tune" graphs are captured in it (their warm-up calls
    run the timing, their replays keep what was chosen)."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before
