"""The attention projections of a decode step, cuBLAS (F.linear) against the Triton partial sums (triton_linear):
each weight shape of the thinker and the talker at 1, 8, 32 and 64 rows, timed as a CUDA graph of one call per copy
of the weight (enough copies that no call finds its weight in L2), with the largest difference from float32. The
tile sweep, at 32 rows: N tiles of 16-128 by K splits of 1-8, then warps and stages for the three fastest; the five
fastest and triton_linear's own choice then at every row count.

    python -m bench.linear --out bench/results/linear-1xh200-COMMIT.json
"""

import argparse
import itertools
import json

import torch

from bench import results
from bench.moe import graph_ms
from services.llm import triton_linear
from services.model.load import load_config

L2_BYTES = 256 << 20  # weight copies read per graph replay: several times an H200's L2


def graph_us(fn, calls: int, iters: int = 20) -> float:
    """Microseconds a call, `fn` making `calls` of them, replayed as a CUDA graph."""
    return 1000 * graph_ms(fn, iters) / calls


def shapes(model_dir: str | None) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the q/k/v and output projections, thinker and talker (the full-size config by default)."""
    cfg = load_config(model_dir)
    out = {}
    for name, t in (("thinker", cfg.thinker_config.text_config), ("talker", cfg.talker_config.text_config)):
        heads, kv, d = t.num_attention_heads, t.num_key_value_heads, t.head_dim
        out[f"{name}.qkv"] = ((heads + 2 * kv) * d, t.hidden_size)
        out[f"{name}.o"] = (t.hidden_size, heads * d)
    return out


def measure(n: int, k: int, rows: list[int], configs: list[dict], dev) -> dict:
    copies = max(2, -(-L2_BYTES // (n * k * 2)))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    cell = {"N": n, "K": k, "copies": copies, "rows": {}}
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ ws[0].float().t()
        cublas = graph_us(lambda: [torch.nn.functional.linear(x, w) for w in ws], copies)
        err = (torch.nn.functional.linear(x, ws[0]).float() - ref).abs().max().item()
        got = {"cublas_us": cublas, "cublas_err": err, "gb_per_s_cublas": n * k * 2 / cublas / 1e3, "triton": []}
        for cfg in configs:
            if k % (cfg["split"] * cfg["BLOCK_K"]):
                continue
            try:
                out = triton_linear.partials(x, ws[0], cfg).sum(0)
                us = graph_us(lambda: [triton_linear.partials(x, w, cfg) for w in ws], copies)
            except Exception as e:  # a shape past the GPU's shared memory: recorded, not fatal
                got["triton"].append({**cfg, "error": str(e)[:200]})
                continue
            got["triton"].append({**cfg, "us": us, "err": (out - ref).abs().max().item()})
        cell["rows"][m] = got
    return cell


def ranked(cell: dict, key_rows: int | None = None) -> list[tuple[float, dict]]:
    """Configs by time at `key_rows` rows, or summed over the row counts."""
    totals = {}
    for m, got in cell["rows"].items():
        if key_rows is not None and int(m) != key_rows:
            continue
        for t in got["triton"]:
            if "us" in t:
                key = json.dumps({k: v for k, v in t.items() if k not in ("us", "err")}, sort_keys=True)
                totals[key] = totals.get(key, 0.0) + t["us"]
    return [(us, json.loads(key)) for key, us in sorted(totals.items(), key=lambda kv: kv[1])]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model folder whose config.json gives the shapes (default: the real sizes)")
    p.add_argument("--rows", default="1,8,32,64")
    p.add_argument("--only", default="", help="comma-separated shape names (default: all)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    key = 32 if 32 in rows else rows[-1]
    sweep = [dict(split=s, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=4)
             for bn, s, bk in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (128, 256))]
    result = results.new_result("linear", {"rows": rows, "key_rows": key}, {}, {"argv": argv})
    for name, (n, k) in shapes(args.model).items():
        if args.only and name not in args.only.split(","):
            continue
        # Every shape at `key` rows, then warps and stages for its three fastest, then the five fastest of all those
        # (and the default) at every row count.
        cell = measure(n, k, [key], sweep, dev)
        top = [cfg for _, cfg in ranked(cell, key)[:3]]
        more = [dict(c, num_warps=w, num_stages=s) for c in top for w, s in itertools.product((2, 4, 8), (3, 4, 5, 6))
                if (w, s) != (4, 4)]
        cell["rows"][key]["triton"] += measure(n, k, [key], more, dev)["rows"][key]["triton"]
        final = [cfg for _, cfg in ranked(cell, key)[:5]] + [triton_linear.tiles(n, k)]
        sweep_key = cell["rows"].pop(key)
        cell = measure(n, k, rows, final, dev)
        cell.update(name=name, sweep={key: sweep_key}, default=triton_linear.tiles(n, k))
        best = {m: ranked(cell, m)[0] for m in rows}
        cell["best"] = {m: {"us": us, **cfg} for m, (us, cfg) in best.items()}
        cell["best_overall"] = ranked(cell)[0][1]
        result["cells"].append(cell)
        for m in rows:
            got = cell["rows"][m]
            default = next((t for t in got["triton"] if {k2: t[k2] for k2 in cell["default"]} == cell["default"]), {})
            print(f"{name} N={n} K={k} rows={m}: cublas {got['cublas_us']:.2f} us (err {got['cublas_err']:.3g}), "
                  f"default {default.get('us', 0):.2f} us, best {best[m][0]:.2f} us {best[m][1]} (err "
                  f"{max(t.get('err', 0) for t in got['triton']):.3g})", flush=True)
        print(f"{name}: best over all rows {cell['best_overall']}", flush=True)
        if args.out:
            results.write(result, args.out)


if __name__ == "__main__":
    main()
