"""The job store: records survive a reopen, transitions are validated, idempotency keys dedupe, event ids
never let a reader skip an event. Every test runs on SQLite and on a real PostgreSQL (``database_url``)."""

from __future__ import annotations

import threading
import time

import pytest
from fakes import raw_event

from meridian.service.errors import InvalidTransition, JobNotFound
from meridian.service.jobs import JobRequest, JobState, JobStatus
from meridian.service.store import JobStore
from meridian.workers.contracts.events import EventKind, JobEvent
from meridian.workers.contracts.model_config import model_preset

QUEUED = JobStatus(JobState.QUEUED, "Admitting", "")


@pytest.fixture
def store(database_url):
    s = JobStore(database_url)
    yield s
    s.close()


def request(name: str = "j", priority: int = 0, owner: str = "") -> JobRequest:
    return JobRequest(name=name, model=model_preset("nano"), steps=3, global_batch=4, micro_batch=2,
                      priority=priority, owner=owner)


def test_job_survives_reopen_with_request_intact(database_url):
    url = database_url
    s = JobStore(url)
    job, created = s.create_job(request("persist"), {"name": "persist"}, status=QUEUED)
    s.update_fields(job.id, progress={"step": 2, "cursor": 7}, plan={"num_workers": 4})
    s.add_metrics(job.id, [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}])
    s.close()

    again = JobStore(url).get_job(job.id)
    assert created and again.name == "persist"
    assert again.request == request("persist")
    assert again.progress == {"step": 2, "cursor": 7} and again.plan == {"num_workers": 4}
    assert [m["loss"] for m in JobStore(url).list_metrics(job.id)] == [5.0, 4.0]


def test_transitions_are_validated_and_recorded(store):
    job, _ = store.create_job(request(), {}, status=QUEUED)
    store.set_status(job.id, JobStatus(JobState.PLACING, "Placing", "starting"))
    store.set_status(job.id, JobStatus(JobState.RUNNING, "Training", ""))
    done = store.set_status(job.id, JobStatus(JobState.SUCCEEDED, "Completed", ""))
    assert done.started_at is not None and done.finished_at is not None
    with pytest.raises(InvalidTransition, match="succeeded job cannot become running"):
        store.set_status(job.id, JobStatus(JobState.RUNNING))
    states = [e.data["state"] for e in store.list_events(job.id) if e.kind == "state"]
    assert states == ["queued", "placing", "running", "succeeded"]


def test_unknown_job_raises_not_found(store):
    with pytest.raises(JobNotFound, match="no job with id 'nope'"):
        store.get_job("nope")
    with pytest.raises(JobNotFound):
        store.update_fields("nope", progress={})


def test_queue_order_is_priority_then_fifo(store):
    ids = [store.create_job(request(f"j{i}", priority=p), {}, status=QUEUED)[0].id for i, p in enumerate([0, 5, 0, 5])]
    assert [j.id for j in store.queued_in_order()] == [ids[1], ids[3], ids[0], ids[2]]


def test_idempotency_key_returns_the_first_job_even_under_concurrency(store):
    results = []

    def submit():
        results.append(store.create_job(request(owner="alice"), {}, status=QUEUED, idempotency_key="k1"))

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({job.id for job, _ in results}) == 1
    assert sum(created for _, created in results) == 1
    # the same key from another owner is another job
    other, created = store.create_job(request(owner="bob"), {}, status=QUEUED, idempotency_key="k1")
    assert created and other.id != results[0][0].id


def test_concurrent_submissions_lose_nothing(store):
    def submit(i):
        store.create_job(request(f"c{i}"), {}, status=QUEUED)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    jobs = store.list_jobs(limit=100)
    assert sorted(j.name for j in jobs) == sorted(f"c{i}" for i in range(20))
    assert len({j.seq for j in jobs}) == 20


def test_events_page_by_id(store):
    job, _ = store.create_job(request(), {}, status=QUEUED)
    ids = [raw_event(store, job.id, "note", f"n{i}") for i in range(5)]
    assert [e.message for e in store.list_events(job.id, after=ids[2])] == ["n3", "n4"]


def test_an_event_stream_never_skips_an_event_whose_writer_commits_late(store):
    """Writer A takes an event id and is slow to commit; writer B writes after it. A reader polling with a
    cursor (what the SSE stream and ``Last-Event-ID`` do) must still get both. Ids handed out at insert and
    committed out of order (B's larger id visible first) would move the cursor past A's event for good."""
    import sqlalchemy as sa

    job, _ = store.create_job(request(), {}, status=QUEUED)
    cursor = store.list_events(job.id)[-1].id
    a_in_commit, release_a = threading.Event(), threading.Event()

    def hold_writer_a_at_commit(conn):
        if threading.current_thread().name == "writer-a":
            a_in_commit.set()
            release_a.wait(30)

    sa.event.listen(store.engine, "commit", hold_writer_a_at_commit)
    a = threading.Thread(target=store.add_event, args=(job.id, JobEvent(kind=EventKind.WAITING, message="a")),
                         name="writer-a")
    b = threading.Thread(target=store.add_event, args=(job.id, JobEvent(kind=EventKind.WAITING, message="b")),
                         name="writer-b")
    a.start()
    assert a_in_commit.wait(10), "writer A never reached its commit"
    b.start()
    b.join(3)  # B either commits now (ids out of order) or waits for A (in order): the reader must not care
    seen = store.list_events(job.id, after=cursor)
    cursor = seen[-1].id if seen else cursor
    release_a.set()
    a.join(30)
    b.join(30)
    assert not a.is_alive() and not b.is_alive()
    seen += store.list_events(job.id, after=cursor)
    assert [e.message for e in seen] == ["a", "b"]
    assert [e.id for e in seen] == sorted(e.id for e in seen)


def test_a_cancel_request_is_stored_state_and_an_older_database_gains_the_column(database_url):
    import sqlalchemy as sa

    url = database_url
    s = JobStore(url)
    job, _ = s.create_job(request(), {}, status=QUEUED)
    with s.engine.begin() as conn:  # a database made before the column existed
        conn.execute(sa.text("ALTER TABLE jobs DROP COLUMN cancel_requested"))
    s.close()

    s = JobStore(url)
    assert s.get_job(job.id).cancel_requested is False
    s.set_status(job.id, JobStatus(JobState.PLACING, "Placing", ""))
    cancelling = s.set_status(job.id, JobStatus(JobState.PLACING, "Cancelling", "stopping"), cancel_requested=True)
    assert cancelling.cancel_requested and JobStore(url).get_job(job.id).cancel_requested
    assert s.set_status(job.id, JobStatus(JobState.CANCELLED, "Cancelled", "")).cancel_requested  # stays set


def test_a_cancel_stored_without_its_time_gets_one_so_its_deadline_can_end_it(database_url):
    """A cancel requested by a version that did not keep ``cancel_requested_at`` would otherwise wait for its
    runner forever (the cancel deadline counts from that time)."""
    import sqlalchemy as sa

    s = JobStore(database_url)
    job, _ = s.create_job(request(), {}, status=QUEUED)
    s.set_status(job.id, JobStatus(JobState.PLACING, "Placing", ""))
    with s.engine.begin() as conn:  # as the older version left it
        conn.execute(sa.text("UPDATE jobs SET cancel_requested = TRUE, cancel_requested_at = NULL"))
    s.close()
    before = time.time()
    reopened = JobStore(database_url)
    assert reopened.get_job(job.id).cancel_requested_at >= before
    reopened.close()


# ``JobRequest.to_dict()`` as the store kept it before the sync strategy lived in one field (``sync_strategy``
# beside a placeholder ``sync.strategy``): written by that version, verbatim.
OLD_FORCED = (
    '{"name": "old", "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 64, "vocab_size": 256, '
    '"mlp_ratio": 4}, "data": {"source": "builtin:python-reference", "max_bytes": 8000000}, "optim": {"lr": 0.001, '
    '"min_lr_ratio": 0.1, "warmup_steps": 10, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-08, '
    '"grad_clip": 1.0}, "steps": 3, "global_batch": 4, "micro_batch": 2, "seed": 0, "precision": "fp32", '
    '"topology": {"datacenters": ["dc-a", "dc-b"], "workers_per_datacenter": [["dc-a", 2], ["dc-b", 1]], '
    '"min_workers": 1}, "parallelism": {"tp": 1, "pp": null, "schedule": "gpipe", "stages_span_dcs": null}, '
    '"links": [{"a": "dc-a", "b": "dc-b", "rtt_ms": 40.0, "gbps": 1.0}], "sync_strategy": "streaming-diloco", '
    '"sync": {"strategy": "streaming-diloco", "bucket_mb": 4.0, "shard_optimizer": true, "overlap": true, '
    '"inter_dc_chunk_mb": 1.0, "compression": "none", "diloco": {"inner_steps": 8, "fragments": 2, "outer_lr": 0.7, '
    '"outer_momentum": 0.9, "nesterov": true, "overlap_steps": 1, "mix_alpha": 0.5}}, "wan": {"rtt_ms": 10.0, '
    '"gbps": 2.0}, "checkpoint_every": 5, "priority": 3, "owner": "alice"}'
)
OLD_AUTO = (
    '{"name": "auto", "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 64, "vocab_size": 256, '
    '"mlp_ratio": 4}, "data": {"source": "builtin:python-reference", "max_bytes": 8000000}, "optim": {"lr": 0.001, '
    '"min_lr_ratio": 0.1, "warmup_steps": 10, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-08, '
    '"grad_clip": 1.0}, "steps": 3, "global_batch": 4, "micro_batch": 2, "seed": 0, "precision": "auto", '
    '"topology": {"datacenters": null, "workers_per_datacenter": null, "min_workers": 1}, "parallelism": {"tp": null, '
    '"pp": null, "schedule": "1f1b", "stages_span_dcs": null}, "links": [], "sync_strategy": null, "sync": '
    '{"strategy": "hierarchical", "bucket_mb": 4.0, "shard_optimizer": true, "overlap": true, "inter_dc_chunk_mb": 1.0, '
    '"compression": "none", "diloco": null}, "wan": null, "checkpoint_every": 0, "priority": 0, "owner": ""}'
)


def test_requests_stored_by_the_previous_version_still_load():
    import json

    from meridian.service.jobs import DeclaredLink, ParallelismRequest, TopologyRequest
    from meridian.workers.contracts.config import (
        DiLoCoConfig,
        PipelineSchedule,
        Precision,
        SyncConfig,
        SyncStrategy,
        WanConfig,
    )

    auto = JobRequest.from_dict(json.loads(OLD_AUTO))
    # stored when 4 MiB was the default bucket: kept, so the stored job syncs as it did (new requests leave the
    # size to the planner)
    assert auto == JobRequest(name="auto", model=model_preset("nano"), steps=3, global_batch=4, micro_batch=2,
                              sync=SyncConfig(strategy=None, bucket_mb=4.0))
    assert auto.sync.strategy is None  # "auto" (the old placeholder 'hierarchical' is not taken for a wish)
    forced = JobRequest.from_dict(json.loads(OLD_FORCED))
    assert forced == JobRequest(
        name="old", model=model_preset("nano"), steps=3, global_batch=4, micro_batch=2, precision=Precision.FP32,
        topology=TopologyRequest(datacenters=("dc-a", "dc-b"), workers_per_datacenter=(("dc-a", 2), ("dc-b", 1))),
        parallelism=ParallelismRequest(tp=1, schedule=PipelineSchedule.GPIPE),
        links=(DeclaredLink(a="dc-a", b="dc-b", rtt_ms=40.0, gbps=1.0),),
        sync=SyncConfig(strategy=SyncStrategy.STREAMING_DILOCO,
                        diloco=DiLoCoConfig(inner_steps=8, fragments=2, overlap_steps=1)),
        wan=WanConfig(rtt_ms=10.0, gbps=2.0), checkpoint_every=5, priority=3, owner="alice",
    )
    # and today's shape round-trips through JSON
    assert JobRequest.from_dict(json.loads(json.dumps(forced.to_dict()))) == forced


def _with_shard_optimizer(text: str, value: bool) -> str:
    """``text`` (a stored request or resolved job's JSON) with ``shard_optimizer`` in every ``sync`` section, as
    the versions that had the field stored it."""
    import json

    def put(node):
        if isinstance(node, dict):
            if "sync" in node and isinstance(node["sync"], dict):
                node["sync"]["shard_optimizer"] = value
            for v in node.values():
                put(v)
        return node

    return json.dumps(put(json.loads(text)))


def test_jobs_stored_with_a_replicated_optimizer_still_load_after_a_restart(database_url):
    # sync.shard_optimizer is gone (the optimizer state is always sharded by FSDP2 inside each datacenter): a job
    # stored with false or true reads back as the same job on the one engine, request and resolved config alike.
    import sqlalchemy as sa
    from fakes import topology

    from meridian.service.planning.planner import plan_job
    from meridian.service.resolved import resolve
    from meridian.service.store import jobs_table

    req = request("replicated")
    plan = plan_job(req, topology(dc_a=2, dc_b=1))
    s = JobStore(database_url)
    job, _ = s.create_job(req, {"name": "replicated"}, status=QUEUED,
                          resolved=resolve("j", req, plan, checkpoint_root=""))
    old = s.get_job(job.id)
    for value in (False, True):
        with s.engine.begin() as conn:
            conn.execute(sa.update(jobs_table).where(jobs_table.c.id == job.id).values(
                request=_with_shard_optimizer(old.request_json, value),
                resolved=_with_shard_optimizer(old.resolved_json, value)))
        again = JobStore(database_url).get_job(job.id)  # a restarted service
        assert f'"shard_optimizer": {str(value).lower()}' in again.request_json  # the old form really is stored
        assert again.request == req
        assert again.resolved == old.resolved and again.resolved.config.sync == old.resolved.config.sync
    s.close()
