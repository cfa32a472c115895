"""Plan once, at submit: a job is planned and its training config built when it is submitted, so a spec whose
options the plan makes invalid is a 422 there (before, some got a 201 and failed later: ``InvalidConfig`` at
admission, or a ``TrainingError`` once the workers built their engines), and the stored plan and config are
what the runner executes."""

from __future__ import annotations

from fakes import FakeService, spec
from fastapi.testclient import TestClient

from meridian.api.app import create_app

LOOKAHEAD = {"strategy": "hierarchical", "delay_one_step": True, "local_lookahead": True}


def _client(store, supervisor, cluster_view):
    fake = FakeService(store, supervisor, cluster_view)
    return TestClient(create_app(fake.config, service=fake), base_url="http://127.0.0.1")


def test_a_look_ahead_with_pipeline_stages_is_a_422_at_submit_and_nothing_is_stored(store, supervisor, cluster_view):
    # Before: 201, then every worker failed building its engine ("sync.local_lookahead applies to data parallelism
    # only"), a TrainingError on a job that could never have run.
    with _client(store, supervisor, cluster_view) as client:
        r = client.post("/v1/jobs", json=spec(sync=LOOKAHEAD, parallelism={"pp": 2}))
        assert r.status_code == 422, r.text
        detail = r.json()["detail"]
        assert "sync.local_lookahead" in detail and "pp=2" in detail
        assert store.list_jobs() == []
        # The dry run says the same.
        r = client.post("/v1/plans", json=spec(sync=LOOKAHEAD, parallelism={"pp": 2}))
        assert r.status_code == 422 and "sync.local_lookahead" in r.json()["detail"]
        # Without the pipeline the same look-ahead is fine.
        assert client.post("/v1/jobs", json=spec(sync=LOOKAHEAD)).status_code == 201


def test_the_submitted_job_carries_its_plan_and_config_and_admission_launches_exactly_those(
        store, supervisor, cluster_view):
    from fakes import topology

    with _client(store, supervisor, cluster_view) as client:
        job = client.post("/v1/jobs", json=spec()).json()
    stored = store.get_job(job["id"])
    assert stored.resolved is not None and job["plan"] == stored.resolved.plan.to_dict()
    config = stored.resolved.config
    assert config.job_id == job["id"] and config.datacenters == stored.resolved.plan.rank_datacenters
    assert config.checkpoint_dir.endswith(job["id"])  # keep_final: the final weights go to the job's folder
    cluster_view.topo = topology(dc_a=4, dc_b=4)  # the cluster grew: the job still runs what it was given
    supervisor.tick()
    (launched_id, launched_config, launched_plan), = supervisor.launcher.launched
    assert (launched_id, launched_config, launched_plan) == (job["id"], config, stored.resolved.plan)


def test_a_job_waits_for_capacity_on_its_stored_plan_and_is_never_replanned(store, supervisor, cluster_view, monkeypatch):
    from fakes import node

    from meridian.service.cluster.topology import ClusterTopology

    job, _ = supervisor.submit(_request(), {})
    planned = []

    def plan_again(*args, **kwargs):
        planned.append(args)
        raise AssertionError("admission planned the job again")

    monkeypatch.setattr(supervisor, "plan", plan_again)
    busy = ClusterTopology(tuple(node(n.node_id, n.datacenter, cpus=n.cpus, free_cpus=0) for n in cluster_view.topo.nodes))
    cluster_view.topo = busy
    supervisor.tick()
    waiting = store.get_job(job.id)
    assert waiting.status.reason == "WaitingForCapacity" and "dc-a" in waiting.status.message
    assert planned == []


def _request():
    from meridian.api.schemas import JobSpec

    return JobSpec.model_validate(spec()).to_request("")
