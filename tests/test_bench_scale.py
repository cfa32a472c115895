"""``meridian bench scale`` at a small N: the simulated ranks form an epoch through the real runner and service,
step, and a lost node's ranks re-form without it (fields and outcomes; no timing is asserted)."""

from __future__ import annotations

import argparse

import pytest

from meridian.bench import control_scale
from meridian.cli import bench as cli


def _args(**over: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    control_scale.add_arguments(p)
    args = p.parse_args([])
    for k, v in over.items():
        setattr(args, k, v)
    return args


@pytest.mark.slow
def test_simulated_ranks_form_step_and_reform_after_a_lost_node():
    out = control_scale.run(_args(ranks=32, processes=2, steady_s=3.0, timeout_s=120.0, api_rps=5.0))
    assert out["errors"] == []
    assert (out["ranks"], out["nodes"], out["datacenters"]) == (32, 4, 2)
    assert out["first_epoch_s"] is not None and out["first_epoch_s"] > 0
    assert out["reform_s"] is not None and out["reform_s"] > 0
    assert out["lost_node"] == "node-1-1"
    assert out["runner_cpu_cores"] > 0
    assert out["store_db_found"] and out["store_rows_per_s"] > 0  # rank 0's step records reach the store
    assert out["job_state"] == "running"
    assert out["api_get"]["requests"] > 0 and out["api_get"]["failed"] == {}


def test_ranks_that_do_not_fill_whole_nodes_in_every_datacenter_are_refused(capsys):
    assert cli.main(["scale", "--json", "--ranks", "40"]) == 1
    assert "multiple of 8 x --datacenters (16), got 40" in capsys.readouterr().err
