"""The mesh config is typed, composed from a base and overlays, checked when loaded, and documented."""

import dataclasses
import typing

import pytest
import yaml

from conftest import ROOT
from services.runtime import config, config_docs
from services.runtime.config import ConfigError, load_config


def write(tmp_path, data, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def base():
    return {"model": {"path": "x"}, "gateway": {"replicas": [{"port": 1, "metrics_port": 2}]},
            "preprocess": {"replicas": [{"port": 3, "metrics_port": 4}]}, "encoder": {"replicas": [{"port": 5, "metrics_port": 6}]},
            "thinker": {"replicas": [{"port": 7, "metrics_port": 8}]}}


def test_shipped_configs_load():
    paths = sorted(p for p in (ROOT / "configs").glob("*.yaml") if not p.stem.endswith("-base"))
    assert {"local.yaml", "2xh200.yaml", "bench-2xh200.yaml", "bench-1xh200-mesh.yaml"} <= {p.name for p in paths}
    for path in paths:
        cfg = load_config(path)
        assert cfg.thinker.replicas and cfg.gateway.replicas, path.name


def test_the_gpu_configs_compose_from_one_base():
    """The deployment and the benchmark meshes share the H200 base's settings; the one-GPU and two-thinker meshes
    are small overlays of the benchmark's, their replicas where they say."""
    deploy, bench = load_config(ROOT / "configs" / "2xh200.yaml"), load_config(ROOT / "configs" / "bench-2xh200.yaml")
    one = load_config(ROOT / "configs" / "bench-1xh200-mesh.yaml")
    two = load_config(ROOT / "configs" / "bench-2xh200-two-thinkers.yaml")
    for cfg in (deploy, bench, one, two):
        assert (cfg.thinker.fp8, cfg.thinker.kv_blocks, cfg.preprocess.workers) == ("channel", 16384, 8)
        assert cfg.transport.pool_bytes == 1 << 30
    assert deploy.model.load_format == "auto" and bench.model.load_format == "random" == one.model.load_format
    assert [r.device for r in one.encoder.replicas] == ["cuda:0"] and one.talker.replicas[0].device == "cuda:0"
    assert one.talker.kv_blocks == 4096 and bench.talker.kv_blocks == 0
    assert [r.device for r in two.thinker.replicas] == ["cuda:0", "cuda:1"] and two.encoder == bench.encoder


@pytest.mark.parametrize("change, message", [
    (lambda c: c["model"].update(pathh="y"), "unknown key"),
    (lambda c: c["model"].update(dtype="float64"), "not one of"),
    (lambda c: c["thinker"]["replicas"][0].update(port="80"), "expected int"),
    (lambda c: c["thinker"]["replicas"][0].update(port=1), "already used"),
    (lambda c: c["thinker"].update(replicas=[]), "at least one replica"),
    (lambda c: c["encoder"]["replicas"][0].update(prefer_for=["video"]), "not one of"),
    (lambda c: c.update(limits={"max_new_tokens": True}), "expected int"),
    (lambda c: c["model"].update(path=""), "model.path is required"),
    (lambda c: c["thinker"].update(fp8="tile"), "not one of"),
    (lambda c: c["thinker"].update(block_size=0), "must be positive"),
    (lambda c: c.update(talker={"chunks": [4, 0]}), "talker.chunks must be positive"),
    (lambda c: c.update(talker={"chunks": []}), "talker.chunks must be positive"),
    (lambda c: c.update(preprocess={**c["preprocess"], "workers": 0}), "preprocess.workers"),
])
def test_mistakes_are_named(tmp_path, change, message):
    data = base()
    change(data)
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, data))


def test_random_weights_need_no_checkpoint(tmp_path):
    data = base()
    data["model"] = {"load_format": "random"}
    assert load_config(write(tmp_path, data)).model.dir is None


def test_overrides_apply_on_top_of_the_file_and_are_checked(tmp_path):
    path = write(tmp_path, {**base(), "model": {"load_format": "random"}})
    cfg = load_config(path, ["thinker.engine=reference", "thinker.cuda_graph_max_batch=32", "model.dtype=float32"])
    assert (cfg.thinker.engine, cfg.thinker.cuda_graph_max_batch, cfg.model.dtype) == ("reference", 32, "float32")
    with pytest.raises(ConfigError, match="cuda_graph_max_batch"):
        load_config(path, ["thinker.cuda_graph_max_batch=many"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(path, ["thinker.engine"])
    # A bare off is a bool to YAML: where the setting's choices are words, it means the word.
    assert load_config(path, ["thinker.fp8=off"]).thinker.fp8 == "off"
    assert load_config(path, ["thinker.fp8=channel"]).thinker.fp8 == "channel"
    with pytest.raises(ConfigError, match="not one of"):
        load_config(path, ["thinker.fp8=on"])


def test_a_config_extends_another_section_by_section(tmp_path):
    """Its keys over the base's: mappings merged key by key, lists (replicas, chunks) replaced whole; a base named
    relative to the file; a file extending itself, or a base that is not there, named."""
    (tmp_path / "sub").mkdir()
    write(tmp_path, {**base(), "thinker": {**base()["thinker"], "kv_blocks": 7, "fp8": "channel"},
                     "talker": {"chunks": [2, 4]}}, "base.yaml")
    path = write(tmp_path / "sub", {"extends": "../base.yaml", "thinker": {"kv_blocks": 9},
                                    "encoder": {"replicas": [{"port": 11, "metrics_port": 12, "device": "cuda:1"}]},
                                    "talker": {"chunks": [8]}})
    cfg = load_config(path)
    assert (cfg.thinker.kv_blocks, cfg.thinker.fp8, cfg.thinker.replicas[0].port) == (9, "channel", 7)
    assert [r.port for r in cfg.encoder.replicas] == [11] and cfg.talker.chunks == [8]
    assert load_config(path, ["thinker.kv_blocks=3"]).thinker.kv_blocks == 3
    write(tmp_path, {"extends": "b.yaml"}, "a.yaml")
    write(tmp_path, {"extends": "a.yaml"}, "b.yaml")
    with pytest.raises(ConfigError, match="extends itself"):
        load_config(tmp_path / "a.yaml")
    with pytest.raises(FileNotFoundError):
        load_config(write(tmp_path, {"extends": "missing.yaml"}, "d.yaml"))


def test_a_launched_mesh_gets_the_config_whole(tmp_path):
    """write_overridden resolves `extends:` and the overrides into one file the stages read as it is."""
    write(tmp_path, base(), "base.yaml")
    path = write(tmp_path, {"extends": "base.yaml", "thinker": {"kv_blocks": 9}}, "over.yaml")
    out = config.write_overridden(path, ["thinker.overlap=false"], tmp_path / "out" / "whole.yaml")
    data = yaml.safe_load(out.read_text())
    assert "extends" not in data and data["thinker"]["kv_blocks"] == 9 and data["thinker"]["overlap"] is False
    assert load_config(out).thinker.replicas[0].port == 7


def test_every_field_says_what_it_does():
    hints = typing.get_type_hints(config.MeshConfig)
    sections = [config.Replica] + [hints[f.name] for f in dataclasses.fields(config.MeshConfig)]
    for cls in sections:
        docs = config_docs.field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if f.name != "replicas" and not docs.get(f.name)]
        assert not missing, (cls.__name__, missing)


def test_the_configuration_reference_is_current():
    assert (ROOT / "docs" / "config.md").read_text() == config_docs.reference(), \
        "docs/config.md is stale: python -m services.runtime.config_docs > docs/config.md"
