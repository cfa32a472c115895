"""The network lab's arithmetic and packet routing, without root: names, addresses, the link's figures,
and which datacenter's TUN a packet is handed to."""

from __future__ import annotations

import struct

import pytest

from meridian.lab.delay_line import destination_index
from meridian.lab.layout import HEAD_IP, LabLayout, LinkSpec
from meridian.lab.network import datacenter_commands, tbf_args


def _ipv4(dst: str) -> bytes:
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20, 0, 0, 64, 6, 0, bytes([198, 18, 1, 10]),
                         bytes(int(x) for x in dst.split(".")))  # fmt: skip
    return header


def test_each_datacenter_owns_a_subnet_and_its_nodes_count_from_10():
    lay = LabLayout.build({"dc-a": 2, "dc-b": 1}, LinkSpec(21, 1))
    a, b = lay.datacenters
    assert [n.ip for n in a.nodes] == ["198.18.1.10", "198.18.1.11"]
    assert [n.ip for n in b.nodes] == ["198.18.2.10"]
    assert (a.netns, a.tun, a.dc_veth, a.host_veth, a.gateway) == ("mrd-dc-a", "mrdt0", "mrdd0", "mrdh0", "198.18.1.1")
    assert lay.link.one_way_s == pytest.approx(0.0105)


@pytest.mark.parametrize("bad", [{"dc/a": 1}, {"x" * 40: 1}, {}])
def test_names_that_cannot_name_a_namespace_are_refused(bad):
    with pytest.raises(ValueError):
        LabLayout.build(bad, LinkSpec(21, 1))


@pytest.mark.parametrize("rtt, gbps", [(-1, 1), (21, 0), (21, 1000)])
def test_link_figures_out_of_range_are_refused(rtt, gbps):
    with pytest.raises(ValueError):
        LinkSpec(rtt, gbps)


def test_packets_go_to_the_datacenter_of_their_destination():
    assert destination_index(_ipv4("198.18.2.10")) == 1
    assert destination_index(_ipv4("198.18.1.11")) == 0
    assert destination_index(_ipv4("198.18.0.1")) is None  # the head is reached over the management veth
    assert destination_index(_ipv4("10.0.0.1")) is None
    assert destination_index(b"\x60" + bytes(39)) is None  # IPv6 never crosses
    assert destination_index(b"\x45") is None


def test_routes_send_other_datacenters_through_the_tun_and_the_head_through_the_veth():
    lay = LabLayout.build({"dc-a": 1, "dc-b": 1, "dc-c": 1}, LinkSpec(100, 0.1))
    cmds = [" ".join(c) for c in datacenter_commands(lay.datacenters[0], lay, mtu=9000)]
    assert "ip netns exec mrd-dc-a ip route add 198.18.2.0/24 dev mrdt0" in cmds
    assert "ip netns exec mrd-dc-a ip route add 198.18.3.0/24 dev mrdt0" in cmds
    assert "ip netns exec mrd-dc-a ip route add 198.18.1.0/24 dev mrdt0" not in cmds
    assert f"ip netns exec mrd-dc-a ip route add {HEAD_IP}/32 via 198.18.1.1 dev mrdd0" in cmds
    assert any("tbf rate 100000000bit" in c for c in cmds)


def test_token_bucket_burst_is_two_ms_of_traffic_but_never_below_a_tso_segment():
    assert tbf_args(1.0)[:4] == ["tbf", "rate", "1000000000bit", "burst"]
    assert int(tbf_args(1.0)[4]) == 250_000
    assert int(tbf_args(0.01)[4]) == 64 * 1024


def test_lab_nodes_offer_no_gpus_so_a_gpu_host_is_not_counted_once_per_node(monkeypatch):
    """Every lab node shares the host's GPUs; Ray would detect them on each node, and a job planned for GPUs
    would put several NCCL ranks on one device. The lab rehearses the network: its head and nodes are CPU-only."""
    from meridian.lab import lab as lab_mod

    started: list[list[str]] = []
    monkeypatch.setattr(lab_mod, "_run_ray", lambda cmd, env: started.append(cmd))
    monkeypatch.setattr(lab_mod, "_wait_for_nodes", lambda state, n, timeout_s: None)
    state = lab_mod.LabState(name="t", datacenters={"dc-a": 1, "dc-b": 1}, rtt_ms=21, gbps=1, mtu=9000,
                             cpus_per_node=1)  # fmt: skip
    lab_mod._start_ray(state, state.layout, timeout_s=1)
    assert len(started) == 3  # the head and one node per datacenter
    for cmd in started:
        assert cmd[cmd.index("--num-gpus") + 1] == "0", cmd


def test_kill_stops_what_ignores_sigterm_after_the_grace_and_reaps_its_own_children():
    """`lab down` waited 10 s for a delay line that had exited (a zombie of the bench that started it) and 10 s for
    Ray's gcs_server, which ignores SIGTERM; now a zombie counts as gone, and the grace is the caller's."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from meridian.lab import lab as lab_mod

    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE)  # fmt: skip
    polite = subprocess.Popen(["sleep", "60"])
    assert stubborn.stdout.readline().strip() == b"ready"  # its SIGTERM handler is set
    started = time.monotonic()
    needed_sigkill = lab_mod._kill([stubborn.pid, polite.pid], grace_s=0.5)
    assert time.monotonic() - started < 3.0
    assert needed_sigkill == [stubborn.pid]
    assert not Path(f"/proc/{polite.pid}").exists()  # reaped, not left a zombie
    stubborn.wait(timeout=5)
