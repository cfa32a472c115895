"""``meridian bench state-exchange``: the targeted exchange moves less than gathering every shard on every rank,
measured from the buffers that received it (the same snapshots, the same processes)."""

from __future__ import annotations

import argparse

from meridian.bench import state_exchange
from meridian.cli import bench as cli


def test_targeted_receives_less_in_all_and_across_datacenters_than_gather_all():
    out = state_exchange.run(argparse.Namespace(params_m=0.3, tensors=7, ranks_per_dc=3, repeats=1))
    g, t = out["gather_all"], out["targeted"]
    state = out["state_bytes_per_replica"]
    # gather_all: each of the 5 survivors receives the other 4 shards (a third of a replica each, dc-b's a half)
    assert g["received_bytes_all_ranks"] >= 5 * 4 * state // 3
    # targeted: dc-a's three ranks take only each other's values; dc-b's two take the lost third once across
    assert t["received_bytes_all_ranks"] < 0.3 * g["received_bytes_all_ranks"]
    assert 0 < t["cross_dc_bytes_all_ranks"] <= state // 3 + 64
    assert t["cross_dc_bytes_all_ranks"] < 0.15 * g["cross_dc_bytes_all_ranks"]
    assert t["wall_s"] > 0 and g["wall_s"] > 0


def test_bad_arguments_are_refused_with_a_reason(capsys):
    assert cli.main(["state-exchange", "--json", "--ranks-per-dc", "1"]) == 1
    assert "at least 2" in capsys.readouterr().err
