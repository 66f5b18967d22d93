"""bench.ab on a fake bench command (a Python one-liner writing one cell) in a git repository of two commits: the
variants alternated in fresh processes, a commit's variant run in its worktree, medians, spreads and ratios."""

import json
import subprocess
import sys

import pytest
import yaml

from bench import ab

# Writes one cell: tok/s from the variant's --set value and the round, frames/s from the tree's value.txt.
FAKE = ("import json, os, sys; s = float(sys.argv[sys.argv.index('--set') + 1].split('=')[1]); "
        "r = int(os.environ['AB_ROUND']); open(os.environ['ORDER'], 'a').write(os.environ['AB_VARIANT'] + chr(10)); "
        "json.dump({'cells': [{'stage': 'fake', 'batch': 1, 'tok_per_s': s * (10 + r), "
        "'frames_per_s': float(open('value.txt').read()), 'note': 'x'}]}, open(sys.argv[1], 'w'))")


def git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    for value in ("1", "2"):  # HEAD~1 holds 1, HEAD (and the working tree) 2
        (repo / "value.txt").write_text(value)
        git(repo, "add", "value.txt")
        git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", value)
    return repo


def test_variants_alternate_in_fresh_processes_and_a_commit_runs_in_its_worktree(repo, tmp_path, monkeypatch):
    order = tmp_path / "order.txt"
    monkeypatch.setenv("ORDER", str(order))
    spec = tmp_path / "fake.yaml"
    spec.write_text(yaml.safe_dump({"rounds": 2, "parts": {"fake": {
        "command": f'{sys.executable} -c "{FAKE}" {{out}}',
        "variants": {"a": {"set": ["x.scale=1"]}, "b": {"set": ["x.scale=3"], "commit": "HEAD~1"}}}}}, sort_keys=False))
    out = tmp_path / "out"
    result = ab.main([str(spec), "--out", str(out), "--repo", str(repo)])
    assert order.read_text().split() == ["a", "b", "a", "b"]
    runs = result["runs"]
    assert [(r["variant"], r["round"], r["rc"]) for r in runs] == [("a", 1, 0), ("b", 1, 0), ("a", 2, 0), ("b", 2, 0)]
    old = git(repo, "rev-parse", "HEAD~1")
    assert all(r["cwd"] == str(repo) and r["sha"] is None for r in runs if r["variant"] == "a")
    assert all(r["cwd"] == str(repo / ".cache" / "ab" / old[:12]) and r["sha"] == old for r in runs if r["variant"] == "b")
    assert runs[1]["command"].endswith(" --set x.scale=3") and runs[1]["output"]["cells"][0]["tok_per_s"] == 33
    cell = result["summary"]["fake"]
    a, b = cell["a"]["fake batch=1"], cell["b"]["fake batch=1"]
    assert a["tok_per_s"] == {"median": 11.5, "min": 11, "max": 12, "runs": 2, "ratio": 1.0}
    assert b["tok_per_s"] == {"median": 34.5, "min": 33, "max": 36, "runs": 2, "ratio": 3.0}
    assert a["frames_per_s"]["median"] == 2 and b["frames_per_s"]["median"] == 1 and b["frames_per_s"]["ratio"] == 0.5
    assert "note" not in a  # only the metrics bench.results names
    assert json.loads((out / "fake.json").read_text())["summary"] == result["summary"]
    # Run again into the same folder: every run ended 0, so none runs again.
    again = ab.main([str(spec), "--out", str(out), "--repo", str(repo)])
    assert order.read_text().split() == ["a", "b", "a", "b"] and again["summary"] == result["summary"]


def test_parts_merge_the_shared_variants(tmp_path):
    spec = tmp_path / "parts.yaml"
    spec.write_text(yaml.safe_dump({"timeout_s": 5, "variants": {"before": {"commit": "c0", "set": ["a.b=1"]}, "after": {}},
                                    "parts": {"one": {"command": "true {out}", "rounds": 3,
                                                      "variants": {"before": {"set": ["c.d=2"], "env": {"X": "1"}},
                                                                   "after": {"command": "false {out}"}}}}}, sort_keys=False))
    part = ab.load(spec)["one"]
    assert list(part["variants"]) == ["before", "after"] and part["rounds"] == 3 and part["timeout_s"] == 5
    assert part["variants"]["before"] == {"commit": "c0", "set": ["a.b=1", "c.d=2"], "env": {"X": "1"}}
    assert part["variants"]["after"] == {"command": "false {out}", "set": [], "env": {}}
    spec.write_text(yaml.safe_dump({"command": "true", "variants": {"a": {"sets": []}}}))
    with pytest.raises(SystemExit, match="unknown keys"):
        ab.load(spec)


def test_a_run_past_its_timeout_is_stopped(tmp_path):
    spec = tmp_path / "slow.yaml"
    spec.write_text(yaml.safe_dump({"rounds": 1, "timeout_s": 1, "command": "sleep 30 # {out}", "variants": {"only": {}}}))
    (run,) = ab.main([str(spec), "--out", str(tmp_path / "out")])["runs"]
    assert run["timed_out"] and run["rc"] != 0 and run["output"] is None and run["wall_s"] < 20
    with pytest.raises(SystemExit, match="no parts"):
        ab.main([str(spec), "--out", str(tmp_path / "out"), "--parts", "fast"])
