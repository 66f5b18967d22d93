"""Joins result files of one sweep run in parallel parts (say text workloads on GPU0, speech on GPU1) into one
file, as `bench.run --resume` joins parts run one after another: the same checks (engine, config, lengths, inputs,
code, GPU model), no cell measured in two files (a skipped one gives way), every part's run record kept.

    python -m bench.merge .cache/hf-text.json .cache/hf-speech.json --out bench/results/2xh200-hf.json
"""

import argparse
import copy

from bench import results

# What every part of a resumed sweep must share with the first: the same engine, deployment and overrides, lengths
# and inputs, on the same code and the same kind of machine.
SAME_ACROSS_PARTS = ("max_tokens", "frames", "prompt_bytes", "image_size", "clip_seconds", "video_seconds", "video_size",
                     "distinct_inputs", "seed", "min_requests", "requests_per_slot", "warmup_rounds", "warmup_length", "engine")


def resumed(prior: dict, fresh: dict) -> dict:
    """`prior` (a file an earlier part wrote) carried on by the part `fresh` describes: its cells kept, the
    earlier parts' run records kept under `parts`. Refuses a part that would not measure the same thing."""
    differs = [k for k in SAME_ACROSS_PARTS if prior["run"]["args"].get(k) != fresh["run"]["args"].get(k)]
    if prior["engine"] != fresh["engine"]:
        differs.append("engine")
    if prior["config"]["content"] != fresh["config"]["content"]:
        differs.append("config (file or --set overrides)")
    if prior.get("source_digest") != fresh.get("source_digest"):
        differs.append("code (source_digest)")
    if [g["name"] for g in prior["machine"].get("gpus", [])] != [g["name"] for g in fresh["machine"].get("gpus", [])]:
        differs.append("GPUs")
    if differs:
        raise SystemExit(f"cannot resume {fresh['run']['args']['out']}: this part differs from the file's in "
                         f"{', '.join(dict.fromkeys(differs))}; write a new file instead")
    prior["parts"] = prior.get("parts", []) + [prior["run"]]
    prior["run"] = fresh["run"]
    return prior


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
