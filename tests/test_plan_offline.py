"""``meridian plan SPEC --cluster CLUSTER.yaml``: the described cluster, its validation, the offline spec, the
output (a block of at most eight lines, the reasoning behind ``--explain``, everything in ``--json``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from meridian.cli.main import main
from meridian.service.planning.described import FieldError, cluster_from_dict

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NODE = {"gpus": 8, "cpus": 64, "gpu": {"name": "H100-SXM", "memory_gb": 80, "bf16_tflops": 989},
        "nvlink_gbps": 3600, "nic_gbps": 3200}
TWO_DCS = {"datacenters": [{"name": "a", "nodes": 2, "node": NODE}, {"name": "b", "nodes": 2, "node": NODE}],
           "links": [{"between": ["a", "b"], "rtt_ms": 21, "gbps": 100}]}


def _with(path: tuple, value, base=TWO_DCS):
    data = json.loads(json.dumps(base))  # no shared sub-objects (both datacenters use NODE)
    target = data
    for key in path[:-1]:
        target = target[key]
    if value is ...:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return data


@pytest.mark.parametrize("data, field, message", [
    ({}, "datacenters", "is missing"),
    (_with(("datacenters",), []), "datacenters", "must be a non-empty list"),
    (_with(("datacenters", 0, "node", "gpu", "memory_gb"), -80), "datacenters[0].node.gpu.memory_gb", "must be > 0"),
    (_with(("datacenters", 1, "node", "gpus"), 2.5), "datacenters[1].node.gpus", "must be a whole number >= 1"),
    (_with(("datacenters", 0, "node", "gpu", "name"), ...), "datacenters[0].node.gpu.name", "is missing"),
    (_with(("datacenters", 0, "node", "infiniband"), 400), "datacenters[0].node.infiniband", "is not a field here"),
    (_with(("datacenters", 0, "node", "cpus"), 4), "datacenters[0].node.cpus", "must be >= its gpus"),
    (_with(("datacenters", 0, "node", "gpu", "efficiency"), 1.5), "datacenters[0].node.gpu.efficiency", "(0, 1]"),
    (_with(("datacenters", 1, "name"), "a"), "datacenters[1].name", "names a datacenter twice"),
    (_with(("links", 0, "between"), ["a", "z"]), "links[0].between", "'z', not a datacenter of the file"),
    (_with(("links", 0, "between"), ["a", "a"]), "links[0].between", "two different datacenters"),
    (_with(("links",), []), "links", "has no link between 'a' and 'b'"),
    (_with(("links", 0, "rtt_ms"), "21ms"), "links[0].rtt_ms", "must be a number"),
    (_with(("links", 0, "gbps"), 0), "links[0].gbps", "must be > 0"),
    (_with(("racks",), 3), "racks", "is not a field here"),
])
def test_a_bad_cluster_file_names_the_field(data, field, message):
    with pytest.raises(FieldError, match=re.escape(message)) as e:
        cluster_from_dict(data)
    assert e.value.field == field and str(e.value).startswith(field)


def test_a_described_cluster_is_the_topology_and_figures_the_planner_reads():
    cluster = cluster_from_dict(TWO_DCS)
    topo = cluster.topology()
    assert topo.datacenters == ("a", "b") and len(topo.alive_nodes) == 4 and cluster.gpus == 32
    fig = cluster.figures(0.5)
    assert fig.device_flops == pytest.approx(0.5 * 989e12) and fig.peak_flops == pytest.approx(989e12)
    assert fig.device_memory_bytes == 80 * 2**30 and fig.inter_dc_known
    assert fig.inter_dc.latency_s == pytest.approx(0.0105) and fig.inter_dc.bytes_per_s == pytest.approx(100e9 / 8)
    assert fig.intra_dc.bytes_per_s == pytest.approx(3200e9 / 8 / 8)  # the node's NIC shared by its 8 GPUs
    one = cluster.one_datacenter()
    assert [(dc.name, dc.nodes) for dc in one.datacenters] == [("a", 4)] and not one.links


def _write(tmp_path: Path, name: str, data) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if name.endswith(".yaml") else json.dumps(data))
    return str(path)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


SPEC = {"name": "p", "model": {"preset": "llama-1b"}, "training": {"steps": 1000, "global_batch": 64, "precision": "bf16"}}


def test_offline_plan_prints_a_short_block_and_its_reasoning_behind_explain(tmp_path, capsys):
    spec, cluster = _write(tmp_path, "spec.json", SPEC), _write(tmp_path, "c.yaml", TWO_DCS)
    rc, out, _ = _run(capsys, spec, "--cluster", cluster)
    assert rc == 0
    block = out.splitlines()[1:]  # after the line that says what the GPUs compute at
    assert len(block) <= 9 and block[0].startswith("layout") and any(line.startswith("sync") for line in block)
    assert "why:" not in out
    rc, explained, _ = _run(capsys, spec, "--cluster", cluster, "--explain")
    assert rc == 0 and "why:" in explained and "Next best" in explained


def test_offline_plan_json_has_the_layout_its_estimate_and_the_one_datacenter_comparison(tmp_path, capsys):
    spec, cluster = _write(tmp_path, "spec.json", SPEC), _write(tmp_path, "c.yaml", TWO_DCS)
    rc, out, _ = _run(capsys, spec, "--cluster", cluster, "--json", "--compare-one-dc")
    assert rc == 0
    data = json.loads(out)
    plan = data["plan"]
    assert set(plan["parallelism"]) >= {"tp", "pp", "dp", "virtual_stages", "micro_batch", "sequence_parallel",
                                        "activation_checkpointing", "sharding"}
    assert set(plan["estimate"]) >= {"memory_bytes", "step_s", "compute_s", "bubble_s", "tp_comm_s", "pp_comm_s",
                                     "exposed_dp_s", "tokens_per_s", "mfu", "inter_dc_bytes"}
    assert len(plan["summary"].splitlines()) <= 8 and "rank_datacenters" not in plan
    assert data["one_dc"]["workers_per_datacenter"] == {"a": 32}
    assert 0 < data["efficiency_vs_one_dc"] <= 1.01
    assert data["inter_dc_gbps_at_target"] is None or data["inter_dc_gbps_at_target"] > 0
    assert data["cluster"]["gpus"] == 32 and "fitted to" in data["cluster"]["calibration"]
    rc, out, _ = _run(capsys, spec, "--cluster", cluster, "--json")
    assert rc == 0 and "one_dc" not in json.loads(out)  # the comparison only when asked


def test_micro_batch_left_out_is_searched_and_a_hugging_face_config_path_is_read(tmp_path, capsys):
    hf = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
          "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}
    (tmp_path / "cfg").mkdir()
    _write(tmp_path / "cfg", "config.json", hf)
    spec = _write(tmp_path, "spec.yaml", {"model": {"hf_config": "cfg/config.json", "seq_len": 1024},
                                          "training": {"steps": 100, "global_batch": 64}})
    rc, out, err = _run(capsys, spec, "--cluster", _write(tmp_path, "c.yaml", TWO_DCS), "--json")
    assert rc == 0, err
    plan = json.loads(out)["plan"]
    assert plan["parallelism"]["micro_batch"] in (1, 2, 4, 8)


@pytest.mark.parametrize("spec, field", [
    ({**SPEC, "trainer": {}}, "trainer"),
    ({**SPEC, "training": {"steps": 10}}, "training.global_batch"),
    ({**SPEC, "training": {**SPEC["training"], "micro_batch": 0}}, "training.micro_batch"),
    ({**SPEC, "model": {"hf_config": {"model_type": "llama"}}}, "model.hf_config"),
    ({**SPEC, "model": {"hf_config": {"model_type": "t5"}}}, "model.hf_config.model_type"),
    ({**SPEC, "model": {"hf_config": {}, "n_layers": 4}}, "model.n_layers"),
    ({**SPEC, "model": {"preset": "llama-1b", "n_layers": 0}}, "model.n_layers"),
    ({**SPEC, "sync": {"strategy": "ring"}}, "sync.strategy"),
    ({**SPEC, "wan": {"rtt_ms": 20}}, "wan"),
])
def test_a_bad_offline_spec_is_an_error_naming_the_field(tmp_path, capsys, spec, field):
    rc, out, err = _run(capsys, _write(tmp_path, "spec.json", spec), "--cluster", _write(tmp_path, "c.yaml", TWO_DCS),
                        "--json")
    assert rc == 2 and err.startswith("error: ")
    problem = json.loads(out)["error"]
    assert problem["type"].endswith("invalid-spec") and problem["field"] == field, problem


def test_a_bad_cluster_file_is_exit_2_with_the_field_in_the_problem(tmp_path, capsys):
    bad = _with(("datacenters", 0, "node", "gpu", "name"), "MI300X")  # no calibration for it, none declared
    rc, out, err = _run(capsys, _write(tmp_path, "spec.json", SPEC), "--cluster", _write(tmp_path, "c.yaml", bad),
                        "--json")
    assert rc == 2 and "declare gpu.efficiency" in err
    bad = _with(("links", 0, "gbps"), -1)
    rc, out, _ = _run(capsys, _write(tmp_path, "spec.json", SPEC), "--cluster", _write(tmp_path, "c.yaml", bad), "--json")
    problem = json.loads(out)["error"]
    assert rc == 2 and problem["type"].endswith("invalid-cluster-file") and problem["field"] == "links[0].gbps"
    rc, out, _ = _run(capsys, _write(tmp_path, "spec.json", SPEC), "--cluster", str(tmp_path / "missing.yaml"), "--json")
    assert rc == 2 and json.loads(out)["error"]["type"].endswith("invalid-cluster-file")


def test_a_job_no_layout_fits_is_exit_1_with_the_planner_s_reason(tmp_path, capsys):
    small = _with(("datacenters", 0, "node", "gpu", "memory_gb"), 1, base={**TWO_DCS, "datacenters": TWO_DCS["datacenters"][:1],
                                                                           "links": []})
    spec = {**SPEC, "model": {"preset": "llama3-8b"}}
    rc, out, err = _run(capsys, _write(tmp_path, "spec.json", spec), "--cluster", _write(tmp_path, "c.yaml", small), "--json")
    assert rc == 1 and "no layout fits in device memory" in err
    assert json.loads(out)["error"]["type"].endswith("unschedulable")


def test_compare_one_dc_needs_a_cluster(tmp_path, capsys):
    rc, out, err = _run(capsys, _write(tmp_path, "spec.json", SPEC), "--compare-one-dc", "--json")
    assert rc == 2 and "--compare-one-dc needs --cluster" in err


def test_the_example_cluster_files_plan(capsys):
    rc, out, err = _run(capsys, str(EXAMPLES / "llama3-8b.yaml"), "--cluster",
                        str(EXAMPLES / "clusters" / "workstation-8gpu.yaml"), "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert not data["plan_only"] and data["plan"]["parallelism"]["sharding"] == "fsdp" and data["offered"] is not None
