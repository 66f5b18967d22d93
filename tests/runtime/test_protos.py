"""The committed generated code is what the protos generate, and the public API stays language-neutral."""

import filecmp
import subprocess
import sys

from conftest import ROOT


def test_generated_code_is_current(tmp_path):
    subprocess.run([str(ROOT / "scripts" / "gen-protos"), str(tmp_path)], check=True, cwd=ROOT,
                   env={"PATH": f"{sys.prefix}/bin:/usr/bin:/bin"})
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*") if p.is_file())
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "omni").rglob("*.py*") if p.is_file() and "__pycache__" not in str(p))
    assert generated == committed
    stale = [str(p) for p in generated if not filecmp.cmp(tmp_path / p, ROOT / p, shallow=False)]
    assert not stale, f"run scripts/gen-protos: {stale}"


def test_public_api_options():
    text = (ROOT / "protos" / "omni" / "v1" / "omni.proto").read_text()
    for option in ("go_package", "java_package", "csharp_namespace"):
        assert f"option {option}" in text
    assert "python" not in text.lower()
