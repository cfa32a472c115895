"""A leaving training process shuts its TCP connections down before it exits, so a peer blocked on it in a
collective fails now rather than after the exit's teardown (tens of milliseconds for a torch process)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

import torch
import torch.distributed as dist

from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.elastic.sockets import shut_down_tcp_sockets


def _connects_then_shuts_down(port: int, pipe) -> None:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(b"x")
    shut = shut_down_tcp_sockets()
    pipe.send(("shut", shut))  # the Unix socket to the parent still works
    time.sleep(10)  # alive: only the shutdown can end the parent's read
    conn.close()


def test_the_peer_reads_the_end_at_once_while_the_process_lives():
    ctx = mp.get_context("fork")
    with socket.create_server(("127.0.0.1", 0)) as server:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_connects_then_shuts_down, args=(server.getsockname()[1], child), daemon=True)
        proc.start()
        try:
            conn, _ = server.accept()
            conn.settimeout(5)
            assert conn.recv(1) == b"x"
            began = time.monotonic()
            assert conn.recv(1) == b""  # the FIN
            assert time.monotonic() - began < 2.0
            assert parent.poll(5) and parent.recv()[0] == "shut"
            assert proc.is_alive()
        finally:
            proc.kill()
            proc.join(5)


def _blocked_on_a_rank_that_shuts_down(rank: int, world: int) -> dict:
    if rank == 0:
        time.sleep(0.5)  # rank 1 is in the all-reduce, waiting for this rank
        shut_down_tcp_sockets()
        time.sleep(3)  # still alive while rank 1 fails
        return {"rank": 0}
    began = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except Exception as e:  # noqa: BLE001 - the failure is what the test looks at
        return {"rank": 1, "failed_after_s": time.monotonic() - began, "error": str(e)[:200]}
    return {"rank": 1, "failed_after_s": None}


def test_a_gloo_peer_blocked_in_a_collective_fails_before_the_process_exits():
    _, blocked = run_processes(_blocked_on_a_rank_that_shuts_down, 2, timeout_s=60)
    assert blocked["failed_after_s"] is not None, "the all-reduce completed: nothing was shut down"
    assert blocked["failed_after_s"] < 2.0, blocked  # rank 0 lived 3.5 s; the shutdown came at 0.5


def test_a_training_process_re_forms_in_its_own_process_on_cpu_and_exits_on_a_gpu():
    from meridian.workers.elastic.protocol import re_forms_in_process

    assert re_forms_in_process("cpu", {}) and re_forms_in_process("cpu", {"MERIDIAN_REFORM": "in-process"})
    assert not re_forms_in_process("cpu", {"MERIDIAN_REFORM": "new-process"})
    assert not re_forms_in_process("cuda:0", {}) and not re_forms_in_process("cuda", {"MERIDIAN_REFORM": "in-process"})
    try:
        re_forms_in_process("cpu", {"MERIDIAN_REFORM": "inprocess"})
    except ValueError as e:
        assert "MERIDIAN_REFORM='inprocess'" in str(e) and "'new-process'" in str(e)
    else:
        raise AssertionError("a misspelt MERIDIAN_REFORM was taken")
