"""The lab's two delay lines (``delay_line.c``, built on the machine, and ``delay_line.py``): each carries the
link with the configured delay under the kernel's rate limit, and ``auto`` says why when it cannot build the C
one; a network that cannot be built ends ``lab up`` with an error that says which command failed, and leaves
nothing. The link tests build only the network and the line (no Ray), so they take seconds; they need root."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from meridian.lab import delay_line

RTT_MS = 21.0
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not Path("/dev/net/tun").exists(),
                                reason="the lab creates network namespaces and TUN devices: run the tests as root")  # fmt: skip
needs_cc = pytest.mark.skipif(delay_line.c_compiler() is None, reason="no C compiler ($CC, cc or gcc)")


@needs_root
@pytest.mark.parametrize("line", [pytest.param("native", marks=needs_cc), "python"])
def test_each_line_carries_the_link_with_its_delay_and_counts_what_it_forwarded(line):
    from meridian.lab import lab

    name = f"line{os.getpid()}{line[0]}"
    state = lab.up({"dc-a": 1, "dc-b": 1}, rtt_ms=RTT_MS, gbps=1.0, name=name, ray=False, line=line)
    log = state.delay_line_log
    try:
        assert state.delay_line == line and state.summary()["delay_line"] == line
        (link,) = lab.probe(name, bulk_mb=16, pings=10)["links"]
    finally:
        lab.down(name)
    assert link["rtt_min_ms"] >= RTT_MS  # no packet beats the line
    assert link["rtt_ms"] < RTT_MS + 30
    assert 0 < link["gbps"] <= 1.05  # the kernel's tbf holds the rate, whichever line carries it
    assert link["link_tx_bytes"] >= link["bulk_bytes"]
    counts = json.loads(log.read_text().strip().splitlines()[-1])  # printed on SIGTERM from `down`
    log.unlink()
    # each bulk segment (up to 64 KiB with offload) went through the line, and the pings and ACKs besides
    assert counts["forwarded"] >= link["bulk_bytes"] / 2**16


@needs_cc
def test_the_native_line_is_built_once_per_source_text(tmp_path, monkeypatch):
    first = delay_line.build_native(tmp_path)
    built_at = first.stat().st_mtime_ns
    assert delay_line.build_native(tmp_path) == first and first.stat().st_mtime_ns == built_at
    changed = tmp_path / "src" / "delay_line.c"
    changed.parent.mkdir()
    changed.write_text(delay_line.NATIVE_SOURCE.read_text() + "/* changed */\n")
    monkeypatch.setattr(delay_line, "NATIVE_SOURCE", changed)
    assert delay_line.build_native(tmp_path) != first  # an upgraded line is rebuilt, never the stale binary run
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("compiler", [None, "/nonexistent/cc"])
def test_auto_falls_back_to_python_saying_why_and_native_refuses(tmp_path, monkeypatch, compiler):
    monkeypatch.setattr(delay_line.shutil, "which", lambda _: None)
    if compiler:
        monkeypatch.setenv("CC", compiler)
    else:
        monkeypatch.delenv("CC", raising=False)
    tuns = [("mrd-dc-a", "mrd-tun-a"), ("mrd-dc-b", "mrd-tun-b")]
    cmd, kind, why = delay_line.command(tuns, 10.5, "auto", tmp_path)
    assert kind == "python" and cmd[1:3] == ["-m", "meridian.lab.delay_line"]
    assert "--delay-line python" in why and ("no C compiler" in why if compiler is None else compiler in why)
    with pytest.raises(delay_line.NativeLineUnavailable):
        delay_line.command(tuns, 10.5, "native", tmp_path)
    with pytest.raises(ValueError, match="choose one of"):
        delay_line.command(tuns, 10.5, "fast", tmp_path)


@needs_cc
def test_the_native_command_passes_the_one_way_delay_in_microseconds_and_each_datacenter_in_order(tmp_path):
    cmd, kind, why = delay_line.command([("ns-a", "tun-a"), ("ns-b", "tun-b")], 10.5, "auto", tmp_path)
    assert (kind, why) == ("native", "")
    assert cmd[1:] == ["10500.000", "1", "ns-a", "tun-a", "ns-b", "tun-b"]


def test_a_network_command_that_is_missing_or_fails_says_which():
    from meridian.lab import network

    with pytest.raises(network.NetworkError, match="iproute2"):
        network.sh(["/nonexistent/ip", "link"])
    with pytest.raises(network.NetworkError, match="`false` failed"):
        network.sh(["false"])


@needs_root
def test_up_whose_network_fails_half_way_removes_what_it_made_and_says_why(monkeypatch):
    """Seen with a PATH without /usr/sbin: `ip netns exec … sysctl` failed after the first namespace existed, and
    `lab up` ended in a traceback instead of an error a person can act on."""
    from meridian.lab import lab, network

    real_create = network.create

    def create_without_sysctl(layout, made, *, mtu):
        def run(cmd):  # the sysctl as a machine without it runs it
            network.sh([*cmd[:4], "/nonexistent/sysctl", *cmd[5:]] if "sysctl" in cmd else cmd)
        real_create(layout, made, mtu=mtu, run=run)

    monkeypatch.setattr(network, "create", create_without_sysctl)
    name = f"half{os.getpid()}"
    with pytest.raises(lab.LabError, match="what it had made is removed: `ip netns exec mrd-dc-a /nonexistent/sysctl"):
        lab.up({"dc-a": 1, "dc-b": 1}, rtt_ms=RTT_MS, gbps=1.0, name=name, ray=False)
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "mrd-dc-a" not in namespaces and not lab.state_path(name).exists()


@pytest.mark.parametrize("name", ["../etc/x", "a b", "", "-x", "x" * 33])
def test_a_lab_name_that_is_not_a_plain_word_is_refused_before_anything_is_read_or_written(name):
    from meridian.lab import lab

    with pytest.raises(lab.LabError, match="letters, digits"):
        lab.state_path(name)


@needs_root
@pytest.mark.parametrize(("kwargs", "says"), [({"cpus_per_node": 0}, "at least 1"), ({"mtu": 100}, "mtu must be"),
                                              ({"line": "fast"}, "choose one of")])  # fmt: skip
def test_up_refuses_figures_that_cannot_make_a_lab_before_making_anything(kwargs, says):
    from meridian.lab import lab

    name = f"bad{os.getpid()}"
    with pytest.raises(lab.LabError, match=says):
        lab.up({"dc-a": 1, "dc-b": 1}, rtt_ms=RTT_MS, gbps=1.0, name=name, ray=False, **kwargs)
    assert not lab.state_path(name).exists()


@needs_root
def test_a_lab_whose_delay_line_died_says_so_instead_of_probing_into_silence():
    """Without the line every inter-DC packet is lost: a probe would wait out its timeout and a job's collectives
    theirs. `lab probe` refuses at once, naming the line's log, and `lab status` says the line is not running."""
    from meridian.lab import lab

    name = f"dead{os.getpid()}"
    state = lab.up({"dc-a": 1, "dc-b": 1}, rtt_ms=RTT_MS, gbps=1.0, name=name, ray=False)
    try:
        assert lab.delay_line_running(state)
        os.kill(state.delay_line_pid, 9)
        os.waitpid(state.delay_line_pid, 0)  # this process started it: reap it, as the bench would not
        assert not lab.delay_line_running(state)
        with pytest.raises(lab.LabError, match=f"delay line \\(pid {state.delay_line_pid}\\) is not running"):
            lab.probe(name, bulk_mb=1, pings=2, timeout_s=5)
    finally:
        lab.down(name)
        state.delay_line_log.unlink(missing_ok=True)


@needs_root
def test_down_leaves_alone_a_process_that_took_a_dead_lines_pid():
    from meridian.lab import lab

    name = f"reuse{os.getpid()}"
    state = lab.up({"dc-a": 1, "dc-b": 1}, rtt_ms=RTT_MS, gbps=1.0, name=name, ray=False)
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(state.delay_line_pid, 9)
        os.waitpid(state.delay_line_pid, 0)
        state.delay_line_pid = bystander.pid  # as if the kernel had handed the dead line's pid to another process
        lab._save(state)
        lab.down(name)
        assert bystander.poll() is None, "down killed a process that was not its delay line"
    finally:
        bystander.kill()
        bystander.wait()
        state.delay_line_log.unlink(missing_ok=True)


@needs_root
def test_down_if_up_removes_a_left_lab_and_is_quiet_when_there_is_none():
    from meridian.lab import lab

    name = f"left{os.getpid()}"
    lab.down_if_up(name)  # nothing there: nothing to do, no error
    state = lab.up({"dc-a": 1, "dc-b": 1}, rtt_ms=RTT_MS, gbps=1.0, name=name, ray=False)
    lab.down_if_up(name)  # what an interrupted run would have left
    assert not lab.state_path(name).exists() and not lab.delay_line_running(state)
    assert "mrd-dc-a" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    state.delay_line_log.unlink(missing_ok=True)
