// Meridian's live page: follows the selected job over its event stream (Server-Sent Events, resumed with
// Last-Event-ID), reads the job list, the cluster and the link probe every second, and draws with plain SVG.
// The job's events are polled only while its stream is down. No framework and no CDN, so it works on an
// air-gapped cluster. Every id used here is also what the browser test reads.
"use strict";

const POLL_MS = 1000;
const RESTREAM_MS = 2000;     // a stream opened with fetch (a token must be sent) is opened again this long after it drops
const SVG = "http://www.w3.org/2000/svg";
const MAX_EVENTS = 1000;      // events kept on the page (the oldest go first); the API has them all
const MAX_POINTS = 4000;      // chart points kept per series; past it every other one is dropped
const PAGE_EVENTS = 10000;    // the API's largest page of events
const PAGE_POINTS = 10000;
const PAGES_PER_TICK = 10;    // a long job's history is read over a few ticks, not in one burst
let selected = null;          // job id shown in detail
// What the page has read of the selected job. A click replaces the object: a poll still in flight for the
// job shown before sees it is no longer current and draws nothing.
let detail = newDetail(null);

function newDetail(jobId) {
  return { jobId, lastEventId: 0, shown: 0, dropped: 0, points: [], cursor: null, tailRead: false,
           stream: null, streaming: false, ended: false, metricsDue: true };
}

// The event kinds the service sends, from its registry (GET /v1/event-kinds): an EventSource delivers a named
// event only to a listener of that name. A kind the service does not know comes as a plain "message".
let eventKinds = null;

async function readEventKinds() {
  if (eventKinds === null) {
    const r = await getJSON("/v1/event-kinds");
    eventKinds = r ? r.kinds.map((k) => k.kind) : [];
  }
  return eventKinds;
}

const $ = (id) => document.getElementById(id);

// With auth on, the page sends the token typed into the header form. It is kept in sessionStorage only:
// gone when the tab closes, never sent anywhere but this service.
const TOKEN_KEY = "meridian.token";

function authHeaders() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? { Authorization: `Bearer ${token}` } : {};
}

function askForToken(why) {
  $("token-form").hidden = false;
  $("token-forget").hidden = !sessionStorage.getItem(TOKEN_KEY);
  throw new ServiceError(why);  // the service answered: it wants a token
}

class ServiceError extends Error {}  // the service answered, with an error: not "cannot reach"

async function problemText(r) {
  // Errors are RFC 9457 problem JSON: its detail says what went wrong, its request id finds it in the log.
  try {
    const p = await r.json();
    if (p && typeof p.detail === "string") {
      return `${p.detail} (HTTP ${r.status}${p.request_id ? `, request id ${p.request_id}` : ""})`;
    }
  } catch (e) { /* not JSON: a proxy's page */ }
  return `HTTP ${r.status} ${r.statusText}`.trim();
}

async function getJSON(url) {
  const sent = sessionStorage.getItem(TOKEN_KEY);
  const r = await fetch(url, { headers: { Accept: "application/json", ...authHeaders() } });
  if (r.status === 401) {
    // A request sent before a new token was entered says nothing about the new one.
    if (sent !== sessionStorage.getItem(TOKEN_KEY)) throw new Error("retrying with the new token");
    askForToken(sent ? "the token was refused; paste a valid one" : "this service needs an API token; paste one above");
  }
  if (r.status === 404) return null;
  if (!r.ok) throw new ServiceError(`the service answered ${url} with an error: ${await problemText(r)}`);
  return r.json();
}

$("token-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const token = $("token").value.trim();
  if (!token) return;
  // A token is printable ASCII (mrd_ + URL-safe base64); anything else cannot even be sent in a header
  // (a character picked up when copying it, such as a zero-width space or an ellipsis).
  if (!/^[\x21-\x7e]+$/.test(token)) {
    $("status").textContent = "that is not an API token: it holds characters a token never has " +
      "(spaces or non-ASCII characters picked up when copying it); paste it again";
    return;
  }
  sessionStorage.setItem(TOKEN_KEY, token);
  $("token").value = "";
  $("token-form").hidden = true;
  $("token-forget").hidden = false;
  tick();
});

$("token-forget").hidden = !sessionStorage.getItem(TOKEN_KEY);
$("token-forget").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  $("token-forget").hidden = true;
  tick();
});

function el(tag, attrs = {}, text) {
  const node = tag.includes(":") || ["svg", "g", "rect", "circle", "line", "polyline", "text", "path", "title"].includes(tag)
    ? document.createElementNS(SVG, tag) : document.createElement(tag);
  // A style goes through the CSSOM: the page's Content-Security-Policy refuses inline style attributes.
  for (const [k, v] of Object.entries(attrs)) if (k === "style") node.style.cssText = v; else node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function si(x, unit = "") {
  if (x === null || x === undefined) return "-";
  for (const [f, p] of [[1e9, "G"], [1e6, "M"], [1e3, "k"]]) if (Math.abs(x) >= f) return (x / f).toFixed(1) + p + unit;
  return x.toFixed(x < 10 ? 2 : 0) + unit;
}

function duration(s) {
  if (s === null || s === undefined) return "--:--";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  const mm = String(m).padStart(h ? 2 : 1, "0"), ss = String(sec).padStart(2, "0");
  return h ? `${h}:${mm}:${ss}` : `${mm}:${ss}`;
}

// -- jobs table -------------------------------------------------------------------------------------------
function renderJobs(jobs) {
  const body = $("jobs").tBodies[0];
  body.replaceChildren();
  $("no-jobs").hidden = jobs.length > 0;
  for (const j of jobs) {
    const p = j.progress, total = p.total_steps || 0, step = p.step || 0;
    const tr = el("tr", { "data-job": j.id, class: j.id === selected ? "selected" : "" });
    const bar = el("span", { class: "bar", title: `${step}/${total}` });
    bar.append(el("span", { style: `width:${total ? (100 * step / total).toFixed(1) : 0}%` }));
    const prog = el("td", { class: "progress" });
    prog.append(bar, document.createTextNode(` ${step}/${total || "-"}`));
    tr.append(el("td", {}, j.id), el("td", {}, j.name), el("td", { class: `state state-${j.state}` }, j.state), prog,
      el("td", { class: "loss" }, p.loss === null ? "-" : p.loss.toFixed(3)), el("td", {}, si(p.tokens_per_s)),
      el("td", {}, duration(p.eta_s)));
    tr.title = `${j.reason}: ${j.message}`;
    tr.addEventListener("click", () => select(j.id));
    body.append(tr);
  }
}

// -- datacenter map ---------------------------------------------------------------------------------------
function linkText(probe) {
  if (!probe) return "inter-DC link: not measured yet (POST /v1/diagnostics/collectives runs the probe)";
  const inter = (probe.tiers || []).filter((t) => t.tier === "inter_dc");
  if (!inter.length) return "inter-DC link: the last probe measured no inter-DC tier";
  const when = new Date(probe.measured_at * 1000).toLocaleTimeString();
  return inter.map((t) => `${t.datacenters.join(" ↔ ")}: latency ${t.summary.latency_us.toFixed(0)} µs, ` +
    `bandwidth ${t.summary.bandwidth_gbps.toFixed(2)} Gbit/s`).join("; ") + ` (probe at ${when})`;
}

function renderMap(cluster, job, probe) {
  const svg = $("dc-map");
  svg.replaceChildren();
  const dcs = cluster ? cluster.datacenters : [];
  const ranksOn = {};
  for (const p of (job ? job.placement : [])) (ranksOn[p.node_id] ||= []).push(p.rank);
  const w = 900 / Math.max(1, dcs.length), boxW = Math.min(360, w - 60);
  const centers = [];
  dcs.forEach((dc, i) => {
    const x = i * w + (w - boxW) / 2, cx = x + boxW / 2;
    centers.push(cx);
    const g = el("g", { class: "dc", "data-dc": dc.name });
    g.append(el("rect", { x, y: 20, width: boxW, height: 200, rx: 10, fill: "#f1f5ff", stroke: "#9db4e8" }));
    g.append(el("text", { x: x + 10, y: 40 }, `${dc.name} · ${dc.alive_nodes}/${dc.nodes.length} nodes alive`));
    dc.nodes.forEach((n, k) => {
      const nx = x + 40 + (k % 4) * ((boxW - 60) / 4), ny = 85 + Math.floor(k / 4) * 60;
      const node = el("g", { class: `node ${n.alive ? "alive" : "lost"}`, "data-node": n.node_id });
      node.append(el("circle", { cx: nx, cy: ny, r: 16, fill: n.alive ? "#3fb950" : "#e5534b" }));
      const ranks = ranksOn[n.node_id] || [];
      node.append(el("text", { x: nx - 14, y: ny + 32 }, n.node_id.slice(0, 6)));
      if (ranks.length) node.append(el("text", { x: nx - 12, y: ny + 4, class: "ranks" }, "r" + ranks.join(",")));
      node.append(el("title", {}, `${n.node_id} ${n.alive ? "alive" : "LOST"} ${n.address}` +
        (ranks.length ? ` ranks ${ranks.join(",")}` : "")));
      g.append(node);
    });
    svg.append(g);
  });
  for (let i = 0; i + 1 < centers.length; i++) {
    const a = centers[i] + boxW / 2, b = centers[i + 1] - boxW / 2;
    svg.append(el("line", { x1: a, y1: 120, x2: b, y2: 120, stroke: "#7a8394", "stroke-width": 3,
      "stroke-dasharray": "6 4", class: "inter-dc-link" }));
  }
  $("link-info").textContent = linkText(probe);
  $("map-job").textContent = job ? `(ranks of job ${job.id})` : "";
}

function select(jobId) {
  if (jobId === selected) return;
  selected = jobId;
  closeStream(detail);
  detail = newDetail(jobId);
  $("events").replaceChildren();
  $("events").start = 1;
  tick();
}

// -- charts -----------------------------------------------------------------------------------------------
function lineChart(svg, series, { colors = ["#c2410c"], labels = [] } = {}) {
  svg.replaceChildren();
  const W = 420, H = 180, L = 48, B = 20;
  // A diverged loss is stored as null: it is not a point at 0, and not a point at all.
  series = series.map((s) => s.filter(([x, y]) => Number.isFinite(x) && Number.isFinite(y)));
  const pts = series.flat();
  if (!pts.length) { svg.append(el("text", { x: 150, y: 90 }, "no steps yet")); return; }
  let x0 = Infinity, x1 = -Infinity, y0 = 0, y1 = -Infinity;  // no Math.min(...): it overflows on long arrays
  for (const [x, y] of pts) { x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y); }
  x1 = Math.max(x1, x0 + 1);
  y1 = y1 || 1;
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - 8), sy = (y) => H - B - (y - y0) / (y1 - y0 || 1) * (H - B - 10);
  svg.append(el("line", { x1: L, y1: H - B, x2: W - 4, y2: H - B, stroke: "#ccd" }));
  svg.append(el("text", { x: 2, y: 14 }, si(y1)), el("text", { x: 2, y: H - B }, si(y0)));
  svg.append(el("text", { x: L, y: H - 4 }, `step ${x0}`), el("text", { x: W - 70, y: H - 4 }, `step ${x1}`));
  series.forEach((s, i) => {
    const line = el("polyline", { points: s.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" "),
      "data-points": s.length, style: `stroke:${colors[i % colors.length]}` });
    if (labels[i]) line.append(el("title", {}, labels[i]));
    svg.append(line);
  });
}

const CHART_FIELDS = ["loss", "val_loss", "tokens_per_s", "data_s", "compute_s", "sync_wait_s"];

function keepPoints(d, points) {
  for (const p of points) {
    const kept = { step: p.step };
    for (const k of CHART_FIELDS) if (typeof p[k] === "number") kept[k] = p[k];
    d.points.push(kept);
  }
  // A long job's history stays a few thousand points: every other one goes (the newest always stays).
  while (d.points.length > MAX_POINTS) {
    const last = d.points[d.points.length - 1];
    d.points = d.points.filter((_, i) => i % 2 === 0);
    if (d.points[d.points.length - 1] !== last) d.points.push(last);
  }
}

function renderCharts(points) {
  const phase = (k) => points.filter((p) => p[k] !== undefined && p[k] !== null).map((p) => [p.step, p[k]]);
  const val = phase("val_loss");  // drawn only when the job's validation produced some
  lineChart($("chart-loss"), [phase("loss"), ...(val.length ? [val] : [])],
    { colors: ["#c2410c", "#6f42c1"], labels: ["train", "validation"] });
  lineChart($("chart-tps"), [phase("tokens_per_s")], { colors: ["#3a72e8"] });
  lineChart($("chart-phase"), [phase("data_s"), phase("compute_s"), phase("sync_wait_s")],
    { colors: ["#9a6700", "#1a7f37", "#c62828"], labels: ["data", "compute", "sync wait"] });
}

function renderEvents(d, { events, skipped }) {
  const list = $("events");
  d.dropped += skipped;
  for (const e of events) {
    if (e.id <= d.lastEventId) continue;  // never listed twice
    d.lastEventId = e.id;
    list.append(el("li", { class: `ev-${e.kind}` }, `${new Date(e.time * 1000).toLocaleTimeString()} [${e.kind}] ${e.message}`));
    d.shown += 1;
  }
  while (d.shown > MAX_EVENTS) {  // the page keeps the newest; the list's numbers stay the events' numbers
    list.firstElementChild.remove();
    d.shown -= 1;
    d.dropped += 1;
  }
  list.start = d.dropped + 1;
}

// -- the event stream ----------------------------------------------------------------------------------------
// One per selected job, from the newest event the page holds. Without a token an EventSource, which resumes by
// itself (sending Last-Event-ID); with one, a fetch whose body is read as the same stream (an EventSource cannot
// send an Authorization header), opened again after it drops. While it is down the page polls the events.
function openStream(d, kinds) {
  const url = `/v1/jobs/${encodeURIComponent(d.jobId)}/events`;
  const token = sessionStorage.getItem(TOKEN_KEY);
  const onEvent = (data) => streamed(d, data);
  const onEnd = () => { d.ended = true; closeStream(d); tick(); };
  if (!token) {
    const es = new EventSource(`${url}?after=${d.lastEventId}`);
    es.onopen = () => { d.streaming = true; };
    es.onerror = () => { d.streaming = false; };  // it reconnects by itself; the page polls meanwhile
    for (const kind of [...kinds, "message"]) es.addEventListener(kind, (m) => onEvent(m.data));
    es.addEventListener("end", onEnd);
    d.stream = { close: () => es.close() };
    return;
  }
  const ctrl = new AbortController();
  d.stream = { close: () => ctrl.abort() };
  fetch(url, { headers: { Accept: "text/event-stream", "Last-Event-ID": String(d.lastEventId), ...authHeaders() },
               signal: ctrl.signal })
    .then(async (r) => {
      if (!r.ok || !r.body) throw new Error(`HTTP ${r.status}`);
      d.streaming = true;
      const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += value;
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          const kind = (block.match(/^event: (.*)$/m) || [])[1];
          const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
          if (kind === "end") { onEnd(); return; }
          if (data) onEvent(data);
        }
      }
      throw new Error("the stream dropped");
    })
    .catch(() => {
      d.streaming = false;
      if (d.stream && d === detail && !d.ended) setTimeout(() => { if (d === detail && !d.ended) openStream(d, kinds); }, RESTREAM_MS);
    });
}

function closeStream(d) {
  if (d.stream) d.stream.close();
  d.stream = null;
  d.streaming = false;
}

function streamed(d, data) {
  if (d !== detail) return;  // a stream of the job shown before: nothing of it is drawn
  const e = JSON.parse(data);
  renderEvents(d, { events: [e], skipped: 0 });
  if (e.kind === "progress" || e.kind === "state") {
    d.metricsDue = true;  // new steps (or the job's end): read the metrics after the page's cursor
    if (e.kind === "state") $("detail-state").textContent = e.data.state;
    tick();
  }
}

// The selected job's events after what the page holds, a few pages at a time, while its stream is down. The
// first read of a job asks for its newest events only (and how many come before them): a long job's history
// is never fetched.
async function readEvents(d) {
  let events = [], skipped = 0, after = d.lastEventId;
  if (!d.tailRead) {
    const tail = await getJSON(`/v1/jobs/${encodeURIComponent(d.jobId)}/events?newest=${MAX_EVENTS}`);
    if (!tail) return { events, skipped };  // asked again next time
    d.tailRead = true;
    return { events: tail.events, skipped: tail.earlier || 0 };
  }
  for (let i = 0; i < PAGES_PER_TICK; i++) {
    const page = await getJSON(`/v1/jobs/${encodeURIComponent(d.jobId)}/events?after=${after}&limit=${PAGE_EVENTS}`);
    const got = page ? page.events : [];
    if (got.length) after = got[got.length - 1].id;
    events = events.concat(got);
    if (events.length > MAX_EVENTS) {  // only the newest are shown: never put the rest on the page
      skipped += events.length - MAX_EVENTS;
      events = events.slice(-MAX_EVENTS);
    }
    if (got.length < PAGE_EVENTS) break;
  }
  return { events, skipped };
}

// Each page is kept as it comes, with the cursor to the next (a page that fails is asked again next time);
// a ``d`` no longer selected is simply dropped afterwards.
async function readMetrics(d) {
  if (!d.metricsDue) return;
  d.metricsDue = false;
  for (let i = 0; i < PAGES_PER_TICK; i++) {
    const c = d.cursor, at = c ? `&after_step=${c.after_step}&after_id=${c.after_id}` : "";
    let page;
    try {
      page = await getJSON(`/v1/jobs/${encodeURIComponent(d.jobId)}/metrics?limit=${PAGE_POINTS}${at}`);
    } catch (err) {
      d.metricsDue = true;  // asked again next time
      throw err;
    }
    if (!page) return;
    keepPoints(d, page.points);
    d.cursor = page.next || d.cursor;
    if (page.points.length < PAGE_POINTS) return;
  }
  d.metricsDue = true;  // more pages: the next tick reads on
}

// -- loop -------------------------------------------------------------------------------------------------
async function refresh() {
  try {
    const [list, cluster, probe] = await Promise.all([
      getJSON("/v1/jobs?limit=50"), getJSON("/v1/cluster").catch(() => null),
      getJSON("/v1/diagnostics/collectives").catch(() => null),
    ]);
    const jobs = list ? list.jobs : [];
    if (!selected && jobs.length) select((jobs.find((j) => j.state === "running") || jobs[0]).id);
    renderJobs(jobs);
    const job = jobs.find((j) => j.id === selected) || null;
    renderMap(cluster, job, probe);
    $("job-detail").hidden = !job;
    if (job) {
      $("detail-id").textContent = job.id;
      $("detail-state").textContent = job.state;
      $("detail-state").className = `state state-${job.state}`;
      const d = detail;
      // Polled only before the stream opens and while it is down; a finished job's stream has ended.
      const polling = !d.tailRead || (!d.streaming && !d.ended);
      if (job.state !== d.lastState) d.metricsDue = true;  // e.g. it ended: its last steps
      d.lastState = job.state;
      const [, events] = await Promise.all([readMetrics(d), polling ? readEvents(d) : { events: [], skipped: 0 }]);
      if (d !== detail) return;  // another job was selected meanwhile: the next poll draws that one
      renderCharts(d.points);
      renderEvents(d, events);
      if (d.tailRead && !d.stream && !d.ended) openStream(d, await readEventKinds());
    }
    $("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    $("status").textContent = err instanceof ServiceError ? err.message : `cannot reach the service: ${err.message}`;
  }
}

// One poll at a time: a slow service must not have two polls read the same events after the same id. A poll
// asked for while one runs (the timer, a click) runs once that one is done.
let polling = false, pollAgain = false;
function tick() {
  if (polling) { pollAgain = true; return; }
  polling = true;
  refresh().finally(() => {
    polling = false;
    if (pollAgain) { pollAgain = false; tick(); }
  });
}

tick();
setInterval(tick, POLL_MS);
