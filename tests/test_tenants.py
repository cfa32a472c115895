"""Tenants: tokens that expire and are revoked without a restart (refused within a second), an admin who sees
every owner's jobs and sets quotas, and per-owner quotas that hold a job queued with the quota named until it is
raised (issue 60)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fakes import FakeService, spec, submit

from meridian.api.auth import AuthSettings, create_token
from meridian.api.server import serve_in_thread
from meridian.cli.main import main as cli_main
from meridian.service.jobs import JobState
from meridian.service.quotas import Held, Quota, over_quota


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def served(store, supervisor, cluster_view, tmp_path):
    path = tmp_path / "tokens.json"
    toks = {"alice": create_token(path, "alice"), "ops": create_token(path, "ops", admin=True)}
    fake = FakeService(store, supervisor, cluster_view)
    with serve_in_thread(fake, auth=AuthSettings.load(enabled=True, token_file=str(path))) as url:
        yield url, path, toks


def test_a_revoked_token_is_refused_within_a_second_without_a_restart(served, capsys):
    url, path, toks = served
    assert httpx.get(f"{url}/v1/jobs", headers=bearer(toks["alice"])).status_code == 200
    assert cli_main(["token", "list", "--token-file", str(path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["tokens"]
    assert [(t["owner"], t["admin"], t["expires_at"]) for t in listed] == [("alice", False, None), ("ops", True, None)]
    assert toks["alice"] not in json.dumps(listed)  # ids, never the tokens
    alice_id = listed[0]["id"]
    assert cli_main(["token", "revoke", alice_id[:6], "--token-file", str(path), "--json"]) == 0
    revoked_at = time.monotonic()
    while httpx.get(f"{url}/v1/jobs", headers=bearer(toks["alice"])).status_code != 401:
        assert time.monotonic() - revoked_at < 1.0, "a revoked token was still accepted a second later"
        time.sleep(0.05)
    assert httpx.get(f"{url}/v1/jobs", headers=bearer(toks["ops"])).status_code == 200  # the others still work
    # A token created meanwhile works without a restart too.
    new = create_token(path, "bob")
    deadline = time.monotonic() + 1.0
    while httpx.get(f"{url}/v1/jobs", headers=bearer(new)).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert cli_main(["token", "revoke", "nosuch", "--token-file", str(path)]) == 2
    assert "no token" in capsys.readouterr().err


def test_an_expired_token_is_refused(served):
    url, path, _ = served
    short = create_token(path, "temp", expires_in_s=1.5)
    deadline = time.monotonic() + 1.0
    while httpx.get(f"{url}/v1/jobs", headers=bearer(short)).status_code != 200:  # read within a reload
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.6)
    r = httpx.get(f"{url}/v1/jobs", headers=bearer(short))
    assert r.status_code == 401 and "expired" in r.json()["detail"]


def test_an_admin_sees_every_owners_jobs_and_alone_sets_quotas(served):
    url, _, toks = served
    job = httpx.post(f"{url}/v1/jobs", json=spec(), headers=bearer(toks["alice"])).json()
    ops = bearer(toks["ops"])
    assert [j["id"] for j in httpx.get(f"{url}/v1/jobs", headers=ops).json()["jobs"]] == [job["id"]]
    assert httpx.get(f"{url}/v1/jobs/{job['id']}", headers=ops).json()["owner"] == "alice"
    r = httpx.put(f"{url}/v1/quotas/alice", json={"cpus": 2}, headers=bearer(toks["alice"]))
    assert r.status_code == 403 and "admin" in r.json()["detail"]
    assert httpx.put(f"{url}/v1/quotas/alice", json={"cpus": 2}, headers=ops).json() == {
        "owner": "alice", "cpus": 2.0, "gpus": None, "jobs": None}
    assert httpx.get(f"{url}/v1/quotas", headers=bearer(toks["alice"])).json()["quotas"][0]["cpus"] == 2.0
    r = httpx.put(f"{url}/v1/quotas/alice", json={"cpus": -1}, headers=ops)
    assert r.status_code == 422 and "cpus" in r.text


def test_a_job_over_its_owners_cpu_quota_pends_naming_it_and_runs_when_the_quota_is_raised(supervisor, store):
    supervisor.set_quota(Quota(owner="alice", cpus=2))
    big = submit(supervisor, owner="alice")  # four workers of one CPU each (dc-a 2 + dc-b 2)
    other = submit(supervisor, owner="bob", topology={"workers_per_datacenter": 1})
    supervisor.tick()
    waiting = store.get_job(big)
    assert (waiting.status.state, waiting.status.reason) == (JobState.QUEUED, "QuotaExceeded")
    assert "quota.cpus" in waiting.status.message and "needs 4 CPU(s)" in waiting.status.message
    assert "'alice'" in waiting.status.message
    assert store.get_job(other).status.state is JobState.PLACING  # another owner is not held back by alice's quota
    supervisor.launcher.runners[other].state = "succeeded"
    supervisor.tick()  # bob's job ends (followed after the admission, which saw it placing)
    supervisor.tick()  # the cluster is free, and alice still waits for her quota
    assert store.get_job(big).status.reason == "QuotaExceeded"
    supervisor.set_quota(Quota(owner="alice", cpus=4))
    supervisor.tick()
    assert store.get_job(big).status.state is JobState.PLACING


def test_over_quota_counts_jobs_cpus_and_gpus():
    two_cpus = Held(cpus=2, gpus=0)
    assert over_quota(None, [two_cpus], two_cpus) is None
    assert over_quota(Quota(owner="a", jobs=1), [], two_cpus) is None
    assert "quota.jobs" in over_quota(Quota(owner="a", jobs=1), [two_cpus], two_cpus)
    assert over_quota(Quota(owner="a", cpus=4), [two_cpus], two_cpus) is None
    assert "quota.gpus" in over_quota(Quota(owner="a", gpus=1), [Held(cpus=1, gpus=1)], Held(cpus=1, gpus=1))
    with pytest.raises(ValueError, match="quota.cpus"):
        Quota(owner="a", cpus=-1)
