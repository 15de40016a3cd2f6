// dptrain dashboard: a single page over the v1 API. No build step and no framework: the page is
// small, and the API is the product. All data goes into the DOM through textContent, never HTML.
"use strict";

const TOKEN_KEY = "dptrain.token";
const TERMINAL = new Set(["succeeded", "failed", "cancelled", "pruned"]);
const STATUSES = ["queued", "running", "succeeded", "failed", "cancelled", "pruned"];
const LIST_POLL_MS = 2000;
const DETAIL_POLL_MS = 2000;
const WORKERS_POLL_MS = 5000;
const LOG_TAIL = 200;
const MAX_CHART_POINTS = 2000;

// ---- small helpers -------------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function ago(iso) {
  if (!iso) return "";
  return duration((Date.now() - Date.parse(iso)) / 1000) + " ago";
}

function duration(seconds) {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) return "";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

function jobDuration(job) {
  if (!job.started_at) return "";
  const end = job.finished_at ? Date.parse(job.finished_at) : Date.now();
  return duration((end - Date.parse(job.started_at)) / 1000);
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function fmt(v) {
  if (typeof v !== "number") return String(v);
  if (v !== 0 && (Math.abs(v) < 1e-3 || Math.abs(v) >= 1e6)) return v.toExponential(3);
  return String(Math.round(v * 1e4) / 1e4);
}

function badge(status) {
  return el("span", { class: `badge ${status}`, "data-status": status, text: status });
}

function progressBar(p) {
  // No total (a command that set no hyperparameters.steps): the last reported step, no bar or fraction.
  if (p.total_steps === null || p.total_steps === undefined) {
    return el("span", { class: "progress-wrap" }, el("span", { class: "progress-label", text: `step ${p.step}` }));
  }
  const frac = p.total_steps ? Math.min(1, p.step / p.total_steps) : 0;
  const bar = el("span");
  bar.style.width = `${(frac * 100).toFixed(1)}%`;
  return el("span", { class: "progress-wrap" },
    el("span", { class: "progress", role: "progressbar", "aria-valuenow": p.step, "aria-valuemax": p.total_steps }, bar),
    el("span", { class: "progress-label", text: `${p.step}/${p.total_steps}` }));
}

// ---- API access ----------------------------------------------------------------------------------

class Unauthorized extends Error {}

async function api(path, { method = "GET", etag = null, signal = undefined, body = undefined } = {}) {
  const headers = { Authorization: `Bearer ${sessionStorage.getItem(TOKEN_KEY)}` };
  if (etag) headers["If-None-Match"] = etag;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  // cache: "no-store" so a 304 reaches us instead of being answered from the browser cache.
  const r = await fetch(path, { method, headers, signal, cache: "no-store", body: body && JSON.stringify(body) });
  if (r.status === 401) { signOut("Your token was refused; sign in again."); throw new Unauthorized(); }
  if (r.status === 304) return { notModified: true, etag };
  if (!r.ok) {
    let detail = r.statusText;
    try { const j = await r.json(); detail = typeof j.detail === "string" ? j.detail : JSON.stringify(j.detail ?? j); } catch (_) { /* not JSON */ }
    throw new Error(`${method} ${path}: ${r.status} ${detail}`);
  }
  return { data: await r.json(), etag: r.headers.get("ETag") };
}

// Server-sent events over fetch: EventSource cannot send the Authorization header, and a token in
// the URL would end up in logs. Calls onEvent(type, data); resolves when the stream ends.
async function streamEvents(path, onEvent, signal) {
  const r = await fetch(path, {
    headers: { Authorization: `Bearer ${sessionStorage.getItem(TOKEN_KEY)}`, Accept: "text/event-stream" },
    signal, cache: "no-store",
  });
  if (r.status === 401) { signOut("Your token was refused; sign in again."); throw new Unauthorized(); }
  if (!r.ok || !r.body) throw new Error(`events stream: ${r.status}`);
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let type = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) continue; // keep-alive comment
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const val = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") type = val;
        else if (field === "data") data.push(val);
      }
      if (data.length) onEvent(type, JSON.parse(data.join("\n")));
    }
  }
}

// ---- page lifecycle ------------------------------------------------------------------------------

// Everything a view starts (timers, streams, charts) is registered here and stopped on navigation.
let scope = { timers: [], aborts: [], charts: [], dead: false };

function newScope() {
  scope.dead = true;
  scope.timers.forEach(clearInterval);
  scope.aborts.forEach((a) => a.abort());
  scope.charts.forEach((c) => c.destroy());
  scope = { timers: [], aborts: [], charts: [], dead: false };
  return scope;
}

function every(ms, fn) {
  const s = scope;
  let busy = false;
  const tick = async () => {
    if (busy || s.dead) return;
    busy = true;
    try { await fn(); } catch (e) { if (!(e instanceof Unauthorized)) showLive(`update failed: ${e.message}`); } finally { busy = false; }
  };
  s.timers.push(setInterval(tick, ms));
  return tick;
}

function showLive(text) {
  const live = document.getElementById("live");
  live.hidden = !text;
  live.textContent = text || "";
}

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  newScope();
  document.getElementById("view").hidden = true;
  document.getElementById("nav").hidden = true;
  document.getElementById("signout").hidden = true;
  document.getElementById("signin-view").hidden = false;
  document.getElementById("signin-error").textContent = message || "";
  showLive("");
}

async function signIn(token) {
  sessionStorage.setItem(TOKEN_KEY, token);
  try {
    await api("/v1/jobs?limit=1");
  } catch (e) {
    if (!(e instanceof Unauthorized)) signOut(`Could not reach the API: ${e.message}`);
    return;
  }
  route();
}

function route() {
  if (!sessionStorage.getItem(TOKEN_KEY)) return signOut("");
  document.getElementById("signin-view").hidden = true;
  document.getElementById("nav").hidden = false;
  document.getElementById("signout").hidden = false;
  const view = document.getElementById("view");
  view.hidden = false;
  view.replaceChildren();
  newScope();
  showLive("");
  const hash = location.hash.replace(/^#/, "") || "/";
  const jobMatch = hash.match(/^\/jobs\/([A-Za-z0-9_-]+)$/);
  for (const a of document.querySelectorAll("[data-nav]")) {
    a.classList.toggle("active", (a.dataset.nav === "workers") === hash.startsWith("/workers") && !jobMatch);
  }
  if (jobMatch) return window.dptrainViews.jobDetail(view, jobMatch[1]);
  const sweepMatch = hash.match(/^\/sweeps\/([A-Za-z0-9_-]+)$/);
  if (sweepMatch) return window.dptrainViews.sweep(view, sweepMatch[1]);
  if (/^\/compare(\?|$)/.test(hash)) return window.dptrainViews.compare(view, new URLSearchParams(hash.split("?")[1] || ""));
  if (hash.startsWith("/workers")) return window.dptrainViews.workers(view);
  return window.dptrainViews.jobList(view, new URLSearchParams(hash.split("?")[1] || ""));
}

window.dptrain = { api, streamEvents, every, el, ago, duration, jobDuration, bytes, fmt, badge, progressBar,
  TERMINAL, STATUSES, LIST_POLL_MS, DETAIL_POLL_MS, WORKERS_POLL_MS, LOG_TAIL, MAX_CHART_POINTS,
  currentScope: () => scope, showLive, Unauthorized };
window.dptrainViews = {};

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("signin-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const input = document.getElementById("token");
    const token = input.value.trim();
    input.value = "";
    if (token) signIn(token);
  });
  document.getElementById("signout").addEventListener("click", () => signOut("Signed out."));
  window.addEventListener("hashchange", route);
  route();
});
