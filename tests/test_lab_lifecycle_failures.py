"""``meridian lab`` when its user is unlucky or hostile: a second lab, a ``down`` while ``up`` runs, a lab name or
datacenter name Ray cannot take, a dead Ray head, Ctrl-C, a dead delay line. Each must end in an error a person can
act on (JSON with ``--json``), and nothing of another lab may be touched.

Most tests point the lab's state dir at a temporary folder and stand in for the network, so they run anywhere in
a second; those marked ``needs_root`` build real namespaces (no Ray, or Ray for a few seconds).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meridian.cli.main import main as cli_main
from meridian.lab import lab, network
from meridian.lab.layout import LabLayout, LinkSpec

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not Path("/dev/net/tun").exists(),
                                reason="the lab creates network namespaces and TUN devices: run the tests as root")  # fmt: skip
LINK = LinkSpec(21.0, 1.0)


class NetworkStandIn(Exception):
    """Raised where the real network would have been built: the test ends there, having made nothing."""


@pytest.fixture
def fake_host(tmp_path, monkeypatch):
    """A state dir of its own, root assumed, and no network: ``network.create`` raises :class:`NetworkStandIn`."""
    monkeypatch.setattr(lab, "STATE_DIR", tmp_path / "state")
    monkeypatch.setattr(lab, "_require_root", lambda: None)
    created: list[str] = []

    def create(layout, made, *, mtu):
        created.append(layout.datacenters[0].netns)
        raise NetworkStandIn

    monkeypatch.setattr(network, "create", create)
    return created


def _write_state(name: str, **kw) -> lab.LabState:
    state = lab.LabState(name=name, datacenters={"dc-a": 1, "dc-b": 1}, rtt_ms=21.0, gbps=1.0, mtu=9000,
                         cpus_per_node=1, ray_temp_dir=f"/tmp/meridian-lab-{name}", **kw)  # fmt: skip
    lab._save(state)
    return state


# --- names Ray cannot take -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dc-", "dc_", "dc."])
def test_a_datacenter_name_that_ray_cannot_take_as_a_label_is_refused_by_the_layout(name):
    """`lab up --datacenters dc-:1,b:1` built the namespaces, the delay line and the Ray head, then `ray start`
    refused the label value `dc-` (it must end with a letter or digit), in a message full of terminal colours."""
    with pytest.raises(ValueError, match="ending with a letter or digit"):
        LabLayout.build({name: 1, "b": 1}, LINK)
    LabLayout.build({"a": 1, "dc-b.2_x": 1, "c" * 31: 1}, LINK)  # what stays allowed


def test_the_cli_refuses_such_a_datacenter_before_making_anything(fake_host, capsys):
    rc = cli_main(["lab", "up", "--name", "rev", "--datacenters", "dc-:1,b:1", "--json"])
    assert rc == 2
    assert "ending with a letter or digit" in json.loads(capsys.readouterr().out)["error"]["detail"]
    assert not fake_host and not lab.state_path("rev").exists()


def test_a_lab_name_too_long_for_rays_socket_paths_is_refused_before_anything_is_made(fake_host):
    """A 32-character name passed, then `ray start --head` failed after the network was built: "AF_UNIX path length
    cannot exceed 107 bytes: /tmp/meridian-lab-<name>/session_…/sockets/plasma_store"."""
    with pytest.raises(lab.LabError, match=f"at most {lab.RAY_LAB_NAME_MAX}"):
        lab.up({"dc-a": 1, "dc-b": 1}, rtt_ms=21, gbps=1, name="x" * (lab.RAY_LAB_NAME_MAX + 1))
    assert not fake_host and not lab.state_path("x" * (lab.RAY_LAB_NAME_MAX + 1)).exists()
    # the longest name that is taken fits Ray's deepest socket with a 7-digit pid and a 4-digit node number
    deepest = f"/tmp/meridian-lab-{'x' * lab.RAY_LAB_NAME_MAX}/session_2026-11-28_18-29-44_008643_4194304" \
              "/sockets/plasma_store.3200"
    assert len(deepest) <= 107
    with pytest.raises(NetworkStandIn):  # a lab without Ray (the benchmarks') keeps the longer names
        lab.up({"dc-a": 1, "dc-b": 1}, rtt_ms=21, gbps=1, name="bench-recovery-torchft", ray=False)


def test_more_nodes_than_the_machine_can_hold_are_refused_before_anything_is_made(fake_host, monkeypatch):
    """Nothing capped the lab's size: 200 datacenters of 16 nodes were accepted, ~140 MB of Ray processes each."""
    monkeypatch.setattr(lab, "available_memory", lambda: 4 * 2**30)  # 4 GiB free: 14 nodes fit in half of it
    with pytest.raises(lab.LabError, match=r"16 Ray nodes \(the head included\) would hold ~2.2 GiB") as refused:
        lab.up({"dc-a": 8, "dc-b": 7}, rtt_ms=21, gbps=1, name="big")
    assert "more than half of the 4.0 GiB" in str(refused.value) and "fewer nodes" in str(refused.value)
    assert not fake_host and not lab.state_path("big").exists()
    with pytest.raises(NetworkStandIn):
        lab.up({"dc-a": 7, "dc-b": 6}, rtt_ms=21, gbps=1, name="fits")  # 14 with the head
    with pytest.raises(NetworkStandIn):  # a lab without Ray starts no nodes: the network alone
        lab.up({"dc-a": 8, "dc-b": 8}, rtt_ms=21, gbps=1, name="big", ray=False)


# --- one lab at a time, one `up` or `down` at a time -------------------------------------------------------------


def test_up_refuses_while_another_lab_is_up_and_names_it(fake_host):
    """Every lab uses 198.18.0.1, the same ports and device names (mrdh0…): a second lab with other datacenters
    failed with "RTNETLINK answers: File exists", and one with the same datacenters was told the namespaces were
    "left from an earlier lab" and to `ip netns del` them: the running lab's."""
    _write_state("rev1")
    with pytest.raises(lab.LabError, match=r"lab 'rev1' is up .*`meridian lab down --name rev1` first"):
        lab.up({"dc-c": 1, "dc-d": 1}, rtt_ms=21, gbps=1, name="rev2", ray=False)
    assert not fake_host and not lab.state_path("rev2").exists()


def test_up_of_a_name_already_up_names_the_lab_to_take_down(fake_host):
    _write_state("rev1")
    with pytest.raises(lab.LabError, match="`meridian lab down --name rev1` removes it"):
        lab.up({"dc-a": 1, "dc-b": 1}, rtt_ms=21, gbps=1, name="rev1", ray=False)


def test_down_of_a_name_that_is_not_up_names_the_lab_that_is(fake_host):
    _write_state("rev1")
    with pytest.raises(lab.LabError, match="no lab named 'lab' is up .*lab 'rev1' is: pass `--name rev1`"):
        lab.down()
    assert lab.state_path("rev1").exists()


def test_down_while_up_runs_is_refused_and_leaves_up_to_finish(fake_host, monkeypatch):
    """`down` while `up` ran removed what `up` had recorded so far (its state file too) while `up` went on making
    more, which no state named afterwards."""
    building, release = threading.Event(), threading.Event()

    def slow_create(layout, made, *, mtu):
        made("netns", "mrd-never-made")  # recorded; `ip netns del` of a namespace that does not exist is quiet
        building.set()
        release.wait(10)
        raise NetworkStandIn

    monkeypatch.setattr(network, "create", slow_create)
    errors: list[BaseException] = []

    def bring_up():
        try:
            lab.up({"dc-a": 1, "dc-b": 1}, rtt_ms=21, gbps=1, name="rev1", ray=False)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=bring_up)
    t.start()
    try:
        assert building.wait(10)
        with pytest.raises(lab.LabError, match=r"cannot down now: `meridian lab up` \(pid \d+\) is changing the lab"):
            lab.down("rev1")
        assert lab.state_path("rev1").exists()  # `down` took nothing away from under `up`
        with pytest.raises(lab.LabError, match="cannot up now"):
            lab.up({"dc-c": 1}, rtt_ms=21, gbps=1, name="rev2", ray=False)
    finally:
        release.set()
        t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], NetworkStandIn)
    assert not lab.state_path("rev1").exists()  # `up` removed what it had made, under its own lock


def test_the_lock_of_an_up_killed_by_sigkill_does_not_outlive_it(fake_host):
    code = ("import sys, time; from pathlib import Path; from meridian.lab import lab; "
            f"lab.STATE_DIR = Path({str(lab.STATE_DIR)!r}); "
            "cm = lab._locked('up'); cm.__enter__(); print('held', flush=True); time.sleep(60)")  # fmt: skip
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(lab.LabError, match=f"pid {holder.pid}"), lab._locked("down"):
            pass
    finally:
        holder.kill()
        holder.wait()
    with lab._locked("down"):  # the kernel dropped the dead holder's lock
        pass


# --- status of a broken lab, Ctrl-C, Ray's messages ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_status_of_a_lab_whose_ray_head_is_gone_says_so_instead_of_a_traceback(fake_host, capsys):
    """With the head's processes killed (or an `up` killed before it started them), `lab status` ended in a
    50-line traceback from Ray's state API, and no JSON."""
    _write_state("rev1", dashboard_port=_free_port())  # nothing answers there
    rc = cli_main(["lab", "status", "--name", "rev1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["alive_nodes"] == [] and out["started"] is False
    assert "Ray head does not answer" in out["ray_error"] and "lab down --name rev1" in out["ray_error"]
    assert cli_main(["lab", "status", "--name", "rev1"]) == 0
    text = capsys.readouterr().out
    assert "has not finished" in text and "does not answer" in text and "Traceback" not in text


def test_a_failed_ray_start_is_quoted_without_terminal_colours_and_with_its_exit_code():
    script = "import sys; sys.stderr.write('\\x1b[31m`\\x1b[1m--labels=datacenter=dc-\\x1b[22m` is bad\\x1b[39m'); sys.exit(3)"
    with pytest.raises(lab.LabError) as e:
        lab._run_ray([sys.executable, "-c", script], dict(os.environ))
    assert "\x1b" not in str(e.value)
    assert "`--labels=datacenter=dc-` is bad" in str(e.value) and "exit code 3" in str(e.value)


def test_ctrl_c_during_up_with_json_prints_an_error_saying_what_is_left(fake_host, monkeypatch, capsys):
    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(lab, "up", interrupted)
    assert cli_main(["lab", "up", "--name", "rev1", "--json"]) == 130
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["type"].endswith("interrupted") and "nothing of lab 'rev1' is left" in err["detail"]
    _write_state("rev1")  # as if a second Ctrl-C had cut its clean-up short
    assert cli_main(["lab", "up", "--name", "rev1", "--json"]) == 130
    assert "`meridian lab down --name rev1` removes it" in json.loads(capsys.readouterr().out)["error"]["detail"]


# --- on the machine, as root ------------------------------------------------------------------------------------


def _netns() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@needs_root
def test_a_second_lab_is_refused_and_the_first_is_left_whole():
    first, second = f"lc{os.getpid()}a", f"lc{os.getpid()}b"
    state = lab.up({"dc-a": 1, "dc-b": 1}, rtt_ms=21.0, gbps=1.0, name=first, ray=False)
    try:
        for dcs in ({"dc-c": 1, "dc-d": 1}, {"dc-a": 1, "dc-b": 1}):
            with pytest.raises(lab.LabError, match=f"lab '{first}' is up"):
                lab.up(dcs, rtt_ms=21.0, gbps=1.0, name=second, ray=False)
        assert "mrd-dc-a" in _netns() and "mrd-dc-b" in _netns() and lab.delay_line_running(state)
        assert Path("/sys/class/net/mrdh0").exists() and not lab.state_path(second).exists()
    finally:
        lab.down(first)
        state.delay_line_log.unlink(missing_ok=True)
    assert "mrd-dc-" not in _netns()


@needs_root
def test_a_dead_delay_line_is_explained_by_its_own_words_not_an_earlier_labs():
    """The line's log was appended to across labs of one name: a line killed without a word was "explained" by
    the counts an earlier lab's line had printed when it was stopped."""
    name = f"lc{os.getpid()}c"
    log = lab.LabState(name=name, datacenters={}, rtt_ms=0, gbps=1, mtu=9000, cpus_per_node=1,
                       ray_temp_dir=f"/tmp/meridian-lab-{name}").delay_line_log  # fmt: skip
    log.write_text('{"forwarded": 12345, "dropped": 678}\n')  # what an earlier lab's line said when stopped
    state = lab.up({"dc-a": 1, "dc-b": 1}, rtt_ms=21.0, gbps=1.0, name=name, ray=False)
    try:
        os.kill(state.delay_line_pid, signal.SIGKILL)
        os.waitpid(state.delay_line_pid, 0)
        with pytest.raises(lab.LabError, match="is not running") as e:
            lab.check_delay_line(state)
        assert "12345" not in str(e.value)
    finally:
        lab.down(name)
        log.unlink(missing_ok=True)


@needs_root
def test_ctrl_c_during_a_real_up_removes_everything_and_says_so_in_json():
    """Ctrl-C (SIGINT to the terminal's process group) once the network and the delay line are up and Ray starts."""
    name = f"lc{os.getpid()}d"
    cmd = [sys.executable, "-m", "meridian.cli.main", "lab", "up", "--name", name, "--datacenters", "dc-a:1,dc-b:1",
           "--json"]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    line_pid = 0
    try:
        deadline = time.monotonic() + 60
        while not line_pid and time.monotonic() < deadline:  # the delay line is recorded: Ray's head starts next
            if lab.state_path(name).exists():
                line_pid = json.loads(lab.state_path(name).read_text()).get("delay_line_pid", 0)
            time.sleep(0.05)
        assert line_pid, p.communicate(timeout=60)
        time.sleep(1.0)
        os.killpg(p.pid, signal.SIGINT)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if lab.state_path(name).exists():
            lab.down(name)
    assert p.returncode == 130
    assert f"nothing of lab '{name}' is left" in json.loads(out)["error"]["detail"]
    assert "mrd-dc-" not in _netns() and not lab.state_path(name).exists()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"meridian-lab-{name}" not in ps and lab.process_exited(line_pid)
    Path(f"/tmp/meridian-lab-{name}-delay-line.log").unlink(missing_ok=True)


def test_down_stops_the_labs_ray_processes_and_no_bystander_that_merely_names_its_paths():
    """`down` matched a bare substring of the command line: it killed a user's `tail -f` of the delay line's log
    (``/tmp/meridian-lab-<name>-delay-line.log``, the file its errors point to), a `meridian serve` given
    ``--address=<the head>``, and the Ray processes of a lab whose name starts with this one's."""
    state = lab.LabState(name="rev", datacenters={"dc-a": 1}, rtt_ms=21.0, gbps=1.0, mtu=9000, cpus_per_node=1,
                         ray_temp_dir=f"/tmp/meridian-lab-rev{os.getpid()}")  # fmt: skip
    t = state.ray_temp_dir
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    lab_own = {"head": [*sleeper, f"--temp-dir={t}"], "gcs": [*sleeper, f"--log_dir={t}/session_1/logs"],
               "ray start": [*sleeper, "--temp-dir", t],
               "client server": [*sleeper, "-m", "ray.util.client.server", f"--address={state.ray_address}"]}  # fmt: skip
    bystanders = {"tail of the log": [*sleeper, f"{t}-delay-line.log"], "tail of a Ray log": [*sleeper, "-f", f"{t}/x"],
                  "serve": [*sleeper, "serve", f"--address={state.ray_address}"],
                  "another lab": [*sleeper, f"--temp-dir={t}2"]}  # fmt: skip
    procs = {what: subprocess.Popen(cmd) for what, cmd in {**lab_own, **bystanders}.items()}
    try:
        found = set(lab._ray_processes(state))
        assert {w for w, p in procs.items() if p.pid in found} == set(lab_own)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_each_namespace_and_device_is_recorded_before_the_command_that_makes_it():
    """A SIGKILL between `ip netns add` and the state's save left a namespace no state named: the next `up` refused
    it, and `down` did not remove it."""
    events: list[tuple[str, str]] = []
    layout = LabLayout.build({"dc-a": 1, "dc-b": 1}, LINK)
    network.create(layout, lambda kind, what: events.append(("recorded", what)), mtu=9000,
                   run=lambda cmd: events.append(("ran", " ".join(cmd[:4]))))  # fmt: skip
    for dc in layout.datacenters:
        made_ns = events.index(("ran", f"ip netns add {dc.netns}"))
        made_link = events.index(("ran", f"ip link add {dc.host_veth}"))
        assert events.index(("recorded", dc.netns)) < made_ns
        assert events.index(("recorded", dc.host_veth)) < made_link


# --- the CLI's exit codes and JSON ------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--mtu", "10"], ["--cpus-per-node", "0"], ["--name", "../x"]])
def test_figures_that_cannot_make_a_lab_are_invalid_input_exit_2(fake_host, capsys, argv):
    """They were refused with exit 1, the code of a lab that failed, not of input that could never work."""
    rc = cli_main(["lab", "up", "--datacenters", "dc-a:1,dc-b:1", "--json", *argv])
    out = json.loads(capsys.readouterr().out)
    assert rc == 2 and out["error"]["type"] == "urn:meridian:problem:invalid-input", out
    assert not fake_host


def test_a_down_that_leaves_something_says_so_as_an_error(fake_host, capsys, monkeypatch):
    """It exited 1 with a `problems` list but no `error` object, unlike every other verb's failure."""
    _write_state("rev")
    monkeypatch.setattr(lab, "down", lambda name: {"name": name, "ray_processes_stopped": 3, "netns_removed": ["a"],
                                                   "problems": ["namespace mrd-dc-b: Device or resource busy"]})
    rc = cli_main(["lab", "down", "--name", "rev", "--json"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert rc == 1 and out["error"]["type"] == "urn:meridian:problem:lab-down-incomplete"
    assert "mrd-dc-b: Device or resource busy" in out["error"]["detail"] and out["netns_removed"] == ["a"]
    assert "not wholly removed" in captured.err


def test_down_stops_a_delay_line_whose_pid_an_interrupted_up_never_recorded(fake_host, monkeypatch):
    """An `up` killed between starting the delay line and saving its pid left the line running for good: `down`
    knew only recorded pids. It now also finds a line by the namespaces it carries, which are this lab's alone."""
    state = _write_state("rev", netns=["mrd-dc-a", "mrd-dc-b"])
    monkeypatch.setattr(network, "remove", lambda netns, links: [])  # no real namespaces here
    tuns = json.dumps([["mrd-dc-a", "mrdt0"], ["mrd-dc-b", "mrdt1"]])
    other = json.dumps([["mrd-dc-a", "mrdt0"], ["mrd-dc-c", "mrdt1"]])
    sleep = "import time; time.sleep(60)"
    ours = subprocess.Popen([sys.executable, "-c", sleep, "-m", "meridian.lab.delay_line", "--tuns",
                             tuns])  # fmt: skip
    theirs = subprocess.Popen([sys.executable, "-c", sleep, "-m", "meridian.lab.delay_line",
                               "--tuns", other])  # fmt: skip
    try:
        assert state.delay_line_pid == 0
        lab.down("rev")
        assert ours.wait(timeout=15) is not None  # stopped
        assert theirs.poll() is None  # a line that carries other namespaces is not this lab's
    finally:
        for p in (ours, theirs):
            p.kill()
            p.wait()
