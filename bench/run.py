"""The sweep: every workload at every concurrency, through the mesh's public API or transformers' generate().

    python -m bench.run --config configs/bench-2xh200.yaml --launch --out bench/results/NAME.json
    python -m bench.run --config configs/bench-2xh200.yaml --engine hf --device cuda:0 --out bench/results/NAME-hf.json
    python -m bench.run --config configs/local.yaml --launch --http --out bench/results/NAME.json  # each cell twice:
        through gRPC, then through the OpenAI-compatible HTTP API (the config's api process), cells marked by `client`

The result file is rewritten after every cell, so a run cut short keeps what it finished; `--resume` adds the
cells a file lacks, so a sweep longer than one sitting runs in parts, all held to the same config and code.
"""

import argparse
import asyncio
import shlex
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import grpc

from bench import results
from bench.loadgen import LoopResult, MeshClient, StageCpu
from bench.merge import resumed
from bench.records import summarize
from bench.workloads import WORKLOADS, MediaSpec, Workload, grpc_request, select, video_size
from services.runtime.config import REPO_ROOT, load_config, read_overridden, write_overridden

# Request indices of a cell depend only on its concurrency, so both engines get the same inputs and seeds,
# and no two cells repeat a prompt (a prefix cache must not turn a later cell into cache hits).
CELL_STRIDE, WARMUP_OFFSET = 100_000, 50_000
INITIAL_WARMUP_LENGTH = 8  # tokens and frames of the run's first request per workload
HF_NOTE = ("batches of B, one after another; latency includes input preparation; TTFT/ITL from a streamer on the thinker; "
           "TTFA = the batch's latency (speech comes out whole)")


def cell_indices(concurrency: int, n: int, warmup: bool = False) -> list[int]:
    base = concurrency * CELL_STRIDE + (WARMUP_OFFSET if warmup else 0)
    return list(range(base, base + n))


class Budget:
    """The run's time limit: a cell is skipped when even an optimistic estimate of it does not fit."""

    def __init__(self, minutes: float | None):
        self.deadline = time.perf_counter() + minutes * 60 if minutes else None
        self.seen: dict[str, tuple[int, int, float]] = {}  # workload -> (concurrency, requests, seconds) of its last cell

    def why_not(self, w: Workload, concurrency: int, requests: int) -> str:
        left = float("inf") if self.deadline is None else self.deadline - time.perf_counter()
        if left <= 0:
            return "the run's time limit was reached"
        b, n, seconds = self.seen.get(w.name, (1, 1, 0.0))
        estimate = seconds * (requests / n) * (b / concurrency)  # as if throughput grew with concurrency
        return f"not enough time left: needs at least ~{estimate:.0f} s, {left:.0f} s left" if estimate > left else ""

    def record(self, w: Workload, concurrency: int, requests: int, seconds: float) -> None:
        self.seen[w.name] = (concurrency, requests, seconds)


def base_cell(w: Workload, concurrency: int, client: str | None = None) -> dict:
    return {"workload": w.name, "concurrency": concurrency, "input": w.media, "speech": w.speech,
            "max_tokens": w.max_tokens, "frames": w.frames, "prompt_bytes": w.prompt_bytes} | ({"client": client} if client else {})


def finish_cell(w: Workload, concurrency: int, loop: LoopResult, warmup: int, keep_records: bool, client: str | None = None) -> dict:
    cell = base_cell(w, concurrency, client)
    if loop.out_of_time:
        cell.update(status="skipped", reason=f"the run's time limit was reached after {len(loop.records)} requests")
    else:
        cell.update(status="ok", reason="")
    cell.update(warmup_requests=warmup, **summarize(loop.records, loop.duration))
    ok = [r for r in loop.records if r.ok]
    # Fixed lengths: any request that did not produce exactly what it asked for is counted here.
    cell["length_mismatches"] = sum(r.text_tokens != w.max_tokens or (w.speech and r.audio_frames != w.frames) for r in ok)
    if loop.messages:
        cell.update(client_cpu_s=loop.client_cpu_s, client_cpu_frac=loop.client_cpu_s / max(loop.duration, 1e-9),
                    client_us_per_msg=1e6 * loop.client_cpu_s / loop.messages, messages=loop.messages)
    if loop.stage_cpu:
        cell["stage_cpu_frac"] = loop.stage_cpu
    if keep_records:
        cell["records"] = [r.as_dict() for r in loop.records]
    return cell


def print_cell(cell: dict) -> None:
    def ms(key):
        return f"{cell[key] * 1000:.0f}ms" if cell.get(key) is not None else "-"

    def num(key, fmt):
        return format(cell[key], fmt) if cell.get(key) is not None else "-"

    head = f"{cell['workload']:>4} B={cell['concurrency']:<3}" + (f" {cell['client']:<4}" if "client" in cell else "")
    if cell["status"] == "skipped" and not cell.get("requests"):
        print(f"{head} skipped: {cell['reason']}", flush=True)
        return
    print(f"{head} {cell['requests']} req {cell['failures']} failed  {num('output_tok_per_s', '.1f')} tok/s  "
          f"{num('req_per_s', '.3f')} req/s  {num('audio_s_per_s', '.2f')} audio-s/s  TTFT p50 {ms('ttft_p50')} "
          f"TTFA p50 {ms('ttfa_p50')}  ITL p50 {ms('itl_p50')}  e2e p50 {ms('e2e_p50')}  RTF p50 {num('rtf_p50', '.3f')}  "
          f"{cell['duration_s']:.1f}s" + (f"  client CPU {cell['client_cpu_frac']:.0%}" if "client_cpu_frac" in cell else "")
          + ("  busiest: " + ", ".join(f"{k} {v:.0%}" for k, v in sorted(cell["stage_cpu_frac"].items(), key=lambda kv: -kv[1])[:3])
             if cell.get("stage_cpu_frac") else "")
          + (f"  [{cell['status']}: {cell['reason']}]" if cell["status"] != "ok" else "")
          + (f"  first error: {cell['first_error'][:160]}" if cell["failures"] else ""), flush=True)


def dead_stages(procs: dict, w: Workload) -> str:
    """Why `w`'s cells cannot run: the launched stage processes (`procs`, name -> Popen) it needs that exited (a
    talker that died leaves the text workloads to run)."""
    needed = {"gateway", "thinker"} | ({"preprocess", "encoder"} if w.media != "text" else set()) | ({"talker"} if w.speech else set())
    return "; ".join(f"{name} exited with code {p.returncode}" for name, p in procs.items()
                     if p.poll() is not None and name.rsplit("-", 1)[0] in needed)


class MeshRunner:
    """Runs request indices of a workload through the gateway, `concurrency` in flight."""
    note = ""
    failure_blocks_larger = False  # a failure at one concurrency says nothing about the next

    def __init__(self, client: MeshClient, media: MediaSpec, seed: int, cpu: StageCpu | None = None):
        self.client, self.media, self.seed, self.cpu = client, media, seed, cpu

    async def __call__(self, w: Workload, indices: list[int], concurrency: int, deadline: float | None) -> LoopResult:
        requests = [(i, grpc_request(w, i, self.media, self.seed)) for i in indices]  # built before the clock starts
        before = self.cpu.read() if self.cpu else {}
        loop = await self.client.closed_loop(requests, concurrency, deadline)
        if self.cpu:
            loop.stage_cpu = self.cpu.fractions(before, self.cpu.read(), loop.duration)
        return loop


class HfRunner:
    """Runs request indices of a workload through transformers' generate(), in batches of `concurrency`."""
    note = HF_NOTE
    failure_blocks_larger = True  # out of memory at batch B: larger batches are not tried

    def __init__(self, engine):
        self.engine = engine

    async def __call__(self, w: Workload, indices: list[int], concurrency: int, deadline: float | None) -> LoopResult:
        return self.engine.closed_batches(w, indices, concurrency, deadline)


class Sweep:
    def __init__(self, args, result: dict):
        self.args, self.result, self.budget = args, result, Budget(args.max_minutes)
        self.media = MediaSpec(args.image_size, args.clip_seconds, args.distinct_inputs, args.seed, args.video_seconds,
                               video_size(args.video_size))

    def requests(self, concurrency: int) -> int:
        return max(self.args.requests_per_slot * concurrency, self.args.min_requests)

    @property
    def clients(self) -> list[str | None]:
        """The doors each cell goes through: gRPC alone (unmarked), or gRPC then HTTP back to back (--http)."""
        return ["grpc", "http"] if self.args.http is not None else [None]

    def plan(self) -> list[tuple[Workload, int, str | None]]:
        """The cells to run: every workload at every concurrency (through every door) asked for, less those the file
        already has."""
        ws = select(self.args.workloads, self.args.max_tokens, self.args.frames, self.args.prompt_bytes)
        bs = [int(b) for b in self.args.concurrency.split(",")]
        cells = [(w, b) for w in ws for b in bs]
        done = {results.cell_key(c) for c in self.result["cells"] if c["status"] == "ok"}
        return [(w, b, c) for w, b in cells for c in self.clients if results.cell_key(base_cell(w, b, c)) not in done]

    def add(self, cell: dict) -> None:
        # A cell run again (skipped before) replaces its earlier entry.
        self.result["cells"] = [c for c in self.result["cells"] if results.cell_key(c) != results.cell_key(cell)]
        self.result["cells"].append(cell)
        results.write(self.result, self.args.out)
        print_cell(cell)

    def skip(self, w: Workload, concurrency: int, reason: str, client: str | None = None) -> None:
        self.add({**base_cell(w, concurrency, client), "status": "skipped", "reason": reason, "requests": 0, "failures": 0})

    async def run(self, runner, stage_died=lambda w: "") -> None:
        """Every cell of the plan; `stage_died(w)` names the dead stages workload `w` needs (its cells skipped).
        `runner`: one runner, or one per door ({"grpc": ..., "http": ...})."""
        runners = runner if isinstance(runner, dict) else {None: runner}
        plan = self.plan()
        if not plan:
            print("every cell asked for is in the file already", flush=True)
            return
        t0 = time.perf_counter()
        for w, client in dict.fromkeys((w, c) for w, _, c in plan):  # one short request of each workload first: lazy initialisation, not measured
            short = replace(w, max_tokens=min(w.max_tokens, INITIAL_WARMUP_LENGTH), frames=min(w.frames, INITIAL_WARMUP_LENGTH))
            await runners[client](short, cell_indices(0, 1, warmup=True), 1, self.budget.deadline)
        self.result["run"]["initial_warmup_s"] = time.perf_counter() - t0
        failed_at: dict[tuple, int] = {}  # (workload, door) -> smallest concurrency that failed
        for w, b, client in plan:
            runner, key = runners[client], (w.name, client)
            n = self.requests(b)
            if runner.failure_blocks_larger and b > failed_at.get(key, b):
                self.skip(w, b, f"concurrency {failed_at[key]} already failed", client)
                continue
            if reason := self.budget.why_not(w, b, n + b) or stage_died(w):
                self.skip(w, b, reason, client)
                continue
            t0 = time.perf_counter()
            # Warm-up at the same B, shorter: batch shapes, graphs and code2wav's chunk shapes are reached within
            # the first tens of tokens and frames, and a full-length round would cost a fifth of the sweep.
            length = self.args.warmup_length or max(w.max_tokens, w.frames)
            warm_w = replace(w, max_tokens=min(w.max_tokens, length), frames=min(w.frames, length))
            warm = await runner(warm_w, cell_indices(b, b * self.args.warmup_rounds, warmup=True), b, self.budget.deadline)
            if warm.out_of_time:
                self.skip(w, b, "the run's time limit was reached during warm-up", client)
                continue
            failed_warmup = runner.failure_blocks_larger and any(r.error for r in warm.records)
            loop = warm if failed_warmup else await runner(w, cell_indices(b, n), b, self.budget.deadline)
            self.budget.record(w, b, n + len(warm.records), time.perf_counter() - t0)
            cell = finish_cell(w, b, loop, len(warm.records), self.args.records, client)
            if note := ("failed in warm-up; " if failed_warmup else "") + runner.note:
                cell["note"] = note
            if cell["failures"]:
                failed_at[key] = min(b, failed_at.get(key, b))
            self.add(cell)

    async def mesh(self, address: str, stage_died, wait_ready: float = 0.0, cpu: StageCpu | None = None) -> None:
        client = MeshClient(address, self.args.channels, self.args.request_timeout)
        try:
            deadline = time.perf_counter() + wait_ready
            while True:
                try:
                    info = await client.model_info()
                    break
                except grpc.aio.AioRpcError as e:
                    if time.perf_counter() >= deadline:
                        raise SystemExit(f"cannot reach the gateway at {address}: {e.code().name}: {e.details()}") from None
                    await asyncio.sleep(1.0)
            self.result["model"]["served"] = {"model": info.model, "voices": list(info.voices),
                                              "max_new_tokens": info.limits.max_new_tokens}
            runner = MeshRunner(client, self.media, self.args.seed, cpu)
            if self.args.http is None:
                await self.run(runner, stage_died)
                return
            from bench.http_client import HttpClient

            http = HttpClient(self.args.http, info.default_voice, self.args.request_timeout)
            try:
                await self.run({"grpc": runner, "http": MeshRunner(http, self.media, self.args.seed, cpu)}, stage_died)
            finally:
                await http.close()
        finally:
            await client.close()


def wait_serving(cfg, seconds: float, poll_s: float = 1.0) -> None:
    """Returns once every replica of every stage of `cfg` answers its health check SERVING. The gateway
    serves before the stages behind it have loaded their models, so asking it alone is not enough."""
    from services.runtime.probe import stage_serving

    pending = {f"{stage}[{i}]": (stage, r.address) for stage in cfg.STAGES for i, r in enumerate(cfg.replicas(stage))}
    deadline = time.perf_counter() + seconds
    while pending:
        pending = {name: sa for name, sa in pending.items() if not stage_serving(*sa, timeout=1.0)}
        if pending and time.perf_counter() >= deadline:
            raise SystemExit(f"not serving after {seconds:.0f}s: " + ", ".join(f"{n} at {a}" for n, (_, a) in sorted(pending.items())))
        if pending:
            time.sleep(poll_s)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="mesh config: the deployment, its model and sampling defaults")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--out", required=True, help="result JSON (rewritten after every cell)")
    p.add_argument("--engine", choices=["mesh", "hf"], default="mesh")
    p.add_argument("--launch", action="store_true", help="start the mesh of --config (and stop it at the end)")
    p.add_argument("--address", default="", help="gateway to drive without --launch; default: the config's gateway")
    p.add_argument("--device", default="", help="hf engine: device; default cuda:0 when there is a GPU, else cpu")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    p.add_argument("--min-requests", type=int, default=16)
    p.add_argument("--requests-per-slot", type=int, default=4, help="a cell runs max(this x B, --min-requests) requests")
    p.add_argument("--warmup-rounds", type=int, default=1, help="warm-up requests per cell = this x B, not counted")
    p.add_argument("--warmup-length", type=int, default=64,
                   help="tokens and frames a warm-up request asks for, at most (0: the workload's own lengths)")
    p.add_argument("--max-tokens", type=int, default=None, help="override every workload's thinker tokens")
    p.add_argument("--frames", type=int, default=None, help="override every speech workload's codec frames")
    p.add_argument("--prompt-bytes", type=int, default=None, help="override the generated text prompts' length")
    p.add_argument("--image-size", type=int, default=512)
    p.add_argument("--clip-seconds", type=float, default=7.0)
    p.add_argument("--video-seconds", type=float, default=10.0, help="the video workloads' clips")
    p.add_argument("--video-size", default="640x360", help="the video workloads' frames, WIDTHxHEIGHT")
    p.add_argument("--distinct-inputs", type=int, default=0, help="0: every request its own image/clip/prompt")
    p.add_argument("--seed", type=int, default=0, help="inputs and sampling seeds")
    p.add_argument("--max-minutes", type=float, default=None, help="bound on the whole run; cells that do not fit are skipped")
    p.add_argument("--channels", type=int, default=4, help="gRPC channels (connections) of the load generator")
    p.add_argument("--http", nargs="?", const="", default=None, metavar="URL",
                   help="run each cell through gRPC and then through the HTTP API at URL (default: the config's api process)")
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--launch-timeout", type=float, default=1800.0)
    p.add_argument("--log-dir", default=None, help="stage logs with --launch (default .cache/logs)")
    p.add_argument("--records", action="store_true", help="keep every request's raw record in the result")
    p.add_argument("--wait-ready", type=float, default=0.0, metavar="S", help="without --launch: wait for every replica")
    p.add_argument("--resume", action="store_true", help="--out exists: add the cells it lacks (same config, code, lengths)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.engine == "hf" and (args.launch or args.address):
        raise SystemExit("--launch and --address drive the mesh; --engine hf runs transformers in this process")
    started = time.perf_counter()
    cfg = load_config(args.config, args.set)
    if args.http == "":  # --http alone: the config's own api process
        if not cfg.api.replicas:
            raise SystemExit(f"--http without a URL needs an api replica in {args.config}")
        args.http = f"http://{cfg.api.replicas[0].address}"
    if cfg.model.dir and not (cfg.model.dir / "config.json").exists():
        raise SystemExit(f"no model folder at {cfg.model.dir}: python -m services.model.build full {cfg.model.path}")
    content = read_overridden(args.config, args.set)
    config = {"path": str(Path(args.config)), "content": content, "overrides": args.set}
    run = {"command": "python -m bench.run " + shlex.join(sys.argv[1:] if argv is None else argv), "args": vars(args),
           "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    result = results.new_result(args.engine, config, results.model_info(cfg.model.dir, cfg.model), run)
    result["machine"] = results.machine()
    if args.resume and Path(args.out).exists():
        result = resumed(results.read(args.out), result)
    sweep = Sweep(args, result)
    results.write(result, args.out)
    if args.engine == "hf":
        import torch

        from bench.hf_engine import HfEngine

        device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
        t0 = time.perf_counter()
        engine = HfEngine(cfg, device, sweep.media, args.seed)
        run["load_s"] = time.perf_counter() - t0
        config["hf"] = engine.settings()
        asyncio.run(sweep.run(HfRunner(engine)))
    elif args.launch:
        from services.launch import Mesh

        # The stages read their config from a file: the overridden one.
        launched = write_overridden(args.config, args.set, REPO_ROOT / ".cache" / f"bench-{Path(args.out).stem}.yaml")
        mesh = Mesh(launched, args.log_dir)
        t0 = time.perf_counter()
        mesh.start(timeout=args.launch_timeout)
        run["launch_s"], run["log_dir"] = time.perf_counter() - t0, str(mesh.log_dir)
        print(f"mesh of {args.config} healthy after {run['launch_s']:.0f}s", flush=True)

        try:
            asyncio.run(sweep.mesh(mesh.gateway_address, lambda w: dead_stages(mesh.procs, w), cpu=StageCpu(cfg)))
        finally:
            run["stage_exit_codes"] = mesh.stop()
    else:  # a mesh started apart (services.launch with the same --config and --set), perhaps still starting
        if args.wait_ready:
            t0 = time.perf_counter()
            wait_serving(cfg, args.wait_ready)
            run["wait_ready_s"] = time.perf_counter() - t0
        asyncio.run(sweep.mesh(args.address or cfg.gateway.replicas[0].address, lambda w: "", args.wait_ready, StageCpu(cfg)))
    run.update(finished=datetime.now(timezone.utc).isoformat(timespec="seconds"), wall_s=time.perf_counter() - started)
    results.write(result, args.out)
    print(f"wrote {args.out} ({len(result['cells'])} cells, {run['wall_s']:.0f}s)", flush=True)
    return result


if __name__ == "__main__":
    main()
