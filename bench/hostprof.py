"""Where the host's time a step goes, by function: bench.stages run with timers around the engines' step pieces.

    python -m bench.hostprof [--out FILE.json] -- <bench.stages arguments>

Each named function is wrapped by two clock reads (inclusive time: a function's callees count in it too) and
its calls counted; the totals over the whole run, divided by the calls, and per decode step (the calls of
DecodeGraphs.replay: a captured step's; the run's totals where there are none, as on the CPU), are printed and
written to --out. The wrapped functions' time grows by the clock reads (well under a microsecond a call), so the
figures sit a little above an unwrapped run's laps.

host_state() and host_use() give the benches' decode cells the thread's CPU time a step beside its wall time,
and what took the CPU away from it (involuntary switches, a hypervisor's steal).
"""

import argparse
import collections
import functools
import json
import sys
import time

# (module, class or None, attribute): what is timed
TIMED = [
    ("services.thinker.engine", "NativeThinker", "step"),
    ("services.thinker.engine", "NativeThinker", "_launch"),
    ("services.thinker.engine", "NativeThinker", "_finish"),
    ("services.thinker.engine", "NativeThinker", "_launch_buffers"),
    ("services.thinker.decode", "DecodeGraphs", "replay"),
    ("services.llm.flashinfer_attention", "DecodeAttention", "plan"),
    ("services.llm.flashinfer_attention", "DecodeAttention", "_direct"),
    ("services.llm.decode_plan", "DecodeTable", "advance"),
    ("services.llm.decode_plan", "KeptPlan", "keeps"),
    ("services.llm.decode_plan", "DecodePages", "__call__"),
    ("services.llm.decode_plan", "PlanCopy", "wait"),
    ("services.llm.decode_plan", "PlanCopy", "record"),
    ("services.llm.decode_plan", "Replays", "steady"),
    ("services.llm.host", "Staging", "fill"),
    ("services.llm.host", "Staging", "send"),
    ("services.llm.graphs", "CapturedGraphs", "replay"),
    ("services.llm.scheduler", "Scheduler", "schedule"),
    ("services.llm.scheduler", "Scheduler", "advance"),
]


def host_state() -> dict:
    """This thread's CPU seconds and involuntary context switches, and the machine's CPU time in all and stolen by its
    hypervisor (/proc/stat, in clock ticks), where the platform gives them: read before and after a run (host_use)."""
    state = {"cpu_s": time.thread_time()}
    try:
        import resource

        state["switches"] = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
    except (ImportError, AttributeError, OSError):
        pass
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        state["ticks"], state["steal"] = sum(ticks), ticks[7]
    except (OSError, ValueError, IndexError):
        pass
    return state


def host_use(before: dict, after: dict, cpu_waited_s: float, steps: int) -> dict:
    """Between two host_state() reads over `steps` steps: the thread's CPU ms a step outside its waits on the device
    (`cpu_waited_s`: the engine's Laps.cpu_waited over the run), its involuntary switches a step, and the share of
    the machine's CPU time its hypervisor stole (%). Wall time a step well above CPU time, with switches or steal,
    is the machine's doing, not the code's."""
    out = {"host_cpu_ms_per_step": 1000 * (after["cpu_s"] - before["cpu_s"] - cpu_waited_s) / max(steps, 1)}
    if "switches" in after:
        out["involuntary_switches_per_step"] = (after["switches"] - before["switches"]) / max(steps, 1)
    if "ticks" in after and after["ticks"] > before["ticks"]:
        out["steal_pct"] = 100 * (after["steal"] - before["steal"]) / (after["ticks"] - before["ticks"])
    return out


def wrap(totals: dict, calls: collections.Counter) -> list:
    """Each TIMED function replaced by its timed wrapper; returns what to put back (unwrap)."""
    import importlib

    originals = []
    for module, cls, name in TIMED:
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        if not hasattr(owner, name):
            print(f"hostprof: {module}.{cls}.{name} not found, not timed", file=sys.stderr)
            continue
        fn, label = getattr(owner, name), f"{cls}.{name}" if cls else name

        def timed(*a, _fn=fn, _label=label, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                totals[_label] += time.perf_counter() - t
                calls[_label] += 1

        originals.append((owner, name, fn))
        setattr(owner, name, functools.wraps(fn)(timed))
    return originals


def unwrap(originals: list) -> None:
    for owner, name, fn in originals:
        setattr(owner, name, fn)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else ([], argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    args = p.parse_args(ours)
    totals, calls = collections.defaultdict(float), collections.Counter()
    originals = wrap(totals, calls)
    from bench import stages

    try:
        stages.main(rest)
    finally:
        unwrap(originals)
    steps = calls["DecodeGraphs.replay"] or 1
    rows = {k: {"calls": calls[k], "us_per_call": round(1e6 * totals[k] / calls[k], 2),
                "us_per_decode_step": round(1e6 * totals[k] / steps, 2)} for k in sorted(totals, key=totals.get, reverse=True)}
    for k, r in rows.items():
        print(f"hostprof {k:34s} calls={r['calls']:6d} us/call={r['us_per_call']:9.2f} us/decode-step={r['us_per_decode_step']:9.2f}")
    out = {"argv": rest, "decode_steps": steps, "functions": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
