"""Joins result files of one sweep run in parallel parts (say the transformers cells of the text workloads on
GPU0 and of the speech ones on GPU1, at the same time) into one file, as `--resume` joins parts run one after
another: the same checks (engine, config and overrides, lengths and inputs, code, GPU model), no cell measured in
two files (one a file skipped gives way to the file that measured it, as `--resume` runs it again), every part's
run record kept.

    python -m bench.merge .cache/hf-text.json .cache/hf-speech.json --out bench/results/2xh200-hf.json
"""

import argparse
import copy

from bench import results
from bench.run import resumed


def merge(files: list[dict]) -> dict:
    merged = copy.deepcopy(files[0])
    for part in files[1:]:
        mine = {results.cell_key(c): c for c in merged["cells"]}
        theirs = {results.cell_key(c): c for c in part["cells"]}
        twice = [dict(k) for k in mine.keys() & theirs.keys() if "skipped" not in (mine[k]["status"], theirs[k]["status"])]
        if twice:
            raise SystemExit(f"cannot merge: cells measured in more than one file: {twice}")
        merged = resumed(merged, part)  # refuses a part that measures something else; keeps the run records
        merged["parts"] += part.get("parts", [])
        # A cell in both was skipped in one of them (or both): the one measured stays (both skipped: the later one).
        gone = {k for k in mine.keys() & theirs.keys() if mine[k]["status"] == "skipped"}
        merged["cells"] = [c for c in merged["cells"] if results.cell_key(c) not in gone]
        merged["cells"] += [c for k, c in theirs.items() if k not in mine or k in gone]
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
