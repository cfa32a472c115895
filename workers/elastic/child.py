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
from meridian.workers.elastic.protocol import LEAVING
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
    def __init__(self, client: PipeClient) -> None:
        self.client = client

    def step(self, record: StepRecord) -> None:
        self.client.tell("progress", record)  # the record itself: the pipe pickles the dataclass

    def rank_step(self, beat: dict[str, Any]) -> None:
        self.client.tell("beat", beat)


def child_main(conn: Any, cfg: TrainConfig, ids: dict[str, Any], store_dir: str, device: str,
               threads: int | None) -> None:
    from meridian.workers.elastic.rendezvous import Rendezvous
    from meridian.workers.elastic.trainer import ElasticTrainer

    if threads:
        torch.set_num_threads(threads)
    client = PipeClient(conn)
    rdzv = Rendezvous(
        client.call, worker_id=ids["worker_id"], datacenter=ids["datacenter"], node_id=ids["node_id"],
        address=ids["address"], backend=ids["backend"], collective_timeout_s=ids["collective_timeout_s"],
        device=device, probe_port=ids["probe_port"],
    )  # fmt: skip
    rdzv.epoch = ids["epoch"]
    trainer = ElasticTrainer(
        cfg, rdzv, sink=PipeSink(client), on_event=lambda k, m, d: client.tell("event", k, m, d),
        device=torch.device(device), join_timeout_s=ids["join_timeout_s"],
        snapshots=SnapshotStore(ids["keep"], store_dir), exit_on_failure=True,
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
    client.tell("done", result)
    conn.close()


