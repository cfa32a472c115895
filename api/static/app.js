// Meridian's live page: polls the service's JSON endpoints and draws with plain SVG. No framework and
// no CDN, so it works on an air-gapped cluster. Every id used here is also what the browser test reads.
"use strict";

const POLL_MS = 1000;
const SVG = "http://www.w3.org/2000/svg";
let selected = null;          // job id shown in detail
let lastEventId = 0;

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
  throw new Error(why);
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
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.json();
}

$("token-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const token = $("token").value.trim();
  if (!token) return;
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
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
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
    tr.addEventListener("click", () => { selected = j.id; lastEventId = 0; $("events").replaceChildren(); tick(); });
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

// -- charts -----------------------------------------------------------------------------------------------
function lineChart(svg, series, { colors = ["#c2410c"], labels = [] } = {}) {
  svg.replaceChildren();
  const W = 420, H = 180, L = 48, B = 20, pts = series.flat();
  if (!pts.length) { svg.append(el("text", { x: 150, y: 90 }, "no steps yet")); return; }
  const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1), y0 = Math.min(...ys, 0), y1 = Math.max(...ys) || 1;
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

function renderCharts(points) {
  const phase = (k) => points.filter((p) => p[k] !== undefined && p[k] !== null).map((p) => [p.step, p[k]]);
  const val = phase("val_loss");  // drawn only when the job's validation produced some
  lineChart($("chart-loss"), [points.map((p) => [p.step, p.loss]), ...(val.length ? [val] : [])],
    { colors: ["#c2410c", "#6f42c1"], labels: ["train", "validation"] });
  lineChart($("chart-tps"), [points.map((p) => [p.step, p.tokens_per_s])], { colors: ["#3a72e8"] });
  lineChart($("chart-phase"), [phase("data_s"), phase("compute_s"), phase("sync_wait_s")],
    { colors: ["#9a6700", "#1a7f37", "#c62828"], labels: ["data", "compute", "sync wait"] });
}

function renderEvents(events) {
  const list = $("events");
  for (const e of events) {
    lastEventId = Math.max(lastEventId, e.id);
    list.append(el("li", { class: `ev-${e.kind}` }, `${new Date(e.time * 1000).toLocaleTimeString()} [${e.kind}] ${e.message}`));
  }
}

// -- loop -------------------------------------------------------------------------------------------------
async function tick() {
  try {
    const [list, cluster, probe] = await Promise.all([
      getJSON("/v1/jobs?limit=50"), getJSON("/v1/cluster").catch(() => null),
      getJSON("/v1/diagnostics/collectives").catch(() => null),
    ]);
    const jobs = list ? list.jobs : [];
    if (!selected && jobs.length) selected = (jobs.find((j) => j.state === "running") || jobs[0]).id;
    renderJobs(jobs);
    const job = jobs.find((j) => j.id === selected) || null;
    renderMap(cluster, job, probe);
    $("job-detail").hidden = !job;
    if (job) {
      $("detail-id").textContent = job.id;
      $("detail-state").textContent = job.state;
      $("detail-state").className = `state state-${job.state}`;
      const [metrics, events] = await Promise.all([
        getJSON(`/v1/jobs/${job.id}/metrics`), getJSON(`/v1/jobs/${job.id}/events?after=${lastEventId}`),
      ]);
      renderCharts(metrics ? metrics.points : []);
      renderEvents(events ? events.events : []);
    }
    $("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    $("status").textContent = `cannot reach the service: ${err.message}`;
  }
}

tick();
setInterval(tick, POLL_MS);
