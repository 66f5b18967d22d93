"""Joins result files of one sweep run in parallel parts (say the transformers cells of the text workloads on
GPU0 and of the speech ones on GPU1, at the same time) into one file, as `--resume` joins parts run one after
another: the same checks (engine, config and overrides, lengths and inputs, code, GPU model), no cell in two
files, every part's run record kept.

    python -m bench.merge .cache/hf-text.json .cache/hf-speech.json --out bench/results/2xh200-hf.json
"""

import argparse
import copy

from bench import results
from bench.run import resumed


def merge(files: list[dict]) -> dict:
    merged = copy.deepcopy(files[0])
    seen = {results.cell_key(c) for c in merged["cells"]}
    for part in files[1:]:
        twice = [dict(k) for k in (results.cell_key(c) for c in part["cells"]) if k in seen]
        if twice:
            raise SystemExit(f"cannot merge: cells in more than one file: {twice}")
        merged = resumed(merged, part)  # refuses a part that measures something else; keeps the run records
        merged["parts"] += part.get("parts", [])
        merged["cells"] += part["cells"]
        seen |= {results.cell_key(c) for c in part["cells"]}
    return merged


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    merged = merge([results.read(f) for f in args.files])
    results.write(merged, args.out)
    print(f"wrote {args.out} ({len(merged['cells'])} cells from {len(args.files)} files)")
    return merged


if __name__ == "__main__":
    main()
