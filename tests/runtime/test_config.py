"""The mesh config is typed and checked when loaded."""

import pytest
import yaml

from conftest import ROOT
from services.runtime.config import ConfigError, load_config


def write(tmp_path, data) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def base():
    return {"model": {"path": "x"}, "gateway": {"replicas": [{"port": 1, "metrics_port": 2}]},
            "preprocess": {"replicas": [{"port": 3, "metrics_port": 4}]}, "encoder": {"replicas": [{"port": 5, "metrics_port": 6}]},
            "thinker": {"replicas": [{"port": 7, "metrics_port": 8}]}}


def test_shipped_configs_load():
    paths = sorted((ROOT / "configs").glob("*.yaml"))
    assert {"local.yaml", "2xh200.yaml", "bench-2xh200.yaml"} <= {p.name for p in paths}
    for path in paths:
        cfg = load_config(path)
        assert cfg.thinker.replicas and cfg.gateway.replicas, path.name


@pytest.mark.parametrize("change, message", [
    (lambda c: c["model"].update(pathh="y"), "unknown key"),
    (lambda c: c["model"].update(dtype="float64"), "not one of"),
    (lambda c: c["thinker"]["replicas"][0].update(port="80"), "expected int"),
    (lambda c: c["thinker"]["replicas"][0].update(port=1), "already used"),
    (lambda c: c["thinker"].update(replicas=[]), "at least one replica"),
    (lambda c: c["encoder"]["replicas"][0].update(prefer_for=["video"]), "not one of"),
    (lambda c: c["limits"].update(max_new_tokens=True) if "limits" in c else c.update(limits={"max_new_tokens": True}), "expected int"),
    (lambda c: c["model"].update(path=""), "model.path is required"),
    (lambda c: c.setdefault("transport", {}).update(cross_gpu_read="push"), "not one of"),
    (lambda c: c.setdefault("talker", {}).update(code2wav_native=True, code2wav_fuse=True), "leave talker.code2wav_fuse off"),
    (lambda c: c["thinker"].update(decode_graph_copies=0), "decode_graph_copies must be at least 1"),
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
    from services.runtime.config import ConfigError, load_config

    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"model": {"load_format": "random"}, "gateway": {"replicas": [{"port": 1, "metrics_port": 2}]},
                                    "preprocess": {"replicas": [{"port": 3, "metrics_port": 4}]},
                                    "encoder": {"replicas": [{"port": 5, "metrics_port": 6}]},
                                    "thinker": {"replicas": [{"port": 7, "metrics_port": 8}]}}))
    cfg = load_config(path, ["thinker.engine=native", "thinker.cuda_graph_max_batch=32", "model.dtype=bfloat16"])
    assert (cfg.thinker.engine, cfg.thinker.cuda_graph_max_batch, cfg.model.dtype) == ("native", 32, "bfloat16")
    with pytest.raises(ConfigError, match="cuda_graph_max_batch"):
        load_config(path, ["thinker.cuda_graph_max_batch=many"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(path, ["thinker.engine"])
    # A bare off is a bool to YAML: where the setting's choices are words, it means the word (the bf16 half
    # of scripts/thinker-2xh200 once failed on `--set thinker.fp8_experts=off`).
    assert load_config(path, ["thinker.fp8_experts=channel"]).thinker.fp8_experts == "channel"
    assert load_config(path, ["thinker.fp8_experts=off"]).thinker.fp8_experts == "off"
    with pytest.raises(ConfigError, match="True is not one of"):
        load_config(path, ["thinker.fp8_experts=on"])


def test_fp8_activations_need_fp8_experts(tmp_path):
    c = base()
    c["thinker"]["fp8_activations"] = True
    with pytest.raises(ConfigError, match="thinker.fp8_activations needs fp8 experts"):
        load_config(write(tmp_path, c))
    c["thinker"]["fp8_experts"] = "channel"
    assert load_config(write(tmp_path, c)).thinker.native_args["fp8_activations"] is True
    c["talker"] = {"fp8_experts": "channel", "fp8_fused_quant": True}  # quantises what is not fp8
    with pytest.raises(ConfigError, match="talker.fp8_fused_quant quantises the experts' fp8 activations"):
        load_config(write(tmp_path, c))
    c["talker"]["fp8_activations"] = True
    assert load_config(write(tmp_path, c)).talker.native_args["fp8_fused_quant"] is True


def test_unsplit_decode_attention_needs_the_tensor_core_kernels(tmp_path):
    c = base()
    c["talker"] = {"decode_split_kv_max_batch": 16, "decode_tensor_cores": False}
    with pytest.raises(ConfigError, match="talker.decode_split_kv_max_batch needs talker.decode_tensor_cores"):
        load_config(write(tmp_path, c))
    c["talker"]["decode_tensor_cores"] = True
    assert load_config(write(tmp_path, c)).talker.native_args["decode_split_kv_max_batch"] == 16


def test_direct_decode_plans_are_the_thinkers_default_and_only_for_the_tensor_core_kernels(tmp_path):
    cfg = load_config(write(tmp_path, base()))
    assert cfg.thinker.native_args["decode_direct_plan"] is True
    assert cfg.talker.native_args["decode_direct_plan"] is False  # off until measured
    c = base()
    c["thinker"] = {**c["thinker"], "decode_tensor_cores": False}  # the CUDA-core kernel plans through the wrapper
    assert load_config(write(tmp_path, c)).thinker.native_args["decode_direct_plan"] is False
    c["talker"] = {**c.get("talker", {}), "decode_direct_plan": True}
    assert load_config(write(tmp_path, c)).talker.native_args["decode_direct_plan"] is True


def test_polled_waits_are_off_by_default_and_each_engines_choice(tmp_path):
    cfg = load_config(write(tmp_path, base()))
    assert cfg.thinker.native_args["spin_wait"] is False and cfg.talker.native_args["spin_wait"] is False
    c = base()
    c["thinker"] = {**c["thinker"], "spin_wait": True}
    c["talker"] = {**c.get("talker", {}), "spin_wait": True}
    cfg = load_config(write(tmp_path, c))
    assert cfg.thinker.native_args["spin_wait"] is True and cfg.talker.native_args["spin_wait"] is True


def test_encoder_graphs_need_varlen_attention(tmp_path):
    c = base()
    c["encoder"].update(graphs=True, attention="sdpa")
    with pytest.raises(ConfigError, match="encoder.graphs needs encoder.attention: varlen"):
        load_config(write(tmp_path, c))
    c["encoder"]["attention"] = "varlen"
    assert load_config(write(tmp_path, c)).encoder.graphs is True


def test_the_one_gpu_mesh_config_differs_from_the_benchmark_one_only_in_its_devices():
    """bench-1xh200-mesh.yaml is bench-2xh200.yaml on one GPU (a session lent one): every stage on cuda:0, one
    encoder for both kinds of output, the talker's KV cache sized by hand; nothing else may drift."""
    import dataclasses

    two = dataclasses.asdict(load_config(ROOT / "configs" / "bench-2xh200.yaml"))
    one = dataclasses.asdict(load_config(ROOT / "configs" / "bench-1xh200-mesh.yaml"))
    assert [r["device"] for r in two["encoder"].pop("replicas")] == ["cuda:0", "cuda:1"]
    assert [(r["device"], sorted(r["prefer_for"])) for r in one["encoder"].pop("replicas")] == [("cuda:0", ["audio", "text"])]
    for stage in ("thinker", "talker"):
        assert [r["device"] for r in one[stage].pop("replicas")] == ["cuda:0"]
        two[stage].pop("replicas")
    assert one["talker"].pop("kv_blocks") == 4096 and two["talker"].pop("kv_blocks") == 0  # not half the shared GPU
    assert one == two


def test_the_two_thinker_config_differs_from_the_benchmark_one_only_where_it_means_to():
    """bench-2xh200-two-thinkers.yaml is a copy of bench-2xh200.yaml for an A/B: a copy that drifted would
    measure more than the second thinker."""
    import dataclasses

    one = dataclasses.asdict(load_config(ROOT / "configs" / "bench-2xh200.yaml"))
    two = dataclasses.asdict(load_config(ROOT / "configs" / "bench-2xh200-two-thinkers.yaml"))
    assert len(two["thinker"].pop("replicas")) == 2 and len(one["thinker"].pop("replicas")) == 1
    assert two["talker"].pop("kv_blocks") == 16384 and one["talker"].pop("kv_blocks") == 0
    assert one == two


def test_kept_plans_and_mapped_io_are_the_thinkers_defaults_and_each_turns_off(tmp_path):
    cfg = load_config(write(tmp_path, base()))
    assert cfg.thinker.native_args["decode_keep_plans"] is True and cfg.thinker.native_args["decode_mapped_io"] is True
    assert cfg.talker.native_args["decode_keep_plans"] is False and "decode_mapped_io" not in cfg.talker.native_args
    assert cfg.thinker.native_args["decode_hashed_noise"] is False  # off until measured
    c = base()
    c["thinker"] = {**c["thinker"], "decode_keep_plans": False, "decode_mapped_io": False}
    args = load_config(write(tmp_path, c)).thinker.native_args
    assert args["decode_keep_plans"] is False and args["decode_mapped_io"] is False
