"""A/B runs from one declarative file: named variants of bench commands, alternated in fresh processes, one JSON.

    python -m bench.ab bench/ab/consolidation.yaml [--out DIR] [--rounds N] [--parts a,b] [--prepare]

    rounds: 2                          # runs of each variant, alternated A B A B ... (default 2)
    timeout_s: 600                     # a run's wall-clock limit (default: none)
    share: [.cache/qwen3-omni-full]    # ignored paths of this tree linked into each commit's worktree
    variants:                          # shared by every part (optional)
      before: {commit: 4be900e}
      after: {commit: HEAD}
    parts:                             # or, for one part, `command` and `variants` at the top
      thinker-bf16:
        command: python3 -m bench.stages --config configs/bench-1xh200-mesh.yaml --stages thinker --out {out}
        variants:                      # merged over the shared ones by name: `set` and `env` added, the rest replaced
          before: {set: [thinker.fp8_experts=off]}
          after: {set: [thinker.fp8=off]}

A variant has `set` (overrides, appended to the command as `--set X`), `commit` (a commit or ref: the command runs
in `.cache/ab/SHA`, a worktree of it made once, so each side runs its own tree's code and harness), `tree` (a folder
holding another tree, relative to the repository: a commit exported where there is no git), `command` (in
place of the part's: an old commit's harness may take other flags) and `env`. `{out}` in a command is the JSON path
the runner gives the run; AB_PART, AB_VARIANT and AB_ROUND are in its environment. DIR/NAME.json holds every run
(its output loaded inline) and, per part, variant and cell, the median, min and max of each metric bench.results
names, and the ratio of the median to the first variant's. A run that ended 0 is not run again when the file is
run again into the same DIR: a file longer than one sitting runs in several calls.
"""

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

from bench.results import METRICS, cell_key, key_label, write

REPO_ROOT = Path(__file__).resolve().parents[1]
VARIANT_KEYS = {"set", "commit", "tree", "command", "env"}


def load(path: Path) -> dict:
    """The file's parts: name -> {command, rounds, timeout_s, variants: name -> variant}, the shared keys applied."""
    spec = yaml.safe_load(path.read_text())
    parts = spec.get("parts") or {path.stem: {k: spec[k] for k in ("command", "variants") if k in spec}}
    shared = spec.get("variants") if "parts" in spec else {}
    out = {}
    for name, part in parts.items():
        variants = {}
        for v, fields in [*(shared or {}).items(), *(part.get("variants") or {}).items()]:
            fields = fields or {}
            if set(fields) - VARIANT_KEYS:
                raise SystemExit(f"{path}: {name}.{v}: unknown keys {sorted(set(fields) - VARIANT_KEYS)}; known: {sorted(VARIANT_KEYS)}")
            old = variants.get(v, {})
            variants[v] = {**old, **fields, "set": [*old.get("set", []), *fields.get("set", [])],
                           "env": {**old.get("env", {}), **fields.get("env", {})}}
        if not variants:
            raise SystemExit(f"{path}: part {name} has no variants")
        if missing := [v for v, f in variants.items() if not (f.get("command") or part.get("command") or spec.get("command"))]:
            raise SystemExit(f"{path}: {name}: no command for {missing}")
        out[name] = {"command": part.get("command", spec.get("command")), "variants": variants,
                     "rounds": part.get("rounds", spec.get("rounds", 2)), "timeout_s": part.get("timeout_s", spec.get("timeout_s")),
                     "share": spec.get("share", [])}
    return out


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def worktree(repo: Path, ref: str, share: list[str]) -> tuple[Path, str]:
    """A worktree of `ref` at .cache/ab/SHA (made once), with the `share` paths of `repo` linked into it."""
    sha = git(repo, "rev-parse", "--verify", f"{ref}^{{commit}}")
    path = repo / ".cache" / "ab" / sha[:12]
    if not path.exists():
        git(repo, "worktree", "add", "--detach", str(path), sha)
    link_shared(repo, path, share)
    return path, sha


def link_shared(repo: Path, path: Path, share: list[str]) -> None:
    """The `share` paths of `repo` linked into the tree at `path`: the model folder, kernel caches, ignored paths
    each tree expects in its own root."""
    for rel in share:
        link, src = path / rel, repo / rel
        if src.exists() and not os.path.lexists(link):
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(src, link.parent))


def run_one(command: str, cwd: Path, env: dict, log: Path, timeout: float | None) -> tuple[int, bool]:
    """`command` through bash in a session of its own; past `timeout` the session gets SIGINT (a launched mesh stops
    its stages), then SIGKILL 30 s later. (exit status, timed out)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                    return proc.wait(timeout=wait), True
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            return proc.wait(), True


def summarize(parts: dict, runs: list[dict]) -> dict:
    """part -> variant -> cell -> metric -> {median, min, max, runs, ratio (to the first variant's median)}."""
    summary = {}
    for name, part in parts.items():
        values: dict = {}  # variant -> cell -> metric -> [value of each run]
        for r in runs:
            if r["part"] != name or not r.get("output"):
                continue
            for cell in r["output"].get("cells", []):
                if cell.get("status", "ok") != "ok":
                    continue
                label = key_label(cell_key(cell)) or "all"
                for m in METRICS:
                    if isinstance(cell.get(m), (int, float)) and not isinstance(cell[m], bool):
                        values.setdefault(r["variant"], {}).setdefault(label, {}).setdefault(m, []).append(cell[m])
        stats = {v: {c: {m: {"median": statistics.median(x), "min": min(x), "max": max(x), "runs": len(x)}
                         for m, x in ms.items()} for c, ms in cells.items()} for v, cells in values.items()}
        first = stats.get(next(iter(part["variants"])), {})
        for cells in stats.values():
            for c, ms in cells.items():
                for m, s in ms.items():
                    base = first.get(c, {}).get(m, {}).get("median")
                    s["ratio"] = s["median"] / base if base else None
        summary[name] = stats
    return summary


def report(summary: dict) -> None:
    for part, stats in summary.items():
        print(f"\n## {part}: " + " / ".join(stats) + " (median [min-max], ratio to the first)")
        for cell in dict.fromkeys(c for cells in stats.values() for c in cells):
            for m in dict.fromkeys(m for cells in stats.values() for m in cells.get(cell, {})):
                print(f"{cell:28s} {m:18s} " + "  ".join(f"{v} {s['median']:.4g} [{s['min']:.4g}-{s['max']:.4g}] "
                      f"{s['ratio'] or 0:.3f}x" if (s := cells.get(cell, {}).get(m)) else f"{v} -" for v, cells in stats.items()))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file")
    p.add_argument("--out", default="", help="folder for the runs' files and NAME.json (default .cache/ab/out/NAME)")
    p.add_argument("--rounds", type=int, default=None, help="in place of each part's rounds")
    p.add_argument("--parts", default="", help="comma-separated: only these parts")
    p.add_argument("--repo", default=str(REPO_ROOT), help="the repository whose commits variants name")
    p.add_argument("--prepare", action="store_true", help="only make the worktrees (to carry them where git is not)")
    args = p.parse_args(argv)
    path, repo = Path(args.file), Path(args.repo).resolve()
    every = load(path)
    if unknown := set(filter(None, args.parts.split(","))) - set(every):
        raise SystemExit(f"{path} has no parts {sorted(unknown)}; it has {', '.join(every)}")
    parts = {k: v for k, v in every.items() if not args.parts or k in args.parts.split(",")}
    out = Path(args.out or repo / ".cache" / "ab" / "out" / path.stem).resolve()
    out.mkdir(parents=True, exist_ok=True)
    record = out / f"{path.stem}.json"
    result = {"file": str(path), "parts": every, "runs": []}
    if record.exists():  # runs an earlier call finished are kept, not run again
        result["runs"] = [r for r in json.loads(record.read_text())["runs"] if r["rc"] == 0]
    done = {(r["part"], r["variant"], r["round"], r["command"]) for r in result["runs"]}
    for name, part in parts.items():
        for rnd in range(1, (args.rounds or part["rounds"]) + 1):
            for v, fields in part["variants"].items():
                cwd, sha = worktree(repo, fields["commit"], part["share"]) if fields.get("commit") else (repo, None)
                if fields.get("tree"):
                    cwd = (repo / fields["tree"]).resolve()
                    link_shared(repo, cwd, part["share"])
                if args.prepare:
                    continue
                stem = f"{name}-{v}-r{rnd}"
                command = (fields.get("command") or part["command"]).replace("{out}", str(out / f"{stem}.json"))
                command += "".join(f" --set {shlex.quote(s)}" for s in fields["set"])
                if (name, v, rnd, command) in done:
                    continue
                (out / f"{stem}.json").unlink(missing_ok=True)
                env = {**os.environ, **{k: str(x) for k, x in fields["env"].items()}, "AB_PART": name, "AB_VARIANT": v,
                       "AB_ROUND": str(rnd)}
                print(f"[{datetime.now(timezone.utc):%H:%M:%S}] {stem}: {command}  (in {cwd})", flush=True)
                t0 = time.perf_counter()
                rc, timed_out = run_one(command, cwd, env, out / f"{stem}.log", part["timeout_s"])
                wall = time.perf_counter() - t0
                output = json.loads((out / f"{stem}.json").read_text()) if (out / f"{stem}.json").exists() else None
                result["runs"].append({"part": name, "variant": v, "round": rnd, "command": command, "commit": fields.get("commit"),
                                       "sha": sha, "cwd": str(cwd), "env": fields["env"], "rc": rc, "timed_out": timed_out,
                                       "wall_s": wall, "log": str(out / f"{stem}.log"), "output": output})
                print(f"  rc {rc}{' (timed out)' if timed_out else ''} in {wall:.0f} s", flush=True)
                result["summary"] = summarize(every, result["runs"])
                write(result, record)
    result["summary"] = summarize(every, result["runs"])
    if not args.prepare:
        write(result, record)
        report(result["summary"])
        print(f"\nwrote {record}")
    return result


if __name__ == "__main__":
    main()
