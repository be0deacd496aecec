// The scheduler's live view: polls /dashboard/snapshot every few seconds (not while the tab is hidden) and
// draws the running set, the waiting queue, the slots, the KV pages, the steps and the last minutes; only
// the panels on screen are redrawn.
import { Unauthorized, call, el, fmt } from "./common.js";

// How often the page polls (the header's select, kept in this browser): every poll redraws the tables and
// plots, which costs a browser on the server's own cores (loadtests/bench_live_view.py); 0: paused.
const REFRESH_STORE = "batchserve.dashboardRefresh";
const DEFAULT_REFRESH_S = "2";
const $ = (id) => document.getElementById(id);
const COLORS = ["#2f6fdf", "#c2410c", "#15803d", "#7c3aed", "#a16207"];
let timer = null;
let polling = false; // a snapshot request is in flight

function setText(id, text) { $(id).textContent = text; }

// Redrawn at every refresh: existing nodes are reused and only changed text is written, so the browser
// lays out and paints little (the page's cost is part of what a loaded server loses to it).
function children(parent, count, make) {
  while (parent.children.length > count) parent.lastElementChild.remove();
  while (parent.children.length < count) parent.append(make());
  return parent.children;
}

function setCell(node, text, className = "") {
  if (node.textContent !== text) node.textContent = text;
  if (node.className !== className) node.className = className;
}

function fillTable(tbody, rows) {
  const trs = children(tbody, rows.length, () => el("tr"));
  rows.forEach((cells, i) => {
    const tds = children(trs[i], cells.length, () => el("td"));
    cells.forEach(([text, className], j) => setCell(tds[j], String(text), className || ""));
  });
}

function renderRunning(admitted) {
  fillTable($("running"), admitted.map((r) => ([
    [r.rid, "rid left"], [r.slot], [r.status, "left"], [r.prompt_tokens], [r.prefilled],
    [`${r.generated} / ${r.max_tokens}`], [r.kv_pages], [r.kv_reserved_pages], [r.cached_tokens], [r.priority],
    [r.adapter || "base"], [fmt(r.waited_s, 1)]])));
  $("running-empty").classList.toggle("hidden", admitted.length > 0);
}

function renderWaiting(waiting, numWaiting) {
  fillTable($("waiting"), waiting.map((r) => ([
    [r.rid, "rid left"], [r.status, "left"], [r.prompt_tokens], [r.generated], [r.max_tokens], [r.priority],
    [r.adapter || "base"], [fmt(r.waited_s, 1)]])));
  $("waiting-empty").classList.toggle("hidden", waiting.length > 0);
  setText("waiting-note", numWaiting > waiting.length ? `(first ${waiting.length} of ${numWaiting})` : "");
}

function renderSlots(admitted, slotsTotal) {
  const slots = new Map(admitted.map((r) => [r.slot, r]));
  const cells = children($("slots"), slotsTotal, () => el("span"));
  for (let i = 0; i < cells.length; i += 1) {
    setCell(cells[i], "", slots.has(i) ? slots.get(i).status : "");
    cells[i].title = slots.has(i) ? `slot ${i}: ${slots.get(i).rid}` : `slot ${i}: free`;
  }
}

function renderKv(kv) {
  const own = Math.max(kv.used - kv.cached, 0);
  const parts = [["held by requests", own, COLORS[0]], ["cached, in use", kv.cached_referenced, COLORS[2]],
                 ["cached, evictable", kv.cached - kv.cached_referenced, "#9bd3ae"], ["free", kv.free, "#edf0f3"]];
  const bars = children($("kv-bar"), parts.length, () => el("div"));
  parts.forEach(([name, pages, color], i) => {
    bars[i].style.width = `${(100 * pages) / Math.max(kv.total, 1)}%`; // CSSOM, which the page's CSP allows
    bars[i].style.background = color;
    bars[i].title = `${name}: ${pages} pages`;
  });
  const legend = $("kv-legend");
  legend.replaceChildren();
  for (const [name, pages, color] of parts) {
    const swatch = el("i");
    swatch.style.background = color;
    legend.append(swatch, `${name} ${pages}`);
  }
  legend.append(`  ·  reserved ${kv.reserved} of ${kv.total} pages (${kv.page_size} tokens each)`);
}

function renderCards(snapshot) {
  const view = snapshot.scheduler;
  const totals = snapshot.totals;
  setText("running-count", view.slots_used);
  setText("slots-sub", `of ${view.slots_total} slots`);
  setText("waiting-count", view.num_waiting);
  setText("kv-used", `${view.kv.used} / ${view.kv.total}`);
  setText("kv-sub", `reserved ${view.kv.reserved} · cached ${view.kv.cached}`);
  setText("budget", view.prefill_budget);
  setText("policy", `tokens a step · ${view.policy}`);
  const last = snapshot.steps.at(-1);
  setText("step-ms", last ? `${fmt(last[4], 1)} ms` : "–"); // [step, prefill, decodes, batch, ms, ...]
  setText("step-target", view.max_step_ms > 0 ? `target ${fmt(view.max_step_ms)} ms` : "no step-time bound");
  setText("preemptions", totals.preemptions);
  setText("out-of-reach", `${totals.steps_target_out_of_reach} steps over the target`);
  const drafts = totals.spec_drafts;
  setText("acceptance", drafts ? fmt(1 + totals.spec_accepted_tokens / drafts, 2) : "–");
  setText("spec-sub", drafts ? `tokens a drafted row gives (${totals.spec_accepted_tokens} of ${totals.spec_draft_tokens} accepted)`
                             : "no speculative decoding");
}

// Each canvas's size, kept by a ResizeObserver: reading clientWidth after the tables changed would force
// a layout per plot every second.
const sizes = new Map();
const resized = new ResizeObserver((entries) => {
  for (const entry of entries) sizes.set(entry.target.id, [entry.contentRect.width, entry.contentRect.height]);
});
document.querySelectorAll("canvas.plot").forEach((canvas) => resized.observe(canvas));

// A line plot of `series` ({name, values}) over `xs` on a canvas, with an optional dashed level line.
function drawPlot(id, xs, series, level = null) {
  const canvas = $(id);
  const ratio = window.devicePixelRatio || 1;
  const [width, height] = sizes.get(id) || [0, 0];
  if (!width || !height) return;
  if (canvas.width !== width * ratio || canvas.height !== height * ratio) {
    canvas.width = width * ratio; canvas.height = height * ratio; // resizing reallocates: only when it changed
  }
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, width, height);
  const left = 44, bottom = height - 18, top = 8, right = width - 8;
  const values = series.flatMap((s) => s.values.filter((v) => v >= 0));
  const ymax = Math.max(1, level ? level.value : 0, ...values) * 1.1;
  const xmin = xs.length ? xs[0] : 0, xmax = xs.length ? Math.max(xs.at(-1), xmin + 1) : 1;
  const X = (x) => left + ((x - xmin) / (xmax - xmin)) * (right - left);
  const Y = (y) => bottom - (y / ymax) * (bottom - top);
  g.strokeStyle = "#dde1e6"; g.fillStyle = "#66707c"; g.font = "11px sans-serif"; g.lineWidth = 1;
  for (let i = 0; i <= 4; i += 1) {
    const y = (ymax * i) / 4;
    g.beginPath(); g.moveTo(left, Y(y)); g.lineTo(right, Y(y)); g.stroke();
    g.fillText(y >= 100 ? y.toFixed(0) : y.toFixed(1), 2, Y(y) + 4);
  }
  if (level) {
    g.setLineDash([5, 4]); g.strokeStyle = "#c2410c";
    g.beginPath(); g.moveTo(left, Y(level.value)); g.lineTo(right, Y(level.value)); g.stroke();
    g.setLineDash([]);
  }
  series.forEach((s, k) => {
    g.strokeStyle = COLORS[k % COLORS.length]; g.lineWidth = 1.5;
    g.beginPath();
    let drawing = false;
    s.values.forEach((v, i) => {
      if (v < 0) { drawing = false; return; }
      if (drawing) g.lineTo(X(xs[i]), Y(v)); else g.moveTo(X(xs[i]), Y(v));
      drawing = true;
    });
    g.stroke();
  });
  const legend = $(id.replace("plot-", "legend-"));
  legend.replaceChildren();
  series.forEach((s, k) => {
    const swatch = el("i");
    swatch.style.background = COLORS[k % COLORS.length];
    const last = s.values.filter((v) => v >= 0).at(-1);
    legend.append(swatch, `${s.name} ${fmt(last, 1)}`);
  });
  if (level) legend.append(`  ·  ${level.name} ${fmt(level.value)}`);
}

function renderPlots(snapshot) {
  const plot = (id, ...args) => { if (onScreen.has(id)) drawPlot(id, ...args); };
  const steps = snapshot.steps; // [step, prefill_tokens, decode_rows, batch_size, step_ms, predicted_ms, prefill_cap]
  const target = snapshot.scheduler.max_step_ms;
  plot("plot-steps", steps.map((s) => s[0]), [
    { name: "step ms", values: steps.map((s) => s[4]) },
    { name: "predicted ms", values: steps.map((s) => s[5]) },
    { name: "prefill tokens / 10", values: steps.map((s) => s[1] / 10) },
  ], target > 0 ? { name: "target ms", value: target } : null);
  const h = snapshot.history; // [t, tokens_per_s, ttft p50, p90, itl p50, p99, waiting, running, kv ratio]
  const t = h.map((p) => p[0]);
  plot("plot-throughput", t, [{ name: "tokens/s", values: h.map((p) => p[1]) }]);
  plot("plot-ttft", t, [{ name: "p50", values: h.map((p) => p[2]) }, { name: "p90", values: h.map((p) => p[3]) }]);
  plot("plot-itl", t, [{ name: "p50", values: h.map((p) => p[4]) }, { name: "p99", values: h.map((p) => p[5]) }]);
  plot("plot-queue", t, [{ name: "waiting", values: h.map((p) => p[6]) }, { name: "running", values: h.map((p) => p[7]) },
                         { name: "KV used %", values: h.map((p) => p[8] * 100) }]);
}

// What is on screen, kept by an IntersectionObserver: a panel out of view is not redrawn (a long running set
// pushes the waiting queue and the plots below the fold), and is drawn from the last snapshot when it
// comes into view. The cards at the top are always drawn.
const onScreen = new Set();
let last = null; // the last snapshot drawn
const seen = new IntersectionObserver((entries) => {
  let appeared = false;
  for (const entry of entries) {
    if (entry.isIntersecting && !onScreen.has(entry.target.id)) { onScreen.add(entry.target.id); appeared = true; }
    if (!entry.isIntersecting) onScreen.delete(entry.target.id);
  }
  if (appeared && last) draw(last);
});
document.querySelectorAll("#panel-kv, #panel-running, #panel-waiting, canvas.plot").forEach((node) => seen.observe(node));

function draw(snapshot) {
  const view = snapshot.scheduler;
  const admitted = view.requests.filter((r) => r.slot >= 0);
  renderCards(snapshot);
  if (onScreen.has("panel-kv")) { renderKv(view.kv); renderSlots(admitted, view.slots_total); }
  if (onScreen.has("panel-running")) renderRunning(admitted);
  if (onScreen.has("panel-waiting")) renderWaiting(view.requests.filter((r) => r.slot < 0), view.num_waiting);
  renderPlots(snapshot);
}

async function refresh() {
  timer = null;
  if (polling) return;
  polling = true;
  try {
    const response = await call("/dashboard/snapshot", {}, refresh);
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const snapshot = await response.json();
    if (snapshot.scheduler) {
      last = snapshot;
      draw(snapshot);
      setText("status", `live · up ${fmt(snapshot.uptime_s)} s`);
      window.batchserveUpdated = Date.now(); // for scripts that watch the page (the benchmark)
    } else {
      setText("status", "waiting for the scheduler's first report…");
    }
  } catch (error) {
    if (error instanceof Unauthorized) { setText("status", "needs an API key"); return; }
    setText("status", `server unreachable: ${error.message}`);
  } finally {
    polling = false;
  }
  schedule();
}

function schedule() {
  const seconds = Number($("refresh").value);
  if (timer !== null) clearTimeout(timer);
  timer = !document.hidden && seconds > 0 ? setTimeout(refresh, seconds * 1000) : null;
}

$("refresh").value = localStorage.getItem(REFRESH_STORE) || DEFAULT_REFRESH_S;
$("refresh").onchange = () => {
  localStorage.setItem(REFRESH_STORE, $("refresh").value);
  if (Number($("refresh").value) > 0) refresh(); else schedule();
};
document.addEventListener("visibilitychange", () => {
  if (!document.hidden && timer === null) refresh();
});
refresh();
