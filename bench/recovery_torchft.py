"""The recovery benchmark's torchft side: the same model, data and kill as Meridian's, on torchft 0.2.

Plain processes, no Ray (torchft does not need it): a lighthouse (:mod:`meridian.bench.torchft_lighthouse`)
and one replica group of one worker per slot (``--dcs`` × ``--nodes-per-dc`` processes, :mod:`meridian.bench.torchft_worker`).
One replica group per worker is what torchft's design recommends for plain data parallelism with one
process per node: the replica group is its unit of failure and of healing, so one group per node (here
per worker) loses only that worker on a node's death, where one group per datacenter would drop the whole
datacenter's group from the quorum until every one of its ranks is back. At ``--kill-at-step`` one
worker of the last datacenter gets SIGKILL (its "node" dies with no grace); once the shrunk quorum has
trained ``--back-after-s``, the worker is started again (the node is back) and heals from a peer; the
side stops once that group trains again (or after ``--scale-up-timeout-s``).

The report's ``lighthouse`` says how the shrunk quorum came about, from the lighthouse's own log: torchft has
two outcomes here. The lighthouse forms a quorum without a group that is still heartbeating only from more than
half of the groups it sees heartbeating (its guard against a split brain), and a dead group counts as
heartbeating for ``--torchft-heartbeat-timeout-ms``. When the kill leaves one survivor blocked in its
collective (a peer it waits on gave up on that collective but keeps its sockets open until it re-forms), only two
of four groups ask, and the quorum waits for the dead group's heartbeat to expire (``waited_for_heartbeat_timeout``).
When the victim dies between committing a step and asking for the next quorum, it shares no collective with
anyone: three of four ask and the quorum forms after the 100 ms join timeout (``--torchft-kill-phase
between-steps`` kills it there on purpose).

With ``--cluster ray-start`` Meridian's side crosses the lab's link at ``--lab-rtt-ms``; so does this one: the
lab comes up without Ray, each replica group runs in its datacenter's namespace on a lab node's address (its
store, its manager and its checkpoint server advertise that address, ``GLOO_SOCKET_IFNAME`` its device), and the
lighthouse listens at the head's address.

The replicas' logs and step records live in a temporary folder that the side deletes when it ends; with
``MERIDIAN_BENCH_KEEP=1`` in the environment it is kept (``/tmp/meridian-bench-torchft-*``), to read why a run
went wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from meridian.bench.recovery_cluster import dc_name
from meridian.bench.recovery_measure import Phases, recovery_metrics
from meridian.bench.torchft_lighthouse import reformed_quorum


def records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


class _Lighthouse:
    """torchft's lighthouse in its own process (:mod:`meridian.bench.torchft_lighthouse`), logging every quorum
    decision to ``lighthouse.log`` in the side's folder, so the report can say why the survivors waited."""

    START_TIMEOUT_S = 30.0

    def __init__(self, folder: Path, heartbeat_timeout_ms: int | None) -> None:
        cmd = [sys.executable, "-m", "meridian.bench.torchft_lighthouse"]
        if heartbeat_timeout_ms is not None:
            cmd += ["--heartbeat-timeout-ms", str(heartbeat_timeout_ms)]
        self.log_path = folder / "lighthouse.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         env={**os.environ, "RUST_LOG": "info"}, text=True)  # fmt: skip
        self.address = self._read_address()

    def _read_address(self) -> str:
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if sel.select(self.START_TIMEOUT_S) and (line := self.proc.stdout.readline().strip()):
                return line
        self.stop()
        raise RuntimeError(f"torchft's lighthouse did not say its address within {self.START_TIMEOUT_S:.0f} s "
                           f"(exit code {self.proc.returncode}):\n{self.log()[-2000:]}")  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """Close its stdin (it shuts the lighthouse down and exits); kill it if it has not within 10 s."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class _Workers:
    def __init__(self, args: argparse.Namespace, lighthouse: str, folder: Path, lab_state: Any = None) -> None:
        self.args, self.lighthouse, self.folder, self.lab_state = args, lighthouse, folder, lab_state
        self.procs: dict[int, subprocess.Popen] = {}
        self.dcs = [dc_name(d) for d in range(args.dcs) for _ in range(args.nodes_per_dc)]

    def start(self, replica: int) -> None:
        a = self.args
        cmd = [sys.executable, "-m", "meridian.bench.torchft_worker", "--replica", str(replica),
               "--datacenter", self.dcs[replica], "--lighthouse", self.lighthouse,
               "--out", str(self.folder / f"replica-{replica}.jsonl"), "--model", a.model, "--steps", str(a.steps),
               "--global-batch", str(a.global_batch), "--micro-batch", str(a.micro_batch)]  # fmt: skip
        if a.torchft_kill_phase == "between-steps":
            cmd += ["--die-on", str(self.folder / f"die-{replica}"), "--died-at", str(self.folder / f"died-{replica}")]
        env = {**os.environ}
        if self.lab_state is not None:  # on the lab node of the same slot, in its datacenter's namespace
            from meridian.lab import network

            dc = self.lab_state.layout.datacenters[replica // a.nodes_per_dc]
            cmd = network.in_ns(dc.netns, [*cmd, "--host", dc.nodes[replica % a.nodes_per_dc].ip])
            env["GLOO_SOCKET_IFNAME"] = dc.dc_veth
        log = open(self.folder / f"replica-{replica}.log", "a")  # noqa: SIM115 - the child owns it
        self.procs[replica] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def kill(self, replica: int) -> None:
        self.procs[replica].send_signal(signal.SIGKILL)
        self.procs[replica].wait(10)

    def kill_between_steps(self, replica: int, timeout_s: float = 30.0) -> float:
        """Have ``replica`` SIGKILL itself right after its next committed step, before it asks for the next
        quorum; return once it has exited, with the wall-clock time it stamped right before its kill."""
        order, stamp = self.folder / f"die-{replica}", self.folder / f"died-{replica}"
        order.touch()
        try:
            self.procs[replica].wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"torchft replica {replica} did not kill itself within {timeout_s:.0f} s of "
                               "being told to (it commits no steps?)") from None  # fmt: skip
        finally:
            order.unlink(missing_ok=True)  # a group started again later must not die too
        if self.procs[replica].returncode != -signal.SIGKILL or not stamp.exists():
            raise RuntimeError(f"torchft replica {replica} exited with {self.procs[replica].returncode} "
                               "instead of killing itself after a step")  # fmt: skip
        return float(stamp.read_text())

    def failed(self) -> str | None:
        for r, p in self.procs.items():
            if p.poll() not in (None, 0, -signal.SIGKILL):
                tail = (self.folder / f"replica-{r}.log").read_text()[-2000:]
                return f"torchft replica {r} exited with {p.returncode}:\n{tail}"
        return None

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)


@contextlib.contextmanager
def torchft_groups(args: argparse.Namespace) -> Iterator[tuple[_Workers, _Lighthouse, Path, Any]]:
    """torchft's lighthouse and one replica group per worker, started together (every group's first quorum has
    them all): yields ``(workers, lighthouse, folder, lab_state)``; stops and removes all of it on leaving."""
    folder = Path(tempfile.mkdtemp(prefix="meridian-bench-torchft-"))
    # torchft's defaults for the quorum (join timeout, tick) and, unless asked otherwise, the heartbeat timeout.
    lighthouse = _Lighthouse(folder, args.torchft_heartbeat_timeout_ms)
    try:
        lab_state = _lab_up(args) if getattr(args, "cluster", "embedded") == "ray-start" else None
    except BaseException:
        lighthouse.stop()
        raise
    address = lighthouse.address
    if lab_state is not None:  # the lab's datacenters reach this namespace at the head's address
        from meridian.lab.layout import HEAD_IP

        address = f"http://{HEAD_IP}:{address.rsplit(':', 1)[1]}"
    n = args.dcs * args.nodes_per_dc
    workers = _Workers(args, address, folder, lab_state)
    deadline = time.monotonic() + args.timeout_s
    try:
        for r in range(n):
            workers.start(r)
        while not all((folder / f"ready-{r}").exists() for r in range(n)):
            if (why := workers.failed()) is not None or time.monotonic() > deadline:
                raise RuntimeError(why or "torchft side: the workers did not start in time")
            time.sleep(0.1)
        (folder / "go").touch()
        yield workers, lighthouse, folder, lab_state
    finally:
        workers.stop()
        lighthouse.stop()
        if lab_state is not None:
            from meridian.lab import lab

            lab.down(LAB_NAME)
        if not os.environ.get("MERIDIAN_BENCH_KEEP"):
            shutil.rmtree(folder, ignore_errors=True)  # the replicas' step logs and checkpoints (~20 MB a run)


def kill_victim(args: argparse.Namespace, workers: _Workers, victim: int, phases: Phases) -> None:
    """Kill replica group ``victim`` as ``--torchft-kill-phase`` says, stamping ``phases``' kill and death."""
    if args.torchft_kill_phase == "between-steps":
        phases.killed(at=workers.kill_between_steps(victim))
    else:
        phases.killed()
        workers.kill(victim)  # returns once the process has exited
    phases.dead()


def run_torchft(args: argparse.Namespace) -> dict[str, Any]:
    n = args.dcs * args.nodes_per_dc
    victim = n - 1  # a worker of the last datacenter
    deadline = time.monotonic() + args.timeout_s
    with torchft_groups(args) as (workers, lighthouse, folder, lab_state):
        watched = folder / "replica-0.jsonl"  # a group that is never killed: the job's step log
        phases = Phases(args, n)
        while (action := phases.next_action(records(watched))) != "done":
            if (why := workers.failed()) is not None:
                raise RuntimeError(why)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the torchft side did not finish within {args.timeout_s:.0f} s")
            if action == "kill":
                kill_victim(args, workers, victim, phases)
            elif action == "back":
                phases.came_back()
                workers.start(victim)
            time.sleep(0.2)
        if phases.kill_time is None:
            raise RuntimeError("the torchft side finished before the kill")
        out = recovery_metrics(records(watched), kill_time=phases.kill_time, full_workers=n, survivors=n - 1,
                               tokens_per_step=args.tokens_per_step, back_time=phases.back_time)  # fmt: skip
        out["victim_exited_s"] = phases.victim_exited_s()
        out["lighthouse"] = reformed_quorum(lighthouse.log(), kill_time=phases.kill_time, full=n)
        out["cpu_from_kill_to_return"] = phases.cpu_report()
        out["runs_on"] = "plain processes, no Ray: a torchft lighthouse and one replica group per worker" + (
            f", each in its datacenter's lab namespace across the same {args.lab_rtt_ms:g} ms / {args.lab_gbps:g} "
            "Gbit/s link as Meridian's side" if lab_state is not None else "")
        out["replica_groups"] = n
        out["killed"] = f"SIGKILL of replica group {victim}'s process (in {workers.dcs[victim]})" + (
            ", by itself right after a committed step, before it asked for the next quorum"
            if args.torchft_kill_phase == "between-steps" else ", at whatever point of a step it was")  # fmt: skip
        return out


LAB_NAME = "bench-recovery-torchft"


def _lab_up(args: argparse.Namespace) -> Any:
    """With ``--cluster ray-start`` Meridian's side crosses the lab's link; so does this side: the lab's
    namespaces and link (no Ray), one replica group on each node's address."""
    from meridian.lab import lab

    lab.down_if_up(LAB_NAME)
    return lab.up({dc_name(d): args.nodes_per_dc for d in range(args.dcs)}, rtt_ms=args.lab_rtt_ms,
                  gbps=args.lab_gbps, name=LAB_NAME, ray=False)
