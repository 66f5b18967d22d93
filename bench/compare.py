"""Prints two result files side by side, cell by cell: A, B and how many times better B is (>1: B better).

    python -m bench.compare bench/results/A.json bench/results/B.json [--metrics output_tok_per_s,ttft_p50]
"""

import argparse

from bench import results
from bench.report import fmt
from bench.results import METRICS, cell_key, key_label, ratio


def rows(a: dict, b: dict, metrics: list[str]) -> list[tuple[str, str, str, str, str]]:
    """(cell, metric, A, B, ratio) for every metric either side has, cells in A's order then B's extra ones."""
    cells_a = {cell_key(c): c for c in a["cells"]}
    cells_b = {cell_key(c): c for c in b["cells"]}
    out = []
    for key in list(cells_a) + [k for k in cells_b if k not in cells_a]:
        ca, cb = cells_a.get(key, {}), cells_b.get(key, {})
        for m in metrics:
            va, vb = ca.get(m), cb.get(m)
            if va is None and vb is None:
                continue
            r = ratio(vb, va, METRICS[m]) if m != "failures" else None
            out.append((key_label(key), m, fmt(m, va), fmt(m, vb), f"{r:.2f}x" if r is not None else "-"))
    return out


def main(argv=None) -> list[tuple]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--metrics", default="", help="comma-separated; default: every known metric")
    args = p.parse_args(argv)
    a, b = results.read(args.a), results.read(args.b)
    metrics = args.metrics.split(",") if args.metrics else list(METRICS)
    unknown = set(metrics) - set(METRICS)
    if unknown:
        p.error(f"unknown metrics {sorted(unknown)}; known: {', '.join(METRICS)}")
    table = rows(a, b, metrics)
    print(f"A: {args.a} ({a['engine']}, {a.get('git_commit', '')[:12]})\nB: {args.b} ({b['engine']}, {b.get('git_commit', '')[:12]})")
    header = ("cell", "metric", "A", "B", "B vs A")
    widths = [max(len(str(r[i])) for r in [header] + table) for i in range(5)]
    for r in [header] + table:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip())
    return table


if __name__ == "__main__":
    main()
