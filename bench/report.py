"""A result as a markdown table (with a baseline: ours, theirs and the ratio) and PNG plots, next to the JSON.

    python -m bench.report bench/results/NAME.json [bench/results/NAME-hf.json]

Writes NAME.md, and for sweeps NAME-throughput.png and NAME-latency.png (plots need matplotlib).
"""

import argparse
from pathlib import Path

from bench import results
from bench.results import METRICS, cell_key, key_label, ratio

TEXT_COLUMNS = ["output_tok_per_s", "req_per_s", "ttft_p50", "ttft_p99", "itl_p50", "e2e_p50", "failures"]
SPEECH_COLUMNS = ["req_per_s", "audio_s_per_s", "output_tok_per_s", "ttfa_p50", "ttfa_p99", "rtf_p50", "ttft_p50", "failures"]
STAGE_COLUMNS = ["tok_per_s", "frames_per_s", "audio_s_per_s", "items_per_s", "step_ms", "host_ms_per_step",
                 "talker_share", "code_predictor_share", "code2wav_share", "rel_l2", "snr_db"]
TITLES = {
    "output_tok_per_s": "tok/s", "req_per_s": "req/s", "audio_s_per_s": "audio-s/s", "ttft_p50": "TTFT p50",
    "ttft_p99": "TTFT p99", "ttfa_p50": "TTFA p50", "ttfa_p99": "TTFA p99", "itl_p50": "ITL p50", "e2e_p50": "e2e p50",
    "e2e_p99": "e2e p99", "rtf_p50": "RTF p50", "failures": "failures", "tok_per_s": "tok/s", "frames_per_s": "frames/s",
    "items_per_s": "items/s", "step_ms": "step ms", "host_ms_per_step": "host ms/step",
    "talker_share": "talker share", "code_predictor_share": "code predictor share", "code2wav_share": "code2wav share",
    "rel_l2": "rel. L2 to float32", "snr_db": "SNR dB",
}


def fmt(metric: str, value) -> str:
    if value is None:
        return "-"
    if metric.startswith(("ttft", "ttfa", "itl", "e2e")):
        return f"{value * 1000:.0f} ms" if value >= 0.01 else f"{value * 1000:.2f} ms"
    if metric == "failures":
        return str(int(value))
    if metric.endswith("_share"):
        return f"{value:.0%}"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def figure(metric: str, ours: dict, theirs: dict | None) -> str:
    a = ours.get(metric)
    if theirs is None:
        return fmt(metric, a)
    b = theirs.get(metric)
    r = ratio(a, b, METRICS[metric]) if metric in METRICS and metric != "failures" else None
    return f"{fmt(metric, a)} / {fmt(metric, b)}" + (f" ({r:.2f}x)" if r is not None else "")


def describe(result: dict) -> str:
    m = result.get("machine", {})
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in m.get("gpus", [])) or "no GPU"
    runs = result.get("parts", []) + [result.get("run", {})]  # a file run in parts (--resume, bench.merge): each part's
    commands = "; ".join(f"`{r.get('command', '?')}`" for r in runs)
    return (f"engine `{result['engine']}`, {result['created']}, commit `{result.get('git_commit', '')[:12]}`"
            f"{' (dirty tree)' if result.get('git_dirty') else ''}, {m.get('hostname', '?')}: {m.get('cpu_count', '?')} CPUs, {gpus}; "
            f"config `{result['config'].get('path', '')}`; {'commands' if len(runs) > 1 else 'command'} {commands}")


# The parts of a time to first token (and audio) the stages report per request, in the order a request meets them.
FIRST_OUTPUT_PARTS = ["preprocess", "gateway_preprocess", "encode_wait", "encode", "gateway_encode", "thinker_wait",
                      "thinker_prefill", "talker_wait_states", "talker_queue", "talker_first_frame", "talker_first_chunk"]


def cell_table(title: str, cells: list[dict], field: str, names: list[str], scale: float) -> list[str]:
    """A table of one dict field of each cell (`names` its columns, each value times `scale`); nothing if no cell has any."""
    names = [k for k in names if any((c.get(field) or {}).get(k) is not None for c in cells)]
    if not names:
        return []
    lines = [title, "", "| cell | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for cell in cells:
        values = cell.get(field) or {}
        label = key_label(tuple(kv for kv in cell_key(cell) if kv[0] not in ("workload", "stage", "mode")))
        lines.append(f"| {label} | " + " | ".join("-" if values.get(k) is None else f"{scale * values[k]:.0f}" for k in names) + " |")
    return lines + [""]


def first_output_split(group: str, cells: list[dict]) -> list[str]:
    """Where each cell's first token (and audio) waits: the p50 of each part the stages reported."""
    return cell_table(f"Where {group}'s first output waits, p50 of each part in ms (the gateway_* calls contain the stage's "
                      "own parts; p50s of parts need not add up to the p50 of the whole):", cells, "stage_seconds_p50",
                      FIRST_OUTPUT_PARTS, 1000)


def stage_cpu(group: str, cells: list[dict]) -> list[str]:
    """Each stage process's CPU over the cell (bench.loadgen.StageCpu), as a share of one core."""
    return cell_table(f"CPU of each stage process over {group}'s cells, % of one core (100%: a Python process's main thread "
                      "can do no more; but a GPU stage's thread waiting on its device spins there, CUDA's default wait, so a "
                      "GPU stage near 100% is not thereby bound by its host):", cells, "stage_cpu_frac",
                      sorted({k for c in cells for k in c.get("stage_cpu_frac") or {}}), 100)


def markdown(result: dict, name: str, baseline: dict | None = None, baseline_name: str = "") -> str:
    lines = [f"# {name}", "", f"- ours: `{name}`: {describe(result)}"]
    if baseline:
        lines += [f"- baseline: `{baseline_name}`: {describe(baseline)}",
                  "- each figure is ours / baseline (ratio, >1: ours better, whichever way the metric runs)"]
    lines.append("")
    theirs = {cell_key(c): c for c in (baseline or {}).get("cells", [])}
    groups: dict[str, list[dict]] = {}
    for cell in result["cells"]:
        groups.setdefault(cell.get("workload") or f"{cell.get('stage')} {cell.get('mode', '')}".strip(), []).append(cell)
    for group, cells in groups.items():
        columns = STAGE_COLUMNS if "stage" in cells[0] else SPEECH_COLUMNS if cells[0].get("speech") else TEXT_COLUMNS
        # A column either side measured: a cell of ours skipped still shows the baseline's figures.
        columns = [c for c in columns if any(x.get(c) is not None for x in cells + [theirs.get(cell_key(x), {}) for x in cells])]
        lines += [f"## {group}", "", "| cell | " + " | ".join(TITLES[c] for c in columns) + " | notes |",
                  "|---" * (len(columns) + 2) + "|"]
        for cell in cells:
            other = theirs.get(cell_key(cell)) if baseline else None
            label = key_label(tuple(kv for kv in cell_key(cell) if kv[0] not in ("workload", "stage", "mode")))
            notes = "; ".join(x for x in (cell.get("reason"), other and other.get("reason"), cell.get("first_error")) if x)
            if baseline and other is None:
                notes = "; ".join(filter(None, [notes, "no baseline cell"]))
            lines.append(f"| {label} | " + " | ".join(figure(c, cell, other if other is not None else ({} if baseline else None))
                                                   for c in columns) + f" | {notes} |")
        lines.append("")
        lines += first_output_split(group, cells)
        lines += stage_cpu(group, cells)
    return "\n".join(lines)


def plot(result: dict, baseline: dict | None, stem: Path) -> list[Path]:
    """Throughput and TTFT/TTFA against concurrency, one colour per workload, ours solid, baseline dashed."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(result, "-", result["engine"])] + ([(baseline, "--", baseline["engine"])] if baseline else [])
    workloads = list(dict.fromkeys(c["workload"] for r, _, _ in runs for c in r["cells"] if "workload" in c))
    colours = {w: plt.cm.tab10(i % 10) for i, w in enumerate(workloads)}
    written = []
    for suffix, panels in (("throughput", [("output_tok_per_s", "output tokens/s"), ("audio_s_per_s", "audio seconds/s")]),
                           ("latency", [("ttft_p50", "TTFT p50 (s)"), ("ttfa_p50", "TTFA p50 (s)")])):
        fig, axes = plt.subplots(1, len(panels), figsize=(12, 4.5))
        for ax, (metric, title) in zip(axes, panels):
            for r, style, label in runs:
                for w in workloads:
                    points = sorted((c["concurrency"], c[metric]) for c in r["cells"]
                                    if c.get("workload") == w and c.get(metric) and c.get("status") == "ok")
                    if points:
                        ax.plot(*zip(*points), style, marker="o", color=colours[w], label=f"{w} {label}")
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
            ax.set_yscale("log")
            ax.set_xlabel("concurrency")
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = stem.with_name(f"{stem.name}-{suffix}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result")
    p.add_argument("baseline", nargs="?")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    result = results.read(args.result)
    baseline = results.read(args.baseline) if args.baseline else None
    stem = Path(args.result).with_suffix("")
    md = stem.with_suffix(".md")
    md.write_text(markdown(result, Path(args.result).name, baseline, Path(args.baseline).name if args.baseline else ""))
    written = [md]
    if not args.no_plots and any("workload" in c for c in result["cells"]):
        try:
            written += plot(result, baseline, stem)
        except ImportError:
            print("matplotlib is not installed: no plots")
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
