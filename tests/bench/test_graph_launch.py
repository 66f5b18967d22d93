"""bench.graph_launch's reading of a graph's DOT (the launches themselves are timed on the H200)."""

import pytest

from bench.graph_launch import dot_summary


def node(g: int, i: int, kind: str) -> str:
    # cudaGraphDebugDotPrint's verbose form: a record label over several lines, the type among its fields
    return (f'"graph_{g}_node_{i}"[style="solid" shape="record" label="{{\n{kind}\n| {{ID | {i} | {i}}}\n'
            f'| {{kernel_name | void add_kernel[abi:cxx11](float*)}}\n}}"];\n')


def edge(g: int, a: int, b: int) -> str:
    return f'"graph_{g}_node_{a}" -> "graph_{g}_node_{b}" [style="solid" label="{a}->{b}"];\n'


def test_a_chain_of_kernels_is_a_straight_line():
    text = "digraph dot {\nsubgraph cluster_1 {\nlabel=\"graph_1\" graph[style=\"dashed\"];\n"
    text += "".join(node(1, i, "KERNEL") for i in range(5)) + "".join(edge(1, i, i + 1) for i in range(4)) + "}\n}\n"
    assert dot_summary(text) == {"nodes": 5, "edges": 4, "by_type": {"KERNEL": 5}, "straight_line": True,
                                 "max_in": 1, "max_out": 1}


def test_a_fork_and_join_is_not():
    # 0 -> 1 -> 3 and 0 -> 2 -> 3: a second stream's kernel beside the first's, joined after
    text = "".join(node(2, i, k) for i, k in enumerate(["KERNEL", "KERNEL", "MEMSET", "KERNEL"]))
    text += edge(2, 0, 1) + edge(2, 0, 2) + edge(2, 1, 3) + edge(2, 2, 3)
    got = dot_summary(text)
    assert got["nodes"] == 4 and got["edges"] == 4 and got["by_type"] == {"KERNEL": 3, "MEMSET": 1}
    assert not got["straight_line"] and got["max_in"] == 2 and got["max_out"] == 2
    assert list(got["copies"].values()) == [1] and "MEMSET" in next(iter(got["copies"])), got


def test_copies_differing_only_by_address_count_as_one_kind():
    def memcpy(i: int, src: str, size: int) -> str:
        return (f'"graph_3_node_{i}"[style="solid" shape="record" label="{{\nMEMCPY\n| {{ID | {i} | {i}}}\n'
                f'| {{kind | DeviceToDevice}} | {{src | {src}}} | {{bytes | {size}}}\n}}"];\n')
    text = memcpy(0, "0x7f00aa000000", 256) + memcpy(1, "0x7f00bb000400", 256) + memcpy(2, "0x7f00aa000000", 512)
    text += edge(3, 0, 1) + edge(3, 1, 2)
    copies = dot_summary(text)["copies"]
    assert sorted(copies.values()) == [1, 2] and all("0x" not in k and "DeviceToDevice" in k for k in copies), copies


def test_relaunch_cells_time_the_engines_steps_and_need_graphs_for_the_rest(tiny_model, tmp_path):
    # bench.relaunch on the CPU: its cells run (no graph: nothing launched), its graph actions are refused by name
    from bench import relaunch, results
    from conftest import write_config

    write_config(tmp_path / "mesh.yaml", tiny_model)
    common = ["--config", str(tmp_path / "mesh.yaml"), "--set", "thinker.engine=native", "--batch", "2",
              "--prompt-len", "8", "--steps", "4"]
    relaunch.main(common + ["--plan", "cell,cell", "--out", str(tmp_path / "r.json")])
    cells = results.read(tmp_path / "r.json")["cells"]
    assert [c["action"] for c in cells] == ["cell", "cell"]
    assert all(c["host_ms"] > 0 and c["launch_ms"] == 0 and c["cpu_probe_us"] > 0 for c in cells), cells
    with pytest.raises(SystemExit, match="decode graphs"):
        relaunch.main(common + ["--plan", "cell,steady"])
