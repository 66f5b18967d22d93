"""Stage benchmarks: the config's engines in this process, without gRPC (`--set section.key=value` for an A/B).

    python -m bench.stages --config configs/bench-1xh200-mesh.yaml --stages thinker --out bench/results/NAME.json

thinker: prefill and decode tok/s by batch and prompt length, step time and the host's ms a step by phase (the
engine's laps); hf-thinker: the same from transformers' batched generate(); talker: frames/s by batch, fed
synthetic thinker states; code2wav: alone, by precision (bench/talker.py); encoder: items/s for an image and a
clip; preprocess: the same items decoded on the CPU. Each stage runs on its first replica's device or --device.
"""

import argparse
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench import results
from bench.talker import code2wav_cells, talker_cells
from bench.timing import host_split, laps, timed
from bench.workloads import clip_wav, image_png, video_mp4, video_size
from services.llm.sampling import SamplingParams
from services.model.load import DTYPES
from services.model.spec import OmniSpec
from services.runtime import heap
from services.runtime.config import Limits, MeshConfig, load_config, read_overridden

THINKER_SAMPLING = dict(temperature=0.7, top_p=0.8, top_k=20, ignore_eos=True)


def random_prompts(cfg: MeshConfig, seed: int):
    """(request index, length) -> that many random token ids of the thinker's vocabulary, the same for a seed."""
    vocab = OmniSpec.load(cfg.model.dir).thinker["text_config"]["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    return lambda i, length: torch.randint(0, vocab, (length,), generator=gen)


def thinker_cells(cfg: MeshConfig, device: str, args):
    from services.thinker.seq import ThinkerSeq
    from services.thinker.server import make_engine

    engine = make_engine(cfg, device)
    dev, steps, prompt, name = engine.device, args.decode_steps, random_prompts(cfg, args.seed), type(engine).__name__

    def batch(b: int, length: int, max_tokens: int) -> list:
        seqs = [ThinkerSeq(f"bench-{i}", prompt(i, length), SamplingParams(max_tokens=max_tokens, seed=i + 1, **THINKER_SAMPLING))
                for i in range(b)]
        for s in seqs:
            engine.add(s)
        return seqs

    def prefill(seqs):  # as many steps as the engine's token budget needs
        while any(not s.generated for s in seqs):
            engine.step(seqs)

    warm = batch(1, 16, 3)
    for _ in range(3):
        engine.step(warm)
    for s in warm:  # an engine keeps stepping a sequence until it is freed (the server frees it when it stops)
        engine.free(s)
    if args.gc_freeze:
        heap.freeze()  # as a stage server does before it serves
    for length in args.prompt_lens:
        for b in args.batches:
            cold = batch(b, length, 1)  # the same shapes once untimed first: a new token count compiles its kernels
            prefill(cold)
            for s in cold:
                engine.free(s)
            # Chunked prefill: the first requests admitted decode while later ones prefill, at most one token a step;
            # `length` tokens more than the cell's steps keep every one of them going through the timed steps.
            seqs = batch(b, length, length + steps + 2)
            prefill_s, _ = timed(lambda: prefill(seqs), dev)
            before = laps(engine)
            # Steps back to back, the device drained once before and once after: an engine that overlaps a step's
            # host work with the previous step's device work shows it.
            seconds, _ = timed(lambda: [engine.step(seqs) for _ in range(steps)], dev)
            split = host_split(engine, before, steps)
            for s in seqs:
                engine.free(s)
            yield {"stage": "thinker", "engine": name, "mode": "prefill", "batch": b, "prompt_len": length,
                   "seconds": prefill_s, "tok_per_s": b * length / prefill_s, "step_ms": 1000 * prefill_s}
            yield {"stage": "thinker", "engine": name, "mode": "decode", "batch": b, "prompt_len": length, "steps": steps,
                   "seconds": seconds, "tok_per_s": b * steps / seconds, "step_ms": 1000 * seconds / steps, **split}


def hf_thinker_cells(cfg: MeshConfig, device: str, args):
    """transformers' own generate() on its thinker, batched (same prompt lengths, no padding needed): prefill
    is the time to the first token, decode the rest."""
    from transformers.models.qwen3_omni_moe import Qwen3OmniMoeThinkerForConditionalGeneration as Thinker

    from bench.hf_engine import StepTimes, on_device
    from services.model.load import component_seed, init_weights_, load_config as model_config

    dev = torch.device(device)
    model = on_device(Thinker, model_config(cfg.model.dir).thinker_config, dev, DTYPES[cfg.model.dtype])
    # The random load format's weights, as the native thinker's: an experts step costs what it chooses, and what
    # it chooses depends on the values, so transformers' own init would not measure the same model.
    init_weights_(model, component_seed(0, "thinker"), skip=("visual.", "audio_tower."), lm=True)
    prompt = random_prompts(cfg, args.seed)
    sampling = {k: v for k, v in THINKER_SAMPLING.items() if k != "ignore_eos"}
    for length in args.prompt_lens:
        for b in args.hf_batches:
            ids = torch.stack([prompt(i, length) for i in range(b)]).to(dev)
            times = StepTimes()
            torch.cuda.synchronize(dev) if dev.type == "cuda" else None
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.decode_steps + 1,
                               min_new_tokens=args.decode_steps + 1, streamer=times, do_sample=True, **sampling)
            first, last, steps = times.times[0], times.times[-1], len(times.times) - 1
            yield {"stage": "thinker", "engine": "transformers-generate", "mode": "prefill", "batch": b, "prompt_len": length,
                   "seconds": first - t0, "tok_per_s": b * length / (first - t0), "step_ms": 1000 * (first - t0)}
            yield {"stage": "thinker", "engine": "transformers-generate", "mode": "decode", "batch": b, "prompt_len": length,
                   "steps": steps, "seconds": last - first, "tok_per_s": b * steps / (last - first),
                   "step_ms": 1000 * (last - first) / steps}


def media_items(cfg: MeshConfig, args) -> dict:
    """kind -> (decode, data): the workloads' image and clip, decoded as the mesh's preprocess decodes them."""
    from services.preprocess.media import Preprocessor

    pre = Preprocessor(cfg.model.dir, Limits())
    return {"image": (pre.image, image_png(args.seed, args.image_size)),
            "audio": (pre.audio_file, clip_wav(args.seed, args.clip_seconds))}


def preprocess_cells(cfg: MeshConfig, device: str, args):
    from services.preprocess.media import Preprocessor

    items = media_items(cfg, args)
    pre, (w, h) = Preprocessor(cfg.model.dir, Limits()), video_size(args.video_size)
    # The v2t / v2s workloads' clip, its frames sampled at Qwen's 2 a second and its soundtrack kept
    items["video"] = (lambda data: pre.video_file(data, 2.0), video_mp4(args.seed, args.video_seconds, (w, h)))
    media_seconds = {"audio": args.clip_seconds, "video": args.video_seconds}
    for kind, (decode, data) in items.items():
        decode(data)
        seconds, _ = timed(lambda: [decode(data) for _ in range(args.preprocess_items)], torch.device("cpu"))
        cell = {"stage": "preprocess", "item": kind, "batch": 1, "items": args.preprocess_items,
                "items_per_s": args.preprocess_items / seconds, "step_ms": 1000 * seconds / args.preprocess_items}
        if kind in media_seconds:
            cell["ms_per_media_second"] = cell["step_ms"] / media_seconds[kind]
        yield cell


def encoder_cells(cfg: MeshConfig, device: str, args):
    from services.encoder.engine import EncodeJob, Encoder, Item

    engine = Encoder(cfg.model, device)  # as its server builds it
    for kind, (decode, data) in media_items(cfg, args).items():
        f = decode(data)
        item = Item(kind, torch.from_numpy(f.values), f.grid_thw)
        for b in args.encoder_batches:
            for _ in range(2):  # warm-up at this batch (compiled towers: its shapes; graphs: captured at the second)
                engine.step([EncodeJob([item]) for _ in range(b)])
            jobs = [EncodeJob([item]) for _ in range(b)]
            for j in jobs:
                engine.add(j)
            seconds, _ = timed(lambda: engine.step(jobs), engine.device)
            yield {"stage": "encoder", "item": kind, "batch": b, "tokens_per_item": f.num_tokens, "seconds": seconds,
                   "items_per_s": b / seconds, "step_ms": 1000 * seconds}


STAGES = {"thinker": (thinker_cells, "thinker"), "hf-thinker": (hf_thinker_cells, "thinker"), "talker": (talker_cells, "talker"),
          "encoder": (encoder_cells, "encoder"), "preprocess": (preprocess_cells, None), "code2wav": (code2wav_cells, "talker")}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="mesh config: model, engines, devices")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--out", required=True)
    p.add_argument("--stages", default="thinker,talker,encoder,preprocess", help=f"of {', '.join(STAGES)}")
    p.add_argument("--device", default="", help="run every stage here; default: each stage's first replica's device")
    p.add_argument("--batches", type=ints, default=[1, 8, 32, 64], help="thinker, talker and code2wav sequences per step")
    p.add_argument("--prompt-lens", type=ints, default=[512, 4096])
    p.add_argument("--hf-batches", type=ints, default=[1, 8, 32], help="batches of transformers' generate() (hf-thinker)")
    p.add_argument("--decode-steps", type=int, default=16, help="thinker decode steps a cell; code2wav calls a cell")
    p.add_argument("--frames", type=int, default=16, help="talker frames per sequence")
    p.add_argument("--talker-prompt-bytes", type=int, default=32)
    p.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True, help="freeze the heap, as a server does")
    p.add_argument("--encoder-batches", type=ints, default=[1, 8, 32])
    p.add_argument("--code2wav-dtypes", default="bfloat16",
                   help="code2wav: precisions held to float32 (float32 always runs); NAME+native: its native decoder")
    p.add_argument("--code2wav-frames", type=ints, default=[25], help="code2wav: new frames a chunk")
    p.add_argument("--code2wav-context", type=int, default=25, help="code2wav: frames of left context decoded with each")
    p.add_argument("--preprocess-items", type=int, default=8)
    p.add_argument("--image-size", type=int, default=512)
    p.add_argument("--clip-seconds", type=float, default=7.0)
    p.add_argument("--video-seconds", type=float, default=10.0, help="the preprocess stage's clip, as bench.run's")
    p.add_argument("--video-size", default="640x360", help="its frames, WIDTHxHEIGHT")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None, help="cells started after this are skipped")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = load_config(args.config, args.set)
    if cfg.model.dir and not (cfg.model.dir / "config.json").exists():
        raise SystemExit(f"no model folder at {cfg.model.dir}: python -m services.model.build full {cfg.model.path}")
    deadline = time.perf_counter() + args.max_minutes * 60 if args.max_minutes else None
    config = {"path": str(Path(args.config)), "content": read_overridden(args.config, args.set), "overrides": args.set}
    command = "python -m bench.stages " + shlex.join(sys.argv[1:] if argv is None else argv)
    result = results.new_result("stages", config, results.model_info(cfg.model.dir, cfg.model), {"command": command, "args": vars(args)})
    result["machine"] = results.machine()
    skipped = {"status": "skipped", "reason": "the run's time limit was reached"}
    for name in args.stages.split(","):
        cells, replica_stage = STAGES[name]
        device = args.device or (cfg.replicas(replica_stage)[0].device if replica_stage and cfg.replicas(replica_stage) else "cpu")
        if deadline is not None and time.perf_counter() > deadline:
            result["cells"].append({"stage": name, **skipped})
            continue
        stage_cells = cells(cfg, device, args)
        try:
            for cell in stage_cells:
                cell.update(device=device, status="ok")
                result["cells"].append(cell)
                results.write(result, args.out)
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in cell.items()), flush=True)
                if deadline is not None and time.perf_counter() > deadline:
                    result["cells"].append({"stage": name, **skipped})
                    break
        finally:
            stage_cells.close()  # drops the stage's engine before the next one loads
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    result["run"]["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    results.write(result, args.out)
    print(f"wrote {args.out} ({len(result['cells'])} cells)")
    return result


if __name__ == "__main__":
    main()
