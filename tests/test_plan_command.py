"""``tensorwire plan``: a template (made small here) planned and modelled, as text, JSON and a
picture; a config file in JSON or YAML; clear errors for what it does not know."""

from __future__ import annotations

import json

import pytest

from tensorwire import cli, plan_command

SMALL = {  # the dense 70B's shapes, on 8 trainer ranks into one TP 8 replica: quick to plan
    "template": "dense-70b",
    "trainers": {"ranks": 8, "shard": 8},
    "receivers": {"replicas": 1, "ranks_per_replica": 8},
    "cluster": {"nic_gbps": 25, "latency_us": 5},
    "bucket_mib": 256,
}


def test_a_config_is_planned_and_modelled_with_its_changes(tmp_path, capsys):
    path = tmp_path / "push.json"
    path.write_text(json.dumps(SMALL))
    assert cli.main(["plan", "--config", str(path), "--json", "--no-progress", "--plot", str(tmp_path / "p.png")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["trainers"], result["receivers"], result["nodes"]) == (8, 8, 2)
    assert result["cluster"]["nic_gbps"] == 25 and result["bucket_bytes"] == 256 << 20
    assert 70e9 < result["params"] < 71e9 and result["tensors"] == 723
    # each receiver needs its TP 8 share: 1/8 of the model, about 16.4 GiB in BF16, over one 25 GB/s NIC
    assert result["receiver_nbytes_max"] == pytest.approx(result["params"] * 2 / 8, rel=0.01)
    assert result["bound_s"] == pytest.approx(result["receiver_nbytes_max"] / 25e9, rel=0.01)
    assert 1.0 <= result["over_bound"] < 1.3
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_yaml_works_too_and_prints_the_totals(tmp_path, capsys):
    import yaml  # (Ray's dependency)

    path = tmp_path / "push.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    assert cli.main(["plan", "--config", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "dense-70b" in out and "8 trainer ranks -> 8 receiver ranks on 2 nodes" in out
    assert "x the bound" in out and "node 1 nic" in out


def test_unknown_keys_and_templates_are_named():
    with pytest.raises(ValueError, match=r"template 'llama': one of \['dense-70b', 'kimi-k2', 'qwen3-235b'\]"):
        plan_command.template_of({"template": "llama"})
    with pytest.raises(ValueError, match=r"receivers: unknown key\(s\) \['pp'\]"):
        plan_command.template_of({"template": "dense-70b", "receivers": {"pp": 2}})
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['nodes'\]"):
        plan_command.template_of({"template": "dense-70b", "nodes": 4})
