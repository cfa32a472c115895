"""``meridian lab up | probe | status | down``: a multi-datacenter Ray cluster on one machine, over real TCP.

``up`` builds the network (:mod:`~meridian.lab.network`), starts the delay line
(:mod:`~meridian.lab.delay_line`), a Ray head in the host namespace (no CPUs: the control
plane, and where ``meridian serve --address`` connects) and one Ray node per lab node inside its datacenter's
namespace, labelled ``datacenter=<name>``, with ``GLOO_SOCKET_IFNAME`` set to the namespace's device. Each
step is written to the lab's state file before it is taken, so ``down`` removes exactly what ``up`` made
(never ``ray stop``, which would kill every Ray process on the host), even after a failure half-way.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from meridian.lab import delay_line, network
from meridian.lab.layout import HEAD_IP, LabDatacenter, LabLayout, LabNode, LinkSpec

STATE_DIR = Path("/run/meridian-lab")
RAY_PORT = 6390
DASHBOARD_PORT = 8266
NODE_PORT_BASE = 21000
"""Nodes of one datacenter share a namespace, so each gets its own block of ports from here."""
PORTS_PER_NODE = 10
NODES_TIMEOUT_S = 180.0
AUTH_MODE = "RAY_AUTH_MODE"
"""Ray's switch for token authentication: one value for every Ray process the lab starts (:func:`_ray_env`)."""


class LabError(RuntimeError):
    """What went wrong, in words a person can act on."""


class InvalidLab(LabError, ValueError):
    """Figures that cannot make a lab (a name, the MTU, CPUs per node, the delay line): refused before anything is
    made; the CLI's exit code 2, as for any invalid input."""


@dataclass
class LabState:
    name: str
    datacenters: dict[str, int]
    rtt_ms: float
    gbps: float
    mtu: int
    cpus_per_node: int
    ray_port: int = RAY_PORT
    dashboard_port: int = DASHBOARD_PORT
    netns: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    delay_line_pid: int = 0
    delay_line: str = ""
    """Which line carries the link: ``native`` (``delay_line.c``) or ``python``."""
    delay_line_note: str = ""
    """Why ``auto`` fell back to the Python line, if it did."""
    ray_temp_dir: str = ""
    started: bool = False
    ray: bool = True
    """Whether ``up`` starts a Ray cluster (``False``: the network and the delay line only)."""

    @property
    def layout(self) -> LabLayout:
        return LabLayout.build(self.datacenters, LinkSpec(self.rtt_ms, self.gbps))

    @property
    def delay_line_log(self) -> Path:
        """What the delay line printed (its counts when stopped, or why it failed)."""
        return Path(self.ray_temp_dir).parent / f"meridian-lab-{self.name}-delay-line.log"

    @property
    def ray_address(self) -> str:
        return f"{HEAD_IP}:{self.ray_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def summary(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "name": self.name, "ray_address": self.ray_address, "dashboard": self.dashboard_url,
            "rtt_ms": self.rtt_ms, "gbps": self.gbps, "mtu": self.mtu, "delay_line": self.delay_line,
            **({"delay_line_note": self.delay_line_note} if self.delay_line_note else {}),
            "datacenters": [{"name": dc.name, "netns": dc.netns, "link_device": dc.tun, "gloo_ifname": dc.dc_veth,
                             "nodes": [n.ip for n in dc.nodes]} for dc in lay.datacenters],
            "serve": f"meridian serve --address {self.ray_address}",
        }  # fmt: skip


LAB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")
RAY_TEMP_PREFIX = "/tmp/meridian-lab-"
RAY_SOCKET_TAIL = len("/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store.3200")
"""The longest path Ray puts below a node's temp dir: its session (a date and the head's pid, up to 7 digits) and
the object store's socket, numbered per node of the session."""
RAY_LAB_NAME_MAX = 107 - len(RAY_TEMP_PREFIX) - RAY_SOCKET_TAIL
"""A Unix socket's path holds at most 107 bytes, and Ray's sockets lie below the lab's temp dir, which carries the
lab's name: a longer name made ``ray start --head`` fail after the network was built."""
LOCK_FILE = "lab.lock"
NODE_MEMORY_BYTES = 140 * 2**20
"""What one idle lab node's Ray processes hold (its raylet, dashboard agent and runtime-env agent: 136-138 MB of
PSS each, measured on 2026-11-28 with Ray 2.60), before any job's worker starts on it."""
MTU_RANGE = (1280, 65535)
"""IPv6's minimum (Ray and gloo may use it) to the largest a TUN device takes."""


def state_path(name: str) -> Path:
    """Where the lab ``name`` records what it made; the name becomes a file name and part of Ray's temp dir, so
    it is letters, digits, ``-`` and ``_`` only (a ``../`` in it would have written outside the state dir)."""
    if not LAB_NAME.fullmatch(name):
        raise InvalidLab(f"lab name {name!r}: use 1-32 letters, digits, '-' or '_', starting with a letter or digit")
    return STATE_DIR / f"{name}.json"


def load_state(name: str) -> LabState:
    path = state_path(name)
    if not path.exists():
        others = other_labs(name)
        hint = (f"; lab {others[0]!r} is: pass `--name {others[0]}`" if others
                else "; start one with `meridian lab up`")  # fmt: skip
        raise LabError(f"no lab named {name!r} is up (no {path}){hint}")
    return LabState(**json.loads(path.read_text()))


def _save(state: LabState) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = state_path(state.name).with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=1))
    tmp.replace(state_path(state.name))


@contextlib.contextmanager
def _locked(verb: str) -> Iterator[None]:
    """Hold the lab's lock while ``up`` or ``down`` changes what exists. Every lab uses the same head address,
    ports and device names, so one ``up`` or ``down`` runs at a time, whatever its lab's name: a ``down`` while an
    ``up`` ran removed what ``up`` had recorded so far while ``up`` went on making more. The kernel drops the lock
    when its holder dies, even by SIGKILL, so a killed ``up`` leaves no lock behind."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    path = STATE_DIR / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise LabError(f"cannot {verb} now: {holder} is changing the lab (lock {path}); wait for it to finish, "
                           "or interrupt it with Ctrl-C (an interrupted `up` removes what it made)") from None  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"`meridian lab {verb}` (pid {os.getpid()})".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def other_labs(name: str) -> list[str]:
    """The names of the labs that are up (or half made) besides ``name``."""
    if not STATE_DIR.is_dir():
        return []
    return sorted(p.stem for p in STATE_DIR.glob("*.json") if p.stem != name and LAB_NAME.fullmatch(p.stem))


def _require_root() -> None:
    if os.geteuid() != 0:
        raise LabError("the lab creates network namespaces and devices: run it as root (sudo meridian lab ...)")


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _ray_env(**extra: str) -> dict[str, str]:
    """The environment of every Ray process the lab starts. One authentication mode for all of them: Ray 2.5x's
    ``ray start --head`` turns token authentication on by itself when ``~/.ray/auth_token`` exists (any plain
    local ``ray.init()`` writes one), while ``ray start --address`` and a driver given an address do not, so the
    lab's nodes were refused ("InvalidAuthToken"). The user's ``RAY_AUTH_MODE`` when set (``token``: every node
    and driver reads the same token file), else ``disabled``: a lab on one machine, its head on a test address."""
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", AUTH_MODE: os.environ.get(AUTH_MODE, "disabled"), **extra}


def node_ports(index_in_dc: int) -> list[str]:
    base = NODE_PORT_BASE + PORTS_PER_NODE * index_in_dc
    names = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port"]  # fmt: skip
    return [arg for i, flag in enumerate(names) for arg in (flag, str(base + i))]


def up(datacenters: dict[str, int], *, rtt_ms: float, gbps: float, name: str = "lab", cpus_per_node: int = 1,
       mtu: int = 9000, timeout_s: float = NODES_TIMEOUT_S, ray: bool = True,
       line: str = "auto") -> LabState:  # fmt: skip
    """Build the lab; ``ray=False`` builds only the network and the delay line (``meridian bench lab`` starts
    its own processes in the namespaces). ``line`` chooses the delay line (:data:`delay_line.KINDS`)."""
    _require_root()
    if line not in delay_line.KINDS:
        raise InvalidLab(f"delay line {line!r}: choose one of {', '.join(delay_line.KINDS)}")
    if cpus_per_node < 1:
        raise InvalidLab(f"cpus_per_node must be at least 1, got {cpus_per_node}: a node without CPUs runs no worker")
    if not MTU_RANGE[0] <= mtu <= MTU_RANGE[1]:
        raise InvalidLab(f"mtu must be between {MTU_RANGE[0]} and {MTU_RANGE[1]}, got {mtu}")
    if ray and len(name) > RAY_LAB_NAME_MAX:
        raise InvalidLab(f"lab name {name!r} is {len(name)} characters; a lab with Ray takes at most "
                       f"{RAY_LAB_NAME_MAX}: Ray's socket paths below {RAY_TEMP_PREFIX}{name} must fit in 107 bytes")  # fmt: skip
    layout = LabLayout.build(datacenters, LinkSpec(rtt_ms, gbps))  # checks the spec before anything is made
    if ray:
        _check_memory(len(layout.nodes) + 1)  # and the head
    with _locked("up"):
        return _up(datacenters, layout, rtt_ms=rtt_ms, gbps=gbps, name=name, cpus_per_node=cpus_per_node, mtu=mtu,
                   timeout_s=timeout_s, ray=ray, line=line)  # fmt: skip


def available_memory() -> int:
    """The bytes this machine can give new processes without swapping (``MemAvailable``)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise LabError("/proc/meminfo has no MemAvailable: cannot tell whether the lab's nodes fit in memory")


def _check_memory(ray_nodes: int) -> None:
    """Refuse a lab whose idle Ray nodes alone would take more than half of the memory available: its jobs'
    workers need the rest (a 200-datacenter lab of 16 nodes each was accepted, and would have started 3,200)."""
    need, available = ray_nodes * NODE_MEMORY_BYTES, available_memory()
    if need > available / 2:
        raise LabError(f"{ray_nodes} Ray nodes (the head included) would hold ~{need / 2**30:.1f} GiB before any job "
                       f"runs (~{NODE_MEMORY_BYTES / 2**20:.0f} MB each), more than half of the "
                       f"{available / 2**30:.1f} GiB this machine has available, and a job's workers need the rest: "
                       "ask for fewer nodes")  # fmt: skip


def _up(datacenters: dict[str, int], layout: LabLayout, *, rtt_ms: float, gbps: float, name: str,
        cpus_per_node: int, mtu: int, timeout_s: float, ray: bool, line: str) -> LabState:  # fmt: skip
    if state_path(name).exists():
        raise LabError(f"a lab named {name!r} is already up, or a killed `up` left it half made "
                       f"({state_path(name)}); `meridian lab down --name {name}` removes it")  # fmt: skip
    others = other_labs(name)
    if others:
        raise LabError(f"lab {others[0]!r} is up ({state_path(others[0])}); every lab uses the head address "
                       f"{HEAD_IP}, the same ports and device names, so one runs at a time: "
                       f"`meridian lab down --name {others[0]}` first")  # fmt: skip
    taken = [dc.netns for dc in layout.datacenters if Path(f"/run/netns/{dc.netns}").exists()]
    taken += [dc.host_veth for dc in layout.datacenters if Path(f"/sys/class/net/{dc.host_veth}").exists()]
    if taken:
        raise LabError(f"network namespaces or devices {taken} already exist but no lab state names them: remove "
                       "them (`ip netns del NAME`, `ip link del NAME`) if they are left from an earlier lab")  # fmt: skip
    state = LabState(name=name, datacenters=dict(datacenters), rtt_ms=rtt_ms, gbps=gbps, mtu=mtu, ray=ray,
                     cpus_per_node=cpus_per_node, ray_temp_dir=f"{RAY_TEMP_PREFIX}{name}")  # fmt: skip
    _save(state)
    try:
        def made(kind: str, what: str) -> None:
            (state.netns if kind == "netns" else state.links).append(what)
            _save(state)

        network.create(layout, made, mtu=mtu)
        _start_delay_line(state, layout, line)
        if ray:
            _start_ray(state, layout, timeout_s)
    except network.NetworkError as e:
        _down(name)
        raise LabError(f"building the lab's network failed, and what it had made is removed: {e}") from None
    except BaseException:
        _down(name)
        raise
    state.started = True
    _save(state)
    return state


def _start_delay_line(state: LabState, layout: LabLayout, line: str) -> None:
    tuns = [(dc.netns, dc.tun) for dc in layout.datacenters]
    try:
        cmd, state.delay_line, state.delay_line_note = delay_line.command(tuns, layout.link.rtt_ms / 2, line,
                                                                          STATE_DIR)  # fmt: skip
    except delay_line.NativeLineUnavailable as e:
        raise LabError(str(e)) from None
    log = open(state.delay_line_log, "wb")  # noqa: SIM115 - this line's words only: `check_delay_line` quotes them
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    state.delay_line_pid = proc.pid
    _save(state)
    time.sleep(0.3)
    if proc.poll() is not None:
        raise LabError(f"the delay line exited at start (code {proc.returncode}); see {log.name}")


def _start_ray(state: LabState, layout: LabLayout, timeout_s: float) -> None:
    head = [_ray_bin(), "start", "--head", "--node-ip-address", HEAD_IP, "--port", str(state.ray_port),
            "--num-cpus", "0", "--num-gpus", "0",
            "--dashboard-host", "127.0.0.1", "--dashboard-port", str(state.dashboard_port),
            "--ray-client-server-port", str(state.ray_port + 1), "--temp-dir", state.ray_temp_dir,
            "--disable-usage-stats", *node_ports(PORTS_PER_NODE)]  # fmt: skip
    _run_ray(head, _ray_env())
    for dc in layout.datacenters:
        for node in dc.nodes:
            start_node(state, dc, node)
    _wait_for_nodes(state, len(layout.nodes) + 1, timeout_s)


def start_node(state: LabState, dc: LabDatacenter, node: LabNode) -> None:
    """``ray start`` one lab node in its datacenter's namespace (at ``up``, or again after it was killed)."""
    cmd = network.in_ns(dc.netns, [
        _ray_bin(), "start", "--address", state.ray_address, "--node-ip-address", node.ip,
        "--num-cpus", str(state.cpus_per_node), "--num-gpus", "0", "--labels", f"datacenter={dc.name}",
        "--temp-dir", state.ray_temp_dir, "--disable-usage-stats", *node_ports(node.index),
    ])  # fmt: skip
    _run_ray(cmd, _ray_env(GLOO_SOCKET_IFNAME=dc.dc_veth))


def kill_ray_node(node_id: str, timeout_s: float = 5.0, at_kill: Callable[[], None] | None = None,
                  at_dead: Callable[[], None] | None = None) -> int:
    """A Ray node of this machine dies as a machine dies: SIGKILL its raylet (found by ``--node_id=`` on its
    command line), then every process it started (agents, workers, their training processes), all within
    milliseconds, so none trains on after the "death" and its ports are free for a node that comes back.
    Works for any node on this machine (the lab's, or one that ``ray.cluster_utils`` started). ``at_kill`` is
    called right before the first signal, once the processes are found (15-20 ms of reading ``/proc`` on a busy
    machine, which is not the node's death: a benchmark starts its clock there), and ``at_dead`` as soon as the
    last of them is seen exited (polled every 5 ms). Returns, once all of them have exited, the raylet's pid."""
    raylet = [p for p in lab_processes(f"--node_id={node_id}") if _comm(p) == "raylet"]
    if not raylet:
        raise LabError(f"no raylet of node {node_id} runs on this machine")
    family = descendants(raylet)
    if at_kill is not None:
        at_kill()
    for pid in family:  # the raylet first: the failure the cluster sees is the raylet's
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    # SIGKILL only marks a process; it dies when the kernel next runs it, which on a busy machine can be
    # milliseconds later. Return once every one has exited, so that "killed" means dead to the caller.
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in family if not process_exited(p)]) and time.monotonic() < deadline:
        time.sleep(0.005)
    if alive:
        raise LabError(f"processes {alive} of node {node_id} still run {timeout_s:.0f} s after SIGKILL")
    if at_dead is not None:
        at_dead()
    return raylet[0]


def delay_line_running(state: LabState) -> bool:
    """The lab's delay line still runs (its pid, not a process that reused it): without it every inter-DC packet
    is lost and a job's collectives wait out their timeout."""
    pid = state.delay_line_pid
    if not pid or process_exited(pid):
        return False
    try:
        return b"delay" in Path(f"/proc/{pid}/cmdline").read_bytes()  # delay-line-<hash>, or …lab.delay_line
    except OSError:
        return False


def check_delay_line(state: LabState) -> None:
    """Raise, with the line's last words, unless the lab's delay line runs."""
    if delay_line_running(state):
        return
    try:
        said = " | ".join(state.delay_line_log.read_text(errors="replace").strip().splitlines()[-3:])
    except OSError:
        said = ""
    raise LabError(f"the lab's delay line (pid {state.delay_line_pid}) is not running, so nothing crosses between "
                   f"datacenters{f' (it said: {said})' if said else ''}; see {state.delay_line_log}, then "
                   f"`meridian lab down --name {state.name}` and `up` again")  # fmt: skip


def process_exited(pid: int) -> bool:
    """No longer listed, or a zombie its parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _run_ray(cmd: list[str], env: dict[str, str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    if out.returncode != 0:
        said = ANSI_ESCAPE.sub("", out.stderr.strip() or out.stdout.strip())  # Ray colours its terminal output
        raise LabError(f"`{' '.join(cmd[:6])} …` failed (exit code {out.returncode}): "
                       + " | ".join(said.splitlines()[-5:]))  # fmt: skip


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def alive_nodes(state: LabState) -> list[dict[str, Any]]:
    from ray.util.state import list_nodes

    nodes = list_nodes(address=state.dashboard_url, timeout=10, raise_on_missing_output=False)
    return [{"ip": n.node_ip, "labels": dict(n.labels or {}), "node_id": n.node_id}
            for n in nodes if n.state == "ALIVE"]  # fmt: skip


def status(name: str = "lab") -> dict[str, Any]:
    """What the lab ``name`` is, and what of it runs: never raises for a lab that is broken (its delay line or Ray
    head dead, or its ``up`` interrupted), it says so: ``started``, ``delay_line_running``, ``ray_error``."""
    state = load_state(name)
    out = state.summary() | {"started": state.started, "delay_line_running": delay_line_running(state),
                             "delay_line_log": str(state.delay_line_log), "alive_nodes": [], "ray_error": ""}  # fmt: skip
    if state.ray:
        try:
            out["alive_nodes"] = alive_nodes(state)
        except Exception as e:  # noqa: BLE001 - a dead head is what status is asked to show, not a traceback
            said = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            out["ray_error"] = (f"the lab's Ray head does not answer at {state.dashboard_url} ({said}); "
                                f"`meridian lab down --name {name}` and `up` again")  # fmt: skip
    return out


def _wait_for_nodes(state: LabState, expected: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    seen: list[dict[str, Any]] = []
    last_error = ""
    while time.monotonic() < deadline:
        try:
            seen = alive_nodes(state)
        except Exception as e:  # noqa: BLE001 - the dashboard starts a few seconds after the head
            last_error = str(e)
        if len(seen) >= expected:
            return
        time.sleep(1.0)
    raise LabError(f"only {len(seen)} of {expected} Ray nodes came up within {timeout_s:.0f} s"
                   + (f" (last error: {last_error})" if last_error else ""))  # fmt: skip


def _other_processes() -> Iterator[tuple[int, list[bytes]]]:
    """Every process but this one, with its command line split into arguments (empty once it is gone)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            yield int(proc.name), _argv(int(proc.name))


def lab_processes(text: str) -> list[int]:
    """Pids of the processes whose command line contains ``text`` (``--node_id=…``, a temp dir)."""
    return [pid for pid, argv in _other_processes() if text.encode() in b"\0".join(argv)]


def ray_cluster_processes(temp_dir: str, gcs_port: int) -> list[int]:
    """Every process of the Ray cluster started here with ``--temp-dir temp_dir --port gcs_port``, and every process
    below them: those that name the temp dir, and the Ray client server, which names only the GCS's address
    (``--address=IP:PORT``) and, left behind, runs on for a minute waiting for the GCS to come back."""
    suffix = f":{gcs_port}".encode()
    client = [pid for pid, argv in _other_processes()
              if any(a.startswith(b"--address=") and a.endswith(suffix) for a in argv)]  # fmt: skip
    return descendants(list(dict.fromkeys(lab_processes(temp_dir) + client)))


RAY_GRACE_S = 3.0
"""How long ``down`` lets the lab's Ray processes stop on SIGTERM before SIGKILL. All but two stop within ~2 s;
``gcs_server`` and the autoscaler's monitor outlast 10 s, and a lab's cluster has nothing worth their wait."""


def _kill(pids: list[int], grace_s: float = 10.0) -> list[int]:
    """SIGTERM ``pids``, SIGKILL those still running after ``grace_s``; returns the ones that needed it."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and [p for p in pids if not process_exited(p)]:
        time.sleep(0.05)
    left = [p for p in pids if not process_exited(p)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:  # one this process started (the delay line, when `up` ran here) stays a zombie until reaped
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
    return left


def _argv(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _is_lab_ray_process(argv: list[bytes], temp_dir: bytes, address: bytes) -> bool:
    """Ray gives each of its processes the lab's temp dir, or a path below it, as an option's value
    (``--temp-dir=…``, ``--log_dir=…/session_…/logs``; ``ray start --temp-dir …`` itself); the head's Ray client
    server has only the head's address. A bare substring also matched what merely names such a path (a user's
    ``tail -f /tmp/meridian-lab-lab-delay-line.log``), another lab's whose name starts with this one's, and any
    program given ``--address=<the head>`` (a ``meridian serve`` of the user's): ``down`` killed them."""
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition(b"=")
        if not (eq and flag.startswith(b"--")):
            flag, value = (argv[i - 1] if i else b""), arg
            if flag != b"--temp-dir":
                continue
        if value == temp_dir or value.startswith(temp_dir + b"/"):
            return True
    return f"--address={address.decode()}".encode() in argv and b"ray.util.client.server" in argv


def _delay_lines_of(state: LabState) -> list[int]:
    """The delay-line processes (native or Python) whose namespaces are exactly this lab's."""
    want, found = set(state.netns), []
    for pid, raw in _other_processes():
        argv = [a.decode(errors="replace") for a in raw if a]
        if argv and Path(argv[0]).name.startswith("delay-line-"):  # <binary> <one-way µs> <offload> (ns dev)...
            carried = set(argv[3::2])
        elif "meridian.lab.delay_line" in argv and "--tuns" in argv[:-1]:
            try:
                carried = {ns for ns, _ in json.loads(argv[argv.index("--tuns") + 1])}
            except (ValueError, TypeError):
                continue
        else:
            continue
        if want and carried == want:
            found.append(pid)
    return found


def _ray_processes(state: LabState) -> list[int]:
    """Every process of the lab's Ray cluster (:func:`_is_lab_ray_process`), and their descendants (Ray's workers
    name neither the temp dir nor the address)."""
    if not state.ray_temp_dir:
        return []
    temp_dir, address = state.ray_temp_dir.encode(), state.ray_address.encode()
    return descendants([pid for pid, argv in _other_processes() if _is_lab_ray_process(argv, temp_dir, address)])


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def descendants(roots: list[int]) -> list[int]:
    """``roots`` (in their order) and every process below them."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(proc.name))
    found: list[int] = []
    todo = list(reversed(roots))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.append(pid)
            todo += children.get(pid, [])
    return found


def down_if_up(name: str) -> None:
    """Remove what an interrupted earlier run left of the lab ``name``, if it left anything (a benchmark's own lab
    before it brings that lab up)."""
    if state_path(name).exists():
        down(name)


def down(name: str = "lab") -> dict[str, Any]:
    """Remove everything the lab made: its Ray processes, the delay line, namespaces and devices."""
    _require_root()
    state_path(name)  # a name that cannot be a lab's is refused before the lock is taken
    with _locked("down"):
        return _down(name)


def _down(name: str) -> dict[str, Any]:
    state = load_state(name)
    killed = _ray_processes(state)
    _kill(killed, RAY_GRACE_S)
    pid = state.delay_line_pid
    # a zombie still goes to _kill, which reaps it; a live process that reused a dead line's pid is left alone
    if pid and Path(f"/proc/{pid}").exists() and (process_exited(pid) or delay_line_running(state)):
        _kill([pid])
    # A line started by an `up` killed before it recorded the pid: found by what it carries, this lab's namespaces
    # (one lab runs at a time, so no other lab's line names them).
    _kill([p for p in _delay_lines_of(state) if p != pid])
    problems = network.remove(state.netns, state.links)
    if not problems:
        state_path(name).unlink(missing_ok=True)
    return {"name": name, "ray_processes_stopped": len(killed), "netns_removed": state.netns,
            "problems": problems}  # fmt: skip


def probe(name: str = "lab", *, bulk_mb: float = 64, pings: int = 20, timeout_s: float = 60) -> dict[str, Any]:
    """RTT and bulk TCP throughput from the first node of the first datacenter to the first node of each
    other datacenter, with the bytes and packets the kernel counted on the sender's link device."""
    _require_root()
    state = load_state(name)
    check_delay_line(state)  # else every probe waits out its timeout
    lay = state.layout
    src = lay.datacenters[0]
    rows = []
    for dst in lay.datacenters[1:]:
        port = 29000 + dst.index
        server = subprocess.Popen(network.in_ns(dst.netns, [
            sys.executable, "-m", "meridian.lab.tcp_probe", "serve", "--host", dst.nodes[0].ip,
            "--port", str(port), "--timeout-s", str(timeout_s)]), stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        try:
            before = network.link_bytes(src.netns, src.tun)
            out = subprocess.run(network.in_ns(src.netns, [
                sys.executable, "-m", "meridian.lab.tcp_probe", "measure", "--host",
                dst.nodes[0].ip, "--port", str(port), "--source", src.nodes[0].ip, "--pings", str(pings),
                "--bulk-mb", str(bulk_mb), "--timeout-s", str(timeout_s)]),
                capture_output=True, text=True, timeout=timeout_s * 2)  # fmt: skip
            after = network.link_bytes(src.netns, src.tun)
            if out.returncode != 0:
                raise LabError(f"the probe from {src.name} to {dst.name} failed: {out.stderr.strip()[-500:]}")
            row = json.loads(out.stdout)
            row.update(src=src.name, dst=dst.name, link_tx_bytes=after["tx_bytes"] - before["tx_bytes"],
                       link_tx_packets=after["tx_packets"] - before["tx_packets"])
            rows.append(row)
        finally:
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=5)
            if server.poll() is None:
                server.kill()
    return {"name": name, "configured": {"rtt_ms": state.rtt_ms, "gbps": state.gbps}, "links": rows}
