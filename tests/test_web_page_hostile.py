"""The live page under unlucky conditions, in a real headless browser (Debian's chromium driven by Playwright):
a slow service (polls that overlap), a click on another job while a poll is in flight, a job longer than one
page of metrics, a diverged loss, a service that answers with an error, hostile strings in every field the
page draws, and a token pasted with characters no HTTP header can carry.

The service runs in-process (uvicorn in a thread) over a real store and supervisor with a fake cluster; jobs,
events and metrics are written straight into the store, so no Ray and no supervisor loop are needed.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
from fakes import FakeService, raw_event, submit

from meridian.api.server import serve_in_thread
from meridian.workers.contracts.events import EventKind, JobEvent, ProgressReport

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
if not Path(CHROMIUM).exists():
    pytest.skip(f"no chromium at {CHROMIUM}: `apt-get install -y chromium` (make test does it as root)",
                allow_module_level=True)


@pytest.fixture
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield b
        finally:
            b.close()


def open_page(browser, url, *, bypass_csp=True):
    """The page at ``url``, and the errors it logs. The page's policy is bypassed (wait_for_function evaluates
    strings in the page, which it forbids) except where a test checks the page under it."""
    page = browser.new_page(bypass_csp=bypass_csp)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    # The browser logs every 404 it fetched (no probe has run yet: /v1/diagnostics/collectives is a 404).
    page.on("console", lambda m: errors.append(m.text)
            if m.type == "error" and "the server responded with a status of 404" not in m.text else None)
    page.goto(url + "/")
    return page, errors


def event_texts(page) -> list[str]:
    return page.locator("#events li").all_inner_texts()


def slow_event_reads(store, seconds, *, of_job=None) -> threading.Event:
    """While the returned event is set, the store's reads of events (of ``of_job``, or of any job) take
    ``seconds`` longer: a slow service, whose page polls overlap."""
    slow, list_events = threading.Event(), store.list_events

    def slow_list_events(job_id, **kw):
        if slow.is_set() and of_job in (None, job_id):
            time.sleep(seconds)
        return list_events(job_id, **kw)

    store.list_events = slow_list_events
    return slow


def test_overlapping_polls_never_show_an_event_twice(service, store, supervisor, browser):
    """A service slower than the page's 1 s poll: the next poll starts before the last one answered, both ask
    for the events after the same id, and each event was listed twice."""
    job = submit(supervisor, name="slow")
    for i in range(3):
        raw_event(store, job, "note", f"note {i}")
    slow = slow_event_reads(store, 1.6)
    slow.set()
    with serve_in_thread(service) as url:
        page, errors = open_page(browser, url)
        page.locator("#events li", has_text="note 2").wait_for(timeout=15_000)
        page.wait_for_timeout(4_000)  # several more overlapping polls
        slow.clear()
        raw_event(store, job, "note", "note 3")
        page.locator("#events li", has_text="note 3").first.wait_for(timeout=15_000)
        page.wait_for_timeout(1_500)
        texts = event_texts(page)
        notes = [t for t in texts if "[note]" in t]
        assert len(notes) == 4, texts
        assert len(texts) == len(set(texts)), f"an event listed twice: {texts}"
        assert errors == []


def test_clicking_another_job_during_a_poll_shows_only_that_jobs_events(service, store, supervisor, browser):
    """The click cleared the list, then the poll in flight for the job shown before wrote that job's events
    into it (under the new job's title) and moved the cursor past the new job's own first events."""
    first = submit(supervisor, name="first")
    raw_event(store, first, "note", "event of the first job")
    second = submit(supervisor, name="second")  # newest: listed first, shown at start
    raw_event(store, second, "note", "event of the second job")
    slow_job = slow_event_reads(store, 2.0, of_job=second)
    with serve_in_thread(service) as url:
        page, errors = open_page(browser, url)
        page.locator("#events li", has_text="event of the second job").wait_for(timeout=15_000)
        slow_job.set()
        page.wait_for_timeout(1_200)  # a poll of the second job's events is now in flight
        raw_event(store, second, "note", "late event of the second job")  # what that poll will bring
        page.click(f'#jobs tr[data-job="{first}"]')
        page.locator("#events li", has_text="event of the first job").wait_for(timeout=15_000)
        page.wait_for_timeout(3_000)  # the slow poll has answered by now
        texts = event_texts(page)
        assert page.locator("#detail-id").inner_text() == first
        assert not [t for t in texts if "second" in t], texts
        assert [t for t in texts if "event of the first job" in t], texts
        slow_job.clear()
        assert errors == []


def test_a_job_longer_than_one_page_of_metrics_is_charted_to_its_last_step(service, store, supervisor, browser):
    """The page asked for the metrics without paging: the API's first page (10,000 steps) came back every
    second, so the charts of a longer job stopped at step 10,000 while it trained on."""
    job = submit(supervisor, name="long")
    steps = 12_345
    store.add_metrics(job, [{"step": s, "loss": 5.0 - s / 10_000, "tokens_per_s": 1000.0 + s} for s in range(1, steps + 1)])
    with serve_in_thread(service) as url:
        page, errors = open_page(browser, url)
        page.locator("#chart-loss text", has_text=f"step {steps}").wait_for(timeout=15_000)
        page.locator("#chart-tps text", has_text=f"step {steps}").wait_for(timeout=15_000)
        # New steps keep coming, and the job's event stream says so: only they are read (from the cursor), and drawn.
        store.add_metrics(job, [{"step": steps + 1, "loss": 3.0, "tokens_per_s": 5.0}])
        store.add_event(job, JobEvent(kind=EventKind.PROGRESS, message=f"step {steps + 1}",
                                      payload=ProgressReport(step=steps + 1, total_steps=20_000)))
        page.locator("#chart-loss text", has_text=f"step {steps + 1}").wait_for(timeout=15_000)
        drawn = int(page.locator("#chart-loss polyline").get_attribute("data-points"))
        assert 1_000 <= drawn <= 5_000  # thinned to a few thousand points, not 12,346
        assert errors == []


def test_a_diverged_loss_is_not_drawn_as_zero(service, store, supervisor, browser):
    """A step whose loss was NaN is stored and served as null, which the chart drew as a loss of 0: a
    diverged run looked like a perfect one."""
    job = submit(supervisor, name="diverged")
    store.add_metrics(job, [{"step": s, "loss": float("nan") if s == 3 else 4.0 + s / 10, "tokens_per_s": 100.0}
                            for s in range(1, 6)])
    with serve_in_thread(service) as url:
        page, errors = open_page(browser, url)
        page.locator("#chart-loss polyline").first.wait_for(timeout=15_000)
        points = page.locator("#chart-loss polyline").first.get_attribute("points")
        ys = [float(xy.split(",")[1]) for xy in points.split()]
        assert len(ys) == 4, points  # step 3 has no loss: no point
        assert max(ys) < 100, points  # nothing near the chart's zero line (y = 160)
        assert errors == []


def test_an_error_answer_says_what_the_service_said(service, store, supervisor, browser):
    """A 500 from the service read 'cannot reach the service: ...: HTTP 500', hiding the problem's detail and
    the request id that finds it in the service's log."""
    submit(supervisor, name="any")

    def broken(**kw):
        raise RuntimeError("the database is gone")

    store.list_jobs = broken
    with serve_in_thread(service) as url:
        page, _ = open_page(browser, url)
        status = page.locator("#status")
        status.filter(has_text="request id").wait_for(timeout=15_000)
        text = status.inner_text()
        assert "cannot reach" not in text
        assert "internal error (RuntimeError)" in text and "HTTP 500" in text, text


def test_a_job_with_many_events_shows_the_newest_at_once_and_keeps_the_page_small(
        service, store, supervisor, browser):
    """A long job has tens of thousands of events (progress alone is one a second). The page read them 1,000
    a second from the oldest, so the newest showed minutes late, and it kept every one on the page."""
    job = submit(supervisor, name="chatty")
    with store.engine.begin() as conn:
        store._insert_events(conn, [dict(job_id=job, time=time.time(), kind="note", message=f"note {i}", data="{}")
                                    for i in range(25_000)])
    with serve_in_thread(service) as url:
        page, errors = open_page(browser, url)
        page.locator("#events li", has_text="note 24999").wait_for(timeout=12_000)  # before: 25 s
        count = page.locator("#events li").count()
        assert count <= 1_000
        # The list's numbers are still the events' own: the last one is the job's 25,001st (its first is
        # the submission).
        assert page.evaluate("document.getElementById('events').start") + count - 1 == 25_001
        assert errors == []


def test_the_page_reads_only_a_long_jobs_newest_events(service, store, supervisor, browser):
    """Its first read of a selected job asks for the newest 1,000 events and how many came before; it paged
    through the whole history before, 10,000 events a request, to keep the last 1,000."""
    job = submit(supervisor, name="chatty")
    with store.engine.begin() as conn:
        store._insert_events(conn, [dict(job_id=job, time=time.time(), kind="note", message=f"note {i}", data="{}")
                                    for i in range(25_000)])
    read: list[int] = []
    list_events = store.list_events

    def counted(job_id, **kw):
        events = list_events(job_id, **kw)
        read.append(len(events))
        return events

    store.list_events = counted
    with serve_in_thread(service) as url:
        page, errors = open_page(browser, url)
        page.locator("#events li", has_text="note 24999").wait_for(timeout=12_000)
        page.wait_for_timeout(1_500)  # a poll or two more: they read only what is new
        assert sum(read) <= 1_000, f"the page read {sum(read)} events of a job it shows 1,000 of"
        assert page.evaluate("document.getElementById('events').start") == 24_002  # the list's numbers: the events'
        assert errors == []


HOSTILE = '<img src=x onerror="window.pwned=1"><script>window.pwned=1</script>"\'&'


def test_strings_from_the_service_are_drawn_as_text_never_as_markup(service, store, supervisor, cluster_view,
                                                                     browser):
    """Event messages, a job's reason and message, datacenter names (node labels) and node ids reach the page
    from workers and from the cluster: every one is drawn as text."""
    from dataclasses import replace

    from meridian.service.cluster.topology import ClusterTopology

    job = submit(supervisor, name="hostile")
    raw_event(store, job, "note" + HOSTILE, HOSTILE)
    cluster_view.topo = ClusterTopology(tuple(
        replace(n, datacenter=(n.datacenter + HOSTILE) if n.datacenter else None,
                node_id=n.node_id + HOSTILE, address=HOSTILE) for n in cluster_view.topo.nodes))
    with serve_in_thread(service) as url:
        page, errors = open_page(browser, url)
        page.locator("#events li", has_text=HOSTILE).first.wait_for(timeout=15_000)
        page.locator("#dc-map g.dc text", has_text=HOSTILE).first.wait_for(timeout=15_000)
        page.wait_for_timeout(1_500)
        assert page.evaluate("window.pwned") is None
        assert page.locator("img, script:not([src])").count() == 0
        assert errors == []


def test_a_token_pasted_with_a_character_no_header_can_carry_is_refused_at_once(store, supervisor, cluster_view,
                                                                              tmp_path, browser):
    """A token copied with a zero-width space made every request throw in the browser: the form vanished and
    the page said 'cannot reach the service: Failed to execute fetch'."""
    from meridian.api.auth import AuthSettings, create_token

    token = create_token(tmp_path / "tokens.json", "alice")
    auth = AuthSettings.load(enabled=True, token_file=str(tmp_path / "tokens.json"))
    service = FakeService(store, supervisor, cluster_view)
    with serve_in_thread(service, auth=auth) as url:
        page, _ = open_page(browser, url)
        page.locator("#token-form").wait_for(state="visible", timeout=15_000)
        page.fill("#token", token + "\u200b")
        page.click("#token-form button")
        page.locator("#status", has_text="not an API token").wait_for(timeout=5_000)
        assert page.locator("#token-form").is_visible()
        assert page.evaluate("sessionStorage.getItem('meridian.token')") is None
        page.fill("#token", token)
        page.click("#token-form button")
        page.locator("#status", has_text="updated").wait_for(timeout=15_000)


def test_the_page_runs_under_a_policy_that_allows_only_its_own_code_and_no_framing(
        service, store, supervisor, browser):
    """Without a Content-Security-Policy any site could frame the page (and, had a string ever been drawn as
    markup, run script in it); the page now names what it may load, and every part of it still works under
    that policy (a violation is a console error, which fails the test)."""
    import httpx

    job = submit(supervisor, name="framed")
    store.add_metrics(job, [{"step": s, "loss": 4.0, "tokens_per_s": 10.0, "data_s": 0.1, "compute_s": 0.5,
                             "sync_wait_s": 0.2} for s in range(1, 4)])
    with serve_in_thread(service) as url:
        for path in ("/", "/static/index.html", "/static/app.js"):  # the page is also at /static/index.html
            headers = httpx.get(url + path).headers
            policy = headers.get("content-security-policy", "")
            assert "frame-ancestors 'none'" in policy and "script-src 'self'" in policy, path
            assert "unsafe-inline" not in policy
            assert headers["x-content-type-options"] == "nosniff", path

        page, errors = open_page(browser, url, bypass_csp=False)
        phase = page.locator("#chart-phase polyline")
        phase.nth(2).wait_for(state="attached", timeout=15_000)
        # In one call: the chart is redrawn every second, and a line read after a redraw is detached.
        colours = page.locator("#chart-phase").evaluate(
            "svg => [...svg.querySelectorAll('polyline')].map((e) => getComputedStyle(e).stroke)")
        assert colours == ["rgb(154, 103, 0)", "rgb(26, 127, 55)", "rgb(198, 40, 40)"]  # styles still apply
        assert page.locator("span.key-val").evaluate("e => getComputedStyle(e).color") == "rgb(111, 66, 193)"
        assert errors == []

        other = browser.new_page()
        blocked: list[str] = []
        other.on("console", lambda m: blocked.append(m.text))
        other.set_content(f'<iframe src="{url}/" width="800" height="600"></iframe>')
        other.wait_for_timeout(2_000)
        frame = other.frames[1]
        assert frame.locator("#jobs").count() == 0  # the browser refused to show it inside another page
        assert any("frame-ancestors" in m for m in blocked), blocked
