"""The live page at ``/`` in a real headless browser (Debian's chromium driven by Playwright).

The service runs in-process (uvicorn in a thread) with the real supervisor loop and a fake launcher that
the test feeds per-step records, so no Ray is needed. The page must show the job, its state and progress,
the datacenter map with the job's ranks, and its loss chart must grow as steps arrive.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest
from fakes import spec, step_record

from meridian.api.server import serve_in_thread
from meridian.service.cluster.link_probe import ProbeCache
from meridian.service.cluster.topology import ClusterTopology
from meridian.service.core import ServiceConfig
from meridian.workers.contracts.events import EventKind, JobEvent

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
if not Path(CHROMIUM).exists():
    pytest.skip(f"no chromium at {CHROMIUM}: `apt-get install -y chromium` (make test does it as root)",
                allow_module_level=True)


class InProcessService:
    def __init__(self, store, supervisor, view, data_dir):
        self.config = ServiceConfig(data_dir=str(data_dir))
        self.store, self.supervisor, self._view = store, supervisor, view
        self.probe_cache = ProbeCache(str(data_dir))

    def topology(self):
        return self._view()


@pytest.fixture
def live_service(store, supervisor, cluster_view, tmp_path):
    svc = InProcessService(store, supervisor, cluster_view, tmp_path)
    supervisor.poll_interval_s = 0.2
    supervisor.start()
    try:
        with serve_in_thread(svc) as url:
            yield svc, url
    finally:
        supervisor.stop()


COUNT_EVENTSOURCE = """
window.__sse = { opened: [], messages: 0, kinds: [] };
const RealEventSource = window.EventSource;
window.EventSource = class extends RealEventSource {
  constructor(url, options) {
    super(url, options);
    window.__sse.opened.push(this.url);
  }
  addEventListener(type, listener, options) {
    super.addEventListener(type, (m) => {
      window.__sse.messages += 1;
      if (!window.__sse.kinds.includes(type)) window.__sse.kinds.push(type);
      listener(m);
    }, options);
  }
};
"""
"""Counts what the page's EventSource opens and delivers (the page runs unchanged)."""


def _wait(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_page_shows_job_map_and_live_chart(live_service):
    svc, url = live_service
    import httpx

    job = httpx.post(f"{url}/v1/jobs", json=spec(training={"steps": 20, "global_batch": 4, "micro_batch": 2})).json()
    launcher = svc.supervisor.launcher
    _wait(lambda: job["id"] in launcher.runners, 15, "the supervisor to launch the job")
    runner = launcher.runners[job["id"]]
    nodes = svc.topology().nodes
    for rank, n in enumerate([n for n in nodes if n.datacenter][:4]):
        runner.push("event", {"kind": "worker_started", "message": f"rank {rank}", "time": time.time(),
                              "data": {"rank": rank, "node_id": n.node_id, "datacenter": n.datacenter}})
    runner.state = "running"
    for step in (1, 2, 3):
        runner.push("record", step_record(step, 20, 5.0 - 0.1 * step))

    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page(bypass_csp=True)  # wait_for_function evaluates strings
            errors: list[str] = []
            requests: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}")
                    if "text/event-stream" not in (r.headers.get("accept") or "") else None)
            page.on("request", lambda r: requests.append(r.url.removeprefix(url)))
            page.add_init_script(COUNT_EVENTSOURCE)
            page.goto(url + "/")
            row = page.locator(f'#jobs tr[data-job="{job["id"]}"]')
            row.locator("td.state", has_text="running").wait_for(timeout=15_000)
            assert "3/20" in row.locator("td.progress").inner_text()
            assert row.locator("td.loss").inner_text() == "4.700"
            loss_line = page.locator("#chart-loss polyline")
            page.wait_for_function("document.querySelector('#chart-loss polyline')?.dataset.points === '3'",
                                   timeout=15_000)
            # The datacenter map: both DCs, every node alive, the job's four ranks placed on nodes.
            assert page.locator("#dc-map g.dc").count() == 2
            assert page.locator("#dc-map g.node.alive").count() == 4
            assert page.locator("#dc-map text.ranks").count() == 4
            assert page.locator("#dc-map line.inter-dc-link").count() == 1
            assert "not measured yet" in page.locator("#link-info").inner_text()

            # More steps arrive: the chart and the table follow without a reload.
            for step in range(4, 9):
                runner.push("record", step_record(step, 20, 5.0 - 0.1 * step))
            page.wait_for_function("document.querySelector('#chart-loss polyline')?.dataset.points === '8'",
                                   timeout=15_000)
            assert page.locator("#chart-tps polyline").get_attribute("data-points") == "8"
            row.locator("td.progress", has_text="8/20").wait_for(timeout=15_000)
            assert loss_line.get_attribute("points").count(",") == 8

            # The job was followed over its event stream: one EventSource, from after the events the page read
            # first, whose messages brought the steps; no poll of the job or of its events while it ran.
            sse = page.evaluate("window.__sse")
            job_path = f"/v1/jobs/{job['id']}"
            assert [u.split("?")[0] for u in sse["opened"]] == [f"{url}{job_path}/events"], sse
            after = int(sse["opened"][0].split("after=")[1])  # the newest event of the page's first read
            streamed = [e for e in svc.store.list_events(job["id"], after=after) if e.kind == "progress"]
            assert streamed and sse["messages"] >= len(streamed), (sse, len(streamed))
            assert "progress" in sse["kinds"]
            assert job_path not in requests, "the page polled the job"
            polled = [u for u in requests if u.startswith(f"{job_path}/events?") and "newest=" not in u
                      and url + u not in sse["opened"]]  # the stream's own request is not a poll
            assert polled == [], f"the page polled the job's events while its stream was open: {polled}"

            # A node is lost: the map shows it red, the others stay alive.
            lost = next(n for n in nodes if n.datacenter == "dc-b")
            svc._view.topo = ClusterTopology(tuple(replace(n, alive=False) if n is lost else n for n in nodes))
            page.locator(f'#dc-map g.node.lost[data-node="{lost.node_id}"]').wait_for(timeout=15_000)
            assert page.locator("#dc-map g.node.alive").count() == 3

            # After a link probe, the map labels the inter-DC link with what it measured.
            svc.probe_cache._write({"measured_at": time.time(), "skipped": [], "tiers": [
                {"tier": "inter_dc", "datacenters": ["dc-a", "dc-b"], "nodes": [], "rows": [],
                 "summary": {"latency_us": 850.0, "bandwidth_gbps": 1.25}}]})
            page.locator("#link-info", has_text="dc-a ↔ dc-b: latency 850 µs, bandwidth 1.25 Gbit/s").wait_for(
                timeout=15_000)
            assert errors == []
            if os.environ.get("MERIDIAN_SCREENSHOT"):  # to look at the page: MERIDIAN_SCREENSHOT=/tmp/p.png
                page.screenshot(path=os.environ["MERIDIAN_SCREENSHOT"], full_page=True)
        finally:
            browser.close()


def test_index_and_assets_are_served_without_external_urls(live_service):
    import httpx

    _, url = live_service
    html = httpx.get(url + "/").text
    assert '<script src="/static/app.js">' in html
    for asset in ("/static/app.js", "/static/style.css"):
        r = httpx.get(url + asset)
        assert r.status_code == 200 and "http://" not in r.text.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in r.text


def test_with_auth_on_the_page_asks_for_a_token_and_keeps_it_for_the_session(store, supervisor, cluster_view, tmp_path):
    import httpx

    from meridian.api.auth import AuthSettings, create_token

    token = create_token(tmp_path / "tokens.json", "alice")
    auth = AuthSettings.load(enabled=True, token_file=str(tmp_path / "tokens.json"))
    svc = InProcessService(store, supervisor, cluster_view, tmp_path)
    with serve_in_thread(svc, auth=auth) as url:
        job = httpx.post(f"{url}/v1/jobs", json=spec(), headers={"Authorization": f"Bearer {token}"}).json()
        with playwright_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
            try:
                page = browser.new_page(bypass_csp=True)  # wait_for_function evaluates strings
                page.goto(url + "/")
                page.locator("#token-form").wait_for(state="visible", timeout=15_000)
                assert "needs an API token" in page.locator("#status").inner_text()
                page.fill("#token", token)
                page.click("#token-form button")
                row = page.locator(f'#jobs tr[data-job="{job["id"]}"]')
                row.wait_for(timeout=15_000)
                assert page.locator("#token-form").is_hidden()
                assert page.evaluate("sessionStorage.getItem('meridian.token')") == token
                assert page.evaluate("localStorage.length") == 0  # never persisted beyond the session
                # An EventSource cannot send the token: the page reads the job's stream with fetch, live.
                requests: list[str] = []
                page.on("request", lambda r: requests.append(r.url))
                page.locator("#events li", has_text="job submitted").wait_for(timeout=15_000)
                page.wait_for_timeout(1_500)  # the stream is open by now
                store.add_event(job["id"], JobEvent(kind=EventKind.WAITING, message="pushed over the stream"))
                page.locator("#events li", has_text="pushed over the stream").wait_for(timeout=15_000)
                assert not [u for u in requests if "/events?after=" in u and "limit=" in u], requests
                page.reload()  # the same tab keeps it
                row.wait_for(timeout=15_000)
                page.click("#token-forget")
                page.locator("#token-form").wait_for(state="visible", timeout=15_000)
            finally:
                browser.close()
