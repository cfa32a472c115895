"""``meridian bench lab --json`` on a tiny configuration: the row's shape, and reported bytes against the kernel's.

Needs root (the lab makes network namespaces); takes the machine's lab lock like every lab user.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the lab creates network namespaces: run the tests as root"),
    pytest.mark.skipif(not Path("/dev/net/tun").exists(), reason="no /dev/net/tun on this machine"),
]

KEYS = {"rtt_ms", "gbps", "strategy", "step_ms_lab", "step_ms_emulated", "step_ms_one_dc", "scaling_efficiency",
        "inter_dc_bytes_kernel", "inter_dc_bytes_reported", "har_min_bytes", "emulated_vs_lab",
        "delay_line_cpu_ms_per_step", "delay_line_cpu_share", "ranks_cpu_ms_per_step_lab",
        "ranks_cpu_ms_per_step_one_dc", "ranks_cpu_ms_per_step_emulated"}  # fmt: skip


def test_bench_lab_rows_and_bytes_against_the_kernel() -> None:
    cmd = [sys.executable, "-m", "meridian.cli.main", "bench", "lab", "--json", "--links", "21:1", "--strategies",
           "hierarchical,flat", "--model", "tiny", "--steps", "8", "--warmup", "2", "--no-overlap-saving"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert [r["strategy"] for r in result["rows"]] == ["hierarchical", "flat"]
    for row in result["rows"]:
        assert not KEYS - set(row), KEYS - set(row)
        assert row["step_ms_lab"] > 0 and row["step_ms_emulated"] > 0 and row["step_ms_one_dc"] > 0
        # Every inter-DC byte crossed the delay line: it used CPU for them, and less than all of the machine's.
        assert row["delay_line_cpu_ms_per_step"] > 0 and 0 < row["delay_line_cpu_share"] < 1, row
        assert row["delay_line"] in ("native", "python"), row  # which line carried the link
        # The ranks computed for every step: CPU time, and no more than all cores for the whole step allow.
        for where in ("lab", "one_dc", "emulated"):
            cores_ms = row[f"step_ms_{where}"] * os.cpu_count()
            assert 0 < row[f"ranks_cpu_ms_per_step_{where}"] < 1.5 * cores_ms, row
        for where in ("lab", "one_dc"):
            assert 0 < row[f"ranks_system_cpu_ms_per_step_{where}"] < row[f"ranks_cpu_ms_per_step_{where}"], row
        # What the engines reported is what left the datacenters' link devices (TCP/IP headers, ACKs, gloo's
        # control messages and the loop's small loss all-reduce are the kernel's extra: ~0.1 MB a step, 11% of
        # the `nano` model's 1.1 MB but 1-4% of `tiny`'s 7 MB, hence `tiny` here). A datacenter's first rank reads
        # its link's counter when it ends a step, while its peer may still be sending that step's bytes: each end
        # of the window can cut a part of a step, hence 6 timed steps (with 3, once 7.7% short on 2026-11-27).
        assert row["inter_dc_bytes_reported"] == pytest.approx(row["inter_dc_bytes_kernel"], rel=0.05), row
    har, flat = result["rows"]
    assert har["inter_dc_bytes_reported"] == pytest.approx(har["har_min_bytes"], rel=0.01)
    assert flat["inter_dc_bytes_reported"] == pytest.approx(1.5 * har["har_min_bytes"], rel=0.01)  # ring of 4


def test_diloco_is_timed_over_whole_cycles_after_its_first_sync() -> None:
    from meridian.bench.lab import window

    args = argparse.Namespace(warmup=2, steps=14, diloco_h=4)
    assert window(args, "hierarchical") == (2, 14)  # every step is alike: all after the warm-up
    # Steps 6-13: two cycles, each with one sync (8, 12); step 4 (the first sync, which also connects) is left out,
    # and the ends (after steps 5 and 13) are a step away from a sync.
    assert window(args, "diloco") == (5, 13)
    assert window(argparse.Namespace(warmup=5, steps=14, diloco_h=4), "diloco") == (9, 13)
    with pytest.raises(ValueError, match="diloco needs --steps >= 9"):
        window(argparse.Namespace(warmup=2, steps=8, diloco_h=4), "diloco")


def _lowcomm(*extra: str) -> dict:
    cmd = [sys.executable, "-m", "meridian.cli.main", "bench", "lowcomm", "--json", "--steps", "40", "--inner-steps",
           "8", "--compression", "int4", "--diloco-warmup-steps", "0", "--overlap-steps", "1", "--rtt-ms", "21",
           "--inter-dc-gbps", "1", "--strategies", "streaming-diloco+int4/H8", *extra]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_bench_lowcomm_over_the_lab_trains_the_same_values_and_the_kernel_counts_the_bytes() -> None:
    lab, emulated = _lowcomm("--lab"), _lowcomm()
    assert lab["link"]["kind"] == "lab" and emulated["link"]["kind"] == "emulated"
    assert list(lab["strategies"]) == ["har", "streaming-diloco+int4/H8"]  # torchft's rows: loopback only
    for name, row in lab["strategies"].items():
        # real TCP changes when things arrive, never what: the same losses as behind the emulator
        assert row["final_val_loss"] == emulated["strategies"][name]["final_val_loss"], name
        assert row["inter_dc_bytes_per_step"] == emulated["strategies"][name]["inter_dc_bytes_per_step"], name
        assert 0 < row["compute_utilisation"] <= 1 and row["inter_dc_bytes_kernel_per_step"] > 0
        assert len(row["compute_utilisation_per_rank"]) == 2  # each datacenter's rank timed its own steps
        if name != "har":  # no torchft row to compare with
            assert row["goals"]["loss_le_torchft"] is None and row["goals"]["bytes_le_torchft"] is None
    # per-step sync's 1.1 MB a step, against the link's count (headers, ACKs and the loop's loss all-reduce on top)
    assert 0.8 < lab["strategies"]["har"]["reported_vs_kernel"] <= 1.0
