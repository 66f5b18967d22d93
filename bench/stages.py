"""Stage micro-benchmarks: the engines in this process, without gRPC, so engine work can be measured alone.

    python -m bench.stages --config configs/bench-1xh200.yaml --out bench/results/NAME-stages.json

thinker: prefill and decode tok/s by batch (sequences per `step()` call) and prompt length, step time and
  host time per step (the engine's own count where it keeps one, else the part of a step not covered by
  device kernels); hf-thinker: the same cells from transformers' batched generate();
talker: frames/s by batch, fed synthetic thinker states, and its split into talker / code predictor / code2wav
  (bench/talker.py);
encoder: items/s for an image and a clip; preprocess: the same items decoded on the CPU; code2wav: alone, by
  precision and kernels (bench/code2wav.py).
Each stage runs on its config replica's device unless --device says otherwise.
"""

import argparse
import json
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import yaml

from bench import results
from bench.code2wav import code2wav_cells
from bench.hostprof import cpu_probe, host_state, host_use
from bench.records import percentile
from bench.talker import talker_cells
from bench.routing import chat_prompts, experts_touched
from bench.workloads import clip_wav, image_png
from services.llm.host import laps_per_step
from services.llm.sampling import SamplingParams
from services.runtime import heap
from services.runtime.config import Limits, MeshConfig, load_config
from services.runtime.protoconv import DTYPES

THINKER_SAMPLING = dict(temperature=0.7, top_p=0.8, top_k=20, ignore_eos=True)


def timed(fn, device: torch.device) -> tuple[float, object]:
    """Wall seconds of fn(), with the device drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, out


def device_ms(fn, device: torch.device) -> float | None:
    """Milliseconds of device kernels in one fn() (torch.profiler); None off CUDA or when profiling fails."""
    if device.type != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        return sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages()) / 1000
    except Exception:  # noqa: BLE001 - no CUPTI here: host time is then unknown
        return None


def graph_device_ms(engine, batch: int, replays: int = 4) -> float | None:
    """Milliseconds of the device a step for one replay of the decode graph that `batch` rows replay (draws inside
    it: graph_sampling), timed by CUDA events around `replays` replays from an idle device; None where the engine
    has no such graph. An even number of replays, as a graph that loads its own inputs flips its staging turn each
    time; the replays re-run the cell's last step on its own (freed after) rows. No torch.profiler: once it has run,
    CUPTI stays attached to the process, and in every cell after the first the graph's launch took 0.33-0.85 ms
    where the first cell's took 0.03-0.13 (bench/results/README.md, "Session 24")."""
    decode = getattr(engine, "decode", None)
    if decode is None or batch > decode.max_batch or not engine.graph_sampling or engine.device.type != "cuda":
        return None
    graphs, stream = decode.graphs, torch.cuda.current_stream(engine.device)
    b = graphs.size_for(batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(engine.device)
    start.record(stream)
    for _ in range(replays + replays % 2):
        graphs.replay(b)
    end.record(stream)
    end.synchronize()
    decode.forget()
    return start.elapsed_time(end) / (replays + replays % 2)


def alloc_retries(device: torch.device) -> int:
    """Times the CUDA caching allocator ran out, freed its cache and tried again (each one waits on the device)."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


def host_ms(step_ms: float, dev_ms: float | None, device: torch.device) -> float | None:
    """The part of a step the device spent waiting on the host: all of it on the CPU, unknown without a profile."""
    if device.type != "cuda":
        return step_ms
    return None if dev_ms is None else max(step_ms - dev_ms, 0.0)


def thinker_cells(cfg: MeshConfig, device: str, args):
    from services.thinker.reference import ThinkerSeq
    from services.thinker.server import make_engine

    engine = make_engine(cfg, device)  # the config's engine: reference or native
    dev, gen = engine.device, torch.Generator().manual_seed(args.seed)
    steps = args.decode_steps
    prompt = chat_prompts(cfg, args.seed) if args.prompts == "chat" else None

    def batch(b: int, length: int, max_tokens: int) -> list:
        seqs = [ThinkerSeq(f"bench-{i}", torch.randint(0, engine.vocab, (length,), generator=gen) if prompt is None
                           else prompt(i, length),
                           SamplingParams(max_tokens=max_tokens, seed=i + 1, **THINKER_SAMPLING)) for i in range(b)]
        for s in seqs:
            engine.add(s)
        return seqs

    warm = batch(1, 16, 3)
    for _ in range(3):
        engine.step(warm)
    for s in warm:  # an engine keeps stepping a sequence until it is freed (the server frees it when it stops)
        engine.free(s)
    if args.gc_freeze:
        heap.freeze()  # as a stage server does before it serves
    modes = args.thinker_modes.split(",")

    def use(mode: str) -> str:
        """The native engine switched to `mode`; the cell's mode name."""
        if mode == "config":
            return "decode"
        base, eager_draw = mode.removesuffix("-eager-draw"), mode.endswith("-eager-draw")
        if base not in ("plain", "overlap"):
            raise SystemExit(f"unknown thinker mode {mode!r}")
        if not hasattr(engine, "overlap"):
            raise SystemExit(f"--thinker-modes {mode}: the {cfg.thinker.engine} thinker has no such switch")
        engine.overlap, engine.graph_sampling = base == "overlap", not eager_draw
        return f"decode {mode}"

    for length in args.prompt_lens:
        for b in args.batches:
            # Long enough that no sequence finishes inside the cell: the first ones admitted decode while the
            # later ones prefill (chunked prefill), so they are that many tokens ahead when decode is timed.
            ahead = -(-b * length // cfg.thinker.max_batched_tokens) if cfg.thinker.engine == "native" else 0

            def prefill(seqs):  # one step for the reference engine; as many as the token budget needs for the native one
                while any(not s.generated for s in seqs):
                    engine.step(seqs)

            # The same shapes once untimed first: a step of a token count not seen yet compiles its kernels.
            cold = batch(b, length, 1)
            prefill(cold)
            for s in cold:
                engine.free(s)
            for i, mode in enumerate(modes):
                name = use(mode)
                seqs = batch(b, length, ahead + steps + 2)
                retries = alloc_retries(dev)
                prefill_s, _ = timed(lambda: prefill(seqs), dev)
                # Steps back to back, the device drained once before and once after: an engine that overlaps a
                # step's host work with the previous step's device work shows it (each call launches one step).
                hosts, launches, usage = [], [], {}
                idle_probe = statistics.median(cpu_probe() for _ in range(9))  # the CPU's speed before, device idle
                probes = []

                def decode():
                    before, waited = host_state(), engine.laps.cpu_waited if hasattr(engine, "laps") else 0.0
                    for i in range(steps):
                        engine.step(seqs)
                        hosts.append(getattr(engine, "last_host_s", None))
                        launches.append(getattr(engine, "last_launch_s", None))
                        if i % 8 == 7:  # and between steps, the next one queued (outside the engine's host time)
                            probes.append(cpu_probe())
                    if hasattr(engine, "laps"):  # the native engine's: its CPU time inside waits is known
                        usage.update(host_use(before, host_state(), engine.laps.cpu_waited - waited, steps))

                laps = dict(engine.laps.seconds) if hasattr(engine, "laps") else None  # the native engine's
                seconds, _ = timed(decode, dev)
                split = laps_per_step(laps, engine.laps.seconds, steps) if laps is not None else None
                # The device's time a step: from the decode graph's own replays where it draws the step's tokens
                # (no profiler), else from torch.profiler's kernels of one step.
                dev_ms = graph_device_ms(engine, b)
                dev_by = "graph" if dev_ms is not None else "profiler"
                dev_ms = dev_ms if dev_ms is not None else device_ms(lambda: engine.step(seqs), dev)
                step_ms = 1000 * seconds / steps
                touched = experts_touched(engine, seqs, b) if args.routing_stats else None
                for s in seqs:
                    engine.free(s)
                if i == 0:  # prefill is the same in every mode
                    yield {"stage": "thinker", "engine": cfg.thinker.engine, "mode": "prefill", "batch": b, "prompt_len": length,
                           "seconds": prefill_s, "tok_per_s": b * length / prefill_s, "step_ms": 1000 * prefill_s}
                # Host time: the engine's own count where it keeps one (its step minus its wait on the device).
                host = 1000 * statistics.median(hosts) if None not in hosts else host_ms(step_ms, dev_ms, dev)
                yield {"stage": "thinker", "engine": cfg.thinker.engine, "mode": name, "batch": b, "prompt_len": length,
                       "steps": steps, "seconds": seconds, "tok_per_s": b * steps / seconds, "step_ms": step_ms,
                       "device_ms_per_step": dev_ms, "device_ms_by": dev_by if dev.type == "cuda" else None,
                       "host_ms_per_step": host,
                       # of the host's time, the median step's in launching its graph (native engine)
                       "launch_ms_per_step": 1000 * statistics.median(launches) if None not in launches else None,
                       # the slowest tenth's bound of each, where the engine keeps them: a median hides how often a
                       # step is slow
                       **({"host_ms_p90": 1000 * percentile(hosts, 90)} if None not in hosts else {}),
                       **({"launch_ms_p90": 1000 * percentile(launches, 90)} if None not in launches else {}),
                       # the same piece of interpreter work's us before the cell (device idle) and between its steps
                       "cpu_probe_idle_us": idle_probe, "cpu_probe_us": statistics.median(probes) if probes else None,
                       # what of the step the device spends waiting on the host (host work not overlapped with it)
                       "exposed_host_ms": host_ms(step_ms, dev_ms, dev), "alloc_retries": alloc_retries(dev) - retries,
                       # the host's ms a step by phase (the native engine's laps; "wait": blocked on the device)
                       **({"host_split_ms": split} if split is not None else {}),
                       # its CPU ms a step outside waits, involuntary switches a step, hypervisor steal (host_use)
                       **usage,
                       **({"experts_touched": touched} if args.routing_stats else {})}


def hf_thinker_cells(cfg: MeshConfig, device: str, args):
    """transformers' own generate() on its thinker, batched (same prompt lengths, no padding needed): prefill
    is the time to the first token, decode the rest."""
    from transformers import logging
    from transformers.models.qwen3_omni_moe import Qwen3OmniMoeThinkerForConditionalGeneration

    from bench.hf_engine import StepTimes
    from services.model.load import component_seed, init_weights_, load_config

    logging.set_verbosity_error()
    dtype, dev = DTYPES[cfg.model.dtype], torch.device(device)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with dev:
            model = Qwen3OmniMoeThinkerForConditionalGeneration(load_config(cfg.model.dir).thinker_config).eval()
    finally:
        torch.set_default_dtype(default)
    # The random load format's weights, as the native thinker's: an experts step costs what it chooses, and what it
    # chooses depends on the values (bench/routing.py), so transformers' own init would not measure the same model.
    init_weights_(model, component_seed(cfg.model.seed, "thinker"), skip=("visual.", "audio_tower."), lm=True)

    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.text_config.vocab_size
    sampling = dict(do_sample=True, temperature=THINKER_SAMPLING["temperature"], top_p=THINKER_SAMPLING["top_p"],
                    top_k=THINKER_SAMPLING["top_k"])
    for length in args.prompt_lens:
        for b in args.hf_batches:
            ids = torch.randint(0, vocab, (b, length), generator=gen).to(dev)
            times = StepTimes()
            torch.cuda.synchronize(dev) if dev.type == "cuda" else None
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.decode_steps + 1,
                               min_new_tokens=args.decode_steps + 1, streamer=times, **sampling)
            first, last = times.times[0], times.times[-1]
            steps = len(times.times) - 1
            yield {"stage": "thinker", "engine": "transformers-generate", "mode": "prefill", "batch": b, "prompt_len": length,
                   "seconds": first - t0, "tok_per_s": b * length / (first - t0), "step_ms": 1000 * (first - t0)}
            yield {"stage": "thinker", "engine": "transformers-generate", "mode": "decode", "batch": b, "prompt_len": length,
                   "steps": steps, "seconds": last - first, "tok_per_s": b * steps / (last - first),
                   "step_ms": 1000 * (last - first) / steps}


def media_items(cfg: MeshConfig, args) -> dict:
    from services.preprocess.media import Preprocessor

    pre = Preprocessor(cfg.model.dir, Limits(), pixels=cfg.preprocess.pixels, audio=cfg.preprocess.audio)  # as the mesh's preprocess hands them on
    data = {"image": image_png(args.seed, args.image_size), "audio": clip_wav(args.seed, args.clip_seconds)}
    decode = {"image": pre.image, "audio": pre.audio_file}
    return {kind: (decode[kind], data[kind]) for kind in data}


def preprocess_cells(cfg: MeshConfig, device: str, args):
    for kind, (decode, data) in media_items(cfg, args).items():
        decode(data)
        seconds, _ = timed(lambda: [decode(data) for _ in range(args.preprocess_items)], torch.device("cpu"))
        yield {"stage": "preprocess", "item": kind, "batch": 1, "items": args.preprocess_items,
               "items_per_s": args.preprocess_items / seconds, "step_ms": 1000 * seconds / args.preprocess_items}


def encoder_cells(cfg: MeshConfig, device: str, args):
    from services.encoder.reference import EncodeJob, Item, ReferenceEncoder

    ec = cfg.encoder
    engine = ReferenceEncoder(cfg.model.dir, device, DTYPES[cfg.model.dtype], cfg.model.load_format, cfg.model.seed,
                              batch=ec.batch, attention=ec.attention, compile=ec.compile, graphs=ec.graphs)
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
            yield {"stage": "encoder", "item": kind, "batch": b, "batched": ec.batch, "attention": ec.attention,
                   "compiled": ec.compile, "graphs": ec.graphs,
                   "tokens_per_item": f.num_tokens, "seconds": seconds, "items_per_s": b / seconds, "step_ms": 1000 * seconds}


STAGES = {"thinker": (thinker_cells, "thinker"), "hf-thinker": (hf_thinker_cells, "thinker"), "talker": (talker_cells, "talker"),
          "encoder": (encoder_cells, "encoder"), "preprocess": (preprocess_cells, None), "code2wav": (code2wav_cells, "talker")}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="mesh config: model, dtype, load format, seed, devices, talker chunking")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override, e.g. thinker.engine=native (repeatable)")
    p.add_argument("--out", required=True)
    p.add_argument("--stages", default="thinker,talker,encoder,preprocess")
    p.add_argument("--device", default="", help="run every stage here; default: each stage's first replica's device")
    p.add_argument("--batches", type=ints, default=[1, 8, 32, 64], help="thinker and talker sequences per step")
    p.add_argument("--prompt-lens", type=ints, default=[512, 4096])
    p.add_argument("--hf-batches", type=ints, default=[1, 8, 32], help="batches of transformers' generate() (hf-thinker)")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--prompts", choices=["random", "chat"], default="random",
                   help="thinker prompts: random token ids, or the t2t workload's text in the chat template")
    p.add_argument("--routing-stats", action="store_true",
                   help="thinker: experts chosen per layer by a decode step (eager steps only: cuda_graph_max_batch=0)")
    p.add_argument("--frames", type=int, default=16, help="talker frames per sequence")
    p.add_argument("--talker-prompt-bytes", type=int, default=32)
    p.add_argument("--thinker-modes", default="config",
                   help="native thinker, each batch's decode under each mode on one engine: config, plain, overlap; "
                        "an -eager-draw suffix draws tokens after the graph (thinker.graph_sampling off)")
    p.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                   help="freeze the heap after the engine's build and warm-up, as the stage servers do (thinker and talker cells)")
    p.add_argument("--talker-modes", default="config",
                   help="native talker, each batch under each mode on one engine (one build, one capture): config, "
                        "plain, overlap; a -graph-draw suffix draws first codes in the captured step (built with "
                        "talker.graph_sampling on; the modes without it draw after the graph), "
                        "a -c2w-inline one waits for code2wav in the frame loop (no side stream)")
    p.add_argument("--encoder-batches", type=ints, default=[1, 8, 32])
    p.add_argument("--code2wav-dtypes", default="bfloat16",
                   help="code2wav stage: precisions held to float32 (float32 always runs); NAME+fuse: activations fused, NAME+native: its decoder native (talker.code2wav_native), NAME+tune: convolutions tuned (NAME+fuse+tune)")
    p.add_argument("--preprocess-items", type=int, default=8)
    p.add_argument("--image-size", type=int, default=512)
    p.add_argument("--clip-seconds", type=float, default=7.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None, help="cells started after this are skipped")
    p.add_argument("--moe-tiles", type=json.loads, default=None,
                   help="the Triton experts' tile shape for steps of 17 to 64 tokens in place of triton_moe's, as JSON "
                        "(a shape of bench.moe's tiles_* or down_tiles_* lists: BLOCK_M, BLOCK_N, BLOCK_K, num_warps, "
                        "num_stages, optionally down): an A/B before a shape goes into the code")
    return p.parse_args(argv)


def use_moe_tiles(shape: dict) -> None:
    """triton_moe's decode kernels take `shape` for steps of 17 to 64 tokens (--moe-tiles; a bench.moe list
    entry's time, `ms`, dropped)."""
    from bench.moe import TILE_KEYS
    from services.llm import triton_moe

    shape = {k: v for k, v in shape.items() if k != "ms"}
    keys = {*TILE_KEYS, "down"}
    if set(shape) - keys or not {"BLOCK_M", "BLOCK_N", "BLOCK_K"} <= set(shape):
        raise SystemExit(f"--moe-tiles: a shape has {sorted(keys)} (the first three at least), not {sorted(shape)}")
    default = triton_moe._tiles
    triton_moe._tiles = lambda tokens, *rest: dict(shape) if 16 < tokens <= 64 else default(tokens, *rest)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.moe_tiles is not None:
        use_moe_tiles(args.moe_tiles)
    cfg = load_config(args.config, args.set)
    if cfg.model.dir and not (cfg.model.dir / "config.json").exists():
        raise SystemExit(f"no model folder at {cfg.model.dir}: python -m services.model.build full {cfg.model.path}")
    deadline = time.perf_counter() + args.max_minutes * 60 if args.max_minutes else None
    config = {"path": str(Path(args.config)), "content": yaml.safe_load(Path(args.config).read_text()), "overrides": args.set}
    command = "python -m bench.stages " + shlex.join(sys.argv[1:] if argv is None else argv)
    result = results.new_result("stages", config, results.model_info(cfg.model.dir, cfg.model), {"command": command, "args": vars(args)})
    result["machine"] = results.machine()
    for name in args.stages.split(","):
        cells, replica_stage = STAGES[name]
        device = args.device or (cfg.replicas(replica_stage)[0].device if replica_stage and cfg.replicas(replica_stage) else "cpu")
        if deadline is not None and time.perf_counter() > deadline:
            result["cells"].append({"stage": name, "status": "skipped", "reason": "the run's time limit was reached"})
            continue
        stage_cells = cells(cfg, device, args)
        try:
            for cell in stage_cells:
                cell.update(device=device, status="ok")
                result["cells"].append(cell)
                results.write(result, args.out)
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in cell.items()), flush=True)
                if deadline is not None and time.perf_counter() > deadline:
                    result["cells"].append({"stage": name, "status": "skipped", "reason": "the run's time limit was reached"})
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
