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
import os
import sys
import time

# (module, class or None, attribute): what is timed
TIMED = [
    ("services.thinker.engine", "NativeThinker", "step"),
    ("services.thinker.engine", "NativeThinker", "_launch"),
    ("services.thinker.engine", "NativeThinker", "_finish"),
    ("services.thinker.engine", "NativeThinker", "_launch_buffers"),
    ("services.thinker.engine", "NativeThinker", "_overlappable"),
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
    ("services.llm.host", "Staging", "reached"),
    ("services.llm.graphs", "CapturedGraphs", "replay"),
    ("services.llm.scheduler", "Scheduler", "schedule"),
    ("services.llm.scheduler", "Scheduler", "advance"),
]


def _gpu_irqs() -> list[int]:
    """Interrupts so far on each CPU from the GPU driver's lines of /proc/interrupts (nvidia): [] where none show."""
    try:
        with open("/proc/interrupts") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    cpus = len(lines[0].split()) if lines else 0
    counts = [0] * cpus
    for line in lines[1:]:
        if "nvidia" in line.lower():
            for i, x in enumerate(line.split()[1:cpus + 1]):
                counts[i] += int(x) if x.isdigit() else 0
    return counts if any(counts) else []


def _thread_cpu() -> int | None:
    """The CPU this thread last ran on (/proc/thread-self/stat's field 39), where the platform says."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def cpu_probe() -> float:
    """Microseconds this thread takes for a fixed piece of interpreter work (a loop over 2,000 ints): the CPU's own
    speed at that moment, beside which a step's host time can be read (a step slower with the probe as slow is the
    machine's CPU, not the code)."""
    t = time.perf_counter_ns()
    total = 0
    for i in range(2000):
        total += i & 7
    return (time.perf_counter_ns() - t) / 1000


def host_state() -> dict:
    """This thread's CPU seconds and involuntary context switches, the process's CPU seconds (its other threads'
    show as the difference), the machine's CPU time in all, idle and stolen by its hypervisor (/proc/stat, in clock
    ticks), the GPU's interrupts on each CPU and the CPU this thread is on, where the platform gives them: read
    before and after a run (host_use)."""
    state = {"cpu_s": time.thread_time(), "process_cpu_s": time.process_time(), "irqs": _gpu_irqs(),
             "cpu": _thread_cpu()}
    try:
        import resource

        state["switches"] = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
    except (ImportError, AttributeError, OSError):
        pass
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        state["ticks"], state["idle"], state["steal"] = sum(ticks), ticks[3] + ticks[4], ticks[7]
    except (OSError, ValueError, IndexError):
        pass
    return state


def host_use(before: dict, after: dict, cpu_waited_s: float, steps: int) -> dict:
    """Between two host_state() reads over `steps` steps: the thread's CPU ms a step outside its waits on the device
    (`cpu_waited_s`: the engine's Laps.cpu_waited over the run), its involuntary switches a step, the share of
    the machine's CPU time its hypervisor stole (%), how many CPUs were busy on average (`busy_cpus`), the CPU ms a
    step of the process's other threads, the GPU's interrupts a step in all and on the CPU this thread ended on
    (`cpu`). Wall time a step well above CPU time, with switches or steal, is the machine's doing, not the code's;
    CPU time well above a fast run's, with none of those, points at what shares the thread's CPU."""
    steps = max(steps, 1)
    thread_s = after["cpu_s"] - before["cpu_s"]
    out = {"host_cpu_ms_per_step": 1000 * (thread_s - cpu_waited_s) / steps,
           "other_threads_cpu_ms_per_step": max(0.0, 1000 * (after["process_cpu_s"] - before["process_cpu_s"] - thread_s) / steps)}
    if "switches" in after:
        out["involuntary_switches_per_step"] = (after["switches"] - before["switches"]) / steps
    if "ticks" in after and after["ticks"] > before["ticks"]:
        ticks = after["ticks"] - before["ticks"]
        out["steal_pct"] = 100 * (after["steal"] - before["steal"]) / ticks
        cpus = max(len(after["irqs"]), os.cpu_count() or 1)
        out["busy_cpus"] = cpus * (1 - (after["idle"] - before["idle"]) / ticks)
    if after["irqs"] and len(after["irqs"]) == len(before["irqs"]):
        irqs = [a - b for a, b in zip(after["irqs"], before["irqs"])]
        out["gpu_irqs_per_step"] = sum(irqs) / steps
        if after["cpu"] is not None and after["cpu"] < len(irqs):
            out["cpu"], out["gpu_irqs_on_cpu_per_step"] = after["cpu"], irqs[after["cpu"]] / steps
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
