"""The training process's side of the agent's pipe: calls to the coordinator and the sinks through the agent,
and the process's main function (:func:`child_main`), run by a standby once the agent says ``go``."""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
from typing import Any

import torch

from meridian.workers.contracts.config import TrainConfig
from meridian.workers.contracts.records import StepRecord
from meridian.workers.elastic.pipe import recv, send
from meridian.workers.elastic.profiling import StepProfiler
from meridian.workers.elastic.protocol import (
    BEATS_EVERY_S,
    LEAVING,
    RECOVERED,
    beats_every_s,
    re_forms_in_process,
)
from meridian.workers.state.snapshots import SnapshotStore


# -- the pipe between agent and child ----------------------------------------------------------------------
class PipeClient:
    """The child's end: request/response calls (thread-safe) and one-way messages."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def call(self, method: str, *args: Any) -> Any:
        with self._lock:
            send(self.conn, ("call", method, args))
            ok, value = recv(self.conn)
        if not ok:
            raise RuntimeError(value)
        return value

    def tell(self, kind: str, *payload: Any) -> None:
        with self._lock:
            send(self.conn, (kind, *payload))

    def leaving(self) -> None:
        """Tell the agent this process exits to be restarted, so it hands over to the next one at once instead
        of when the exit completes (a torch process takes ~30 ms to exit). Skipped when another thread's call
        holds the pipe: the agent then sees the exit, as before."""
        if not self._lock.acquire(timeout=0.05):
            return
        try:
            with contextlib.suppress(OSError):  # the agent is gone: nobody to hand over to
                send(self.conn, (LEAVING,))
        finally:
            self._lock.release()


class PipeSink:
    """Rank 0's step records, one message each; every rank's heartbeats in batches (:data:`BEATS_EVERY_S`)."""

    def __init__(self, client: PipeClient, beats_every_s: float = BEATS_EVERY_S,
                 on_beat: Any = None) -> None:
        self.client = client
        self.on_beat = on_beat
        """Sees every heartbeat on the training thread (the profiler's step boundaries)."""
        self._beats: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._every_s = beats_every_s
        self._thread = threading.Thread(target=self._send_beats, name="meridian-beats", daemon=True)
        self._thread.start()

    def step(self, record: StepRecord) -> None:
        self.client.tell("progress", record)  # the record itself: the pipe pickles the dataclass

    def pace(self, world_size: int) -> None:
        """Batch for as long as an epoch of ``world_size`` ranks does (:func:`beats_every_s`), from the next batch."""
        self._every_s = beats_every_s(world_size)

    def rank_step(self, beat: dict[str, Any]) -> None:
        if self.on_beat is not None:
            self.on_beat(beat)
        with self._lock:
            self._beats.append(beat)

    def flush(self) -> None:
        with self._lock:
            beats, self._beats = self._beats, []
        if beats:
            self.client.tell("beats", beats)

    def close(self) -> None:
        """Send what is left and stop the batching thread (before the process says it is done)."""
        self._stop.set()
        self._thread.join()
        self.flush()

    def _send_beats(self) -> None:
        while not self._stop.wait(self._every_s):
            try:
                self.flush()
            except OSError:  # the agent is gone: this process is about to be stopped
                return


def child_main(conn: Any, cfg: TrainConfig, ids: dict[str, Any], store_dir: str, device: str,
               threads: int | None, store: Any = None) -> None:
    """Train until the job is done; ``store``: the store server the standby hosted for the first join."""
    from meridian.workers.elastic.rendezvous import Rendezvous
    from meridian.workers.elastic.trainer import ElasticTrainer, OnPeerFailure

    if threads:
        torch.set_num_threads(threads)
    client = PipeClient(conn)
    in_new_process = not re_forms_in_process(device)
    rdzv = Rendezvous(
        client.call, worker_id=ids["worker_id"], datacenter=ids["datacenter"], node_id=ids["node_id"],
        address=ids["address"], backend=ids["backend"], collective_timeout_s=ids["collective_timeout_s"],
        device=device, probe_port=ids["probe_port"], store=store,
    )  # fmt: skip
    rdzv.epoch = ids["epoch"]
    profiler = StepProfiler(store_dir, cfg.job_dir, lambda k, m, d: client.tell("event", k, m, d))
    sink = PipeSink(client, on_beat=profiler.beat)
    trainer = ElasticTrainer(
        cfg, rdzv, sink=sink, on_event=lambda k, m, d: client.tell("event", k, m, d),
        device=torch.device(device), join_timeout_s=ids["join_timeout_s"],
        snapshots=SnapshotStore(ids["keep"], store_dir), on_recovery=lambda: client.tell(RECOVERED),
        on_peer_failure=OnPeerFailure.EXIT if in_new_process else OnPeerFailure.SHUT_SOCKETS_AND_REJOIN,
        on_epoch=lambda n: client.tell("epoch", n), keep_params=ids["keep_params"],
        peak=ids["peak"], on_peak=lambda p: client.tell("peak", p), before_exit=client.leaving,
        snapshot_every=ids["snapshot_every"], on_snapshot_cadence=lambda k: client.tell("cadence", k),
    )  # fmt: skip
    try:
        result = trainer.run()
    except BaseException:  # noqa: BLE001 - the agent reports it
        client.tell("error", traceback.format_exc())
        conn.close()
        os._exit(1)
    profiler.close()
    sink.close()
    client.tell("done", result)
    conn.close()


