"""The aggregator's live dashboard: one self-contained HTML page at `/dashboard` (no build step,
no external resource) that polls `/v1/status` and `/v1/history` every two seconds: per block its
version, round, deadline and participation; the run's reported loss (labelled as what it is,
not a validation CE) and live validation CE against rounds closed, bytes moved and refusals; the
workers.

The page holds no data, so it needs no token; the operator pastes one (kept in sessionStorage)
or opens `/dashboard#token=...` (a fragment never leaves the browser). A viewer token is enough."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from blocktrain.protocol.store.history import History, from_state
from blocktrain.protocol.store.ledger_schema import TokenRow

if TYPE_CHECKING:
    from blocktrain.protocol.service.aggregator_service import AggregatorService

POLL_MS = 2000


def history_json(hist: History) -> dict[str, Any]:
    """What `/v1/history` returns: the model's loss curve, each block's rounds and the
    validation CEs (`evals`: one labelled series each, a point per model evaluated, `rounds`
    the rounds every block had closed, `time_s` when that model was complete, if known)."""
    return {
        "loss_label": hist.loss_label,
        "x_label": hist.x_label,
        "evals": [
            {
                "label": label,
                "points": [
                    {"rounds": x, "ce": v, "time_s": hist.eval_time_s.get(x)} for x, v in pts
                ],
            }
            for label, pts in hist.evals.items()
        ],
        "curve": [
            {"rounds": c[0], "time_s": c[1], "bytes": c[2], "loss": c[3]}
            for c in hist.model_curve()
        ],
        "blocks": {
            str(b): [
                {
                    "round": p.round,
                    "rounds_closed": p.round + 1,
                    "participation": p.participation,
                    "loss": p.loss,
                }
                for p in pts
            ]
            for b, pts in sorted(hist.per_block().items())
        },
    }


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>blocktrain aggregator</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<style>
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em} h2{font-size:1.05em;margin-top:1.4em}
table{border-collapse:collapse} td,th{padding:.2em .7em;border-bottom:1px solid #ddd;text-align:right}
th:first-child,td:first-child{text-align:left}
#err{color:#b00} .muted{color:#777} svg{background:#fafafa;border:1px solid #ddd}
.done{color:#070}
</style></head><body>
<h1>blocktrain aggregator <span id="uptime" class="muted"></span>
<span id="done" class="done"></span></h1>
<form id="auth"><label>token <input id="token" type="password" size="50"></label>
<button>watch</button></form>
<p id="err" role="alert"></p>
<h2>Blocks</h2>
<table id="blocks"><thead><tr><th>block</th><th>version</th><th>round</th><th>deadline in</th>
<th>live replicas</th><th>reported</th><th>participation (last rounds)</th></tr></thead>
<tbody></tbody></table>
<h2>Loss per round</h2>
<p class="muted" id="losslabel"></p>
<svg id="curve" width="640" height="220" role="img" aria-label="loss curve"></svg>
<h2>Validation CE per round</h2>
<p class="muted" id="evalnote">the assembled model after r rounds sits at r (0: the initial
model), on the loss plot's axis</p>
<ul id="evallabels" class="muted"></ul>
<svg id="evals" width="640" height="220" role="img" aria-label="validation CE"></svg>
<h2>Updates and bytes</h2>
<p>accepted <b id="accepted">-</b>, refused <b id="refused">-</b>;
bytes moved <b id="bytes">-</b>; codecs <span id="codecs">-</span></p>
<table id="reasons"><thead><tr><th>refusal reason</th><th>count</th></tr></thead><tbody></tbody></table>
<h2>Workers</h2>
<table id="workers"><thead><tr><th>worker</th><th>block</th><th>live</th><th>last seen</th>
<th>accepted</th><th>refused</th><th>name</th></tr></thead><tbody></tbody></table>
<script>
"use strict";
const POLL_MS = __POLL_MS__;
const $ = (id) => document.getElementById(id);
const fromUrl = new URLSearchParams(location.hash.slice(1)).get("token");
if (fromUrl) {  // /dashboard#token=...: kept for the tab, then out of the address bar
  sessionStorage.setItem("blocktrain-token", fromUrl);
  history.replaceState(null, "", location.pathname + location.search);
}
let token = sessionStorage.getItem("blocktrain-token") || "";
$("token").value = token;
$("auth").addEventListener("submit", (e) => {
  e.preventDefault(); token = $("token").value.trim();
  sessionStorage.setItem("blocktrain-token", token); poll();
});
function cell(text) { const td = document.createElement("td"); td.textContent = text; return td; }
function rows(id, data) {
  const body = $(id).querySelector("tbody"); body.replaceChildren();
  for (const r of data) { const tr = document.createElement("tr");
    for (const v of r) tr.appendChild(cell(v)); body.appendChild(tr); }
}
function mb(n) { return (n / 1e6).toFixed(2) + " MB"; }
function pct(x) { return Math.round(100 * x) + "%"; }
function liveness(w) {
  if (w.state === "left") return "left " + w.left_s.toFixed(0) + " s ago";
  if (w.state === "timed_out") return "timed out";
  return w.live ? "yes" : "no";
}
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"];
// lines: [{points: [[x, y], ...], color}]; [x0, x1]: the x range, shared by both plots
function plot(id, lines, x0, x1) {
  const svg = $(id); svg.replaceChildren();
  const ys = lines.flatMap(l => l.points.map(p => p[1]));
  if (ys.length === 0) return;
  const W = 640, H = 220, P = 30;
  const y0 = Math.min(...ys), y1 = Math.max(...ys, y0 + 1e-6);
  const sx = x => P + (W - 2 * P) * (x - x0) / (x1 - x0);
  const sy = y => H - P - (H - 2 * P) * (y - y0) / (y1 - y0);
  const ns = "http://www.w3.org/2000/svg";
  for (const l of lines) {
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", l.points.map(p => sx(p[0]) + "," + sy(p[1])).join(" "));
    line.setAttribute("fill", "none"); line.setAttribute("stroke", l.color);
    line.setAttribute("stroke-width", "2"); svg.appendChild(line);
    for (const p of l.points.length === 1 ? l.points : []) {  // one point: a dot
      const c = document.createElementNS(ns, "circle"); c.setAttribute("cx", sx(p[0]));
      c.setAttribute("cy", sy(p[1])); c.setAttribute("r", "3"); c.setAttribute("fill", l.color);
      svg.appendChild(c);
    }
  }
  const labels = [[2, sy(y0), y0.toFixed(3)], [2, sy(y1), y1.toFixed(3)],
    [P, H - 8, x0 + " closed"], [W - P - 50, H - 8, x1 + " closed"]];
  for (const [x, y, text] of labels) {
    const t = document.createElementNS(ns, "text"); t.setAttribute("x", x);
    t.setAttribute("y", y); t.setAttribute("font-size", "11"); t.textContent = text;
    svg.appendChild(t);
  }
  const last = lines[0].points;
  if (last.length) svg.dataset.last = last[last.length - 1][1].toFixed(4);
}
function curves(h, evalEvery) {
  const loss = h.curve.map(p => [p.rounds, p.loss]);
  const evals = h.evals.map((e, i) => ({label: e.label, color: COLORS[i % COLORS.length],
    points: e.points.map(p => [p.rounds, p.ce])}));
  const xs = loss.map(p => p[0]).concat(...evals.map(e => e.points.map(p => p[0])));
  const x0 = xs.length ? Math.min(...xs) : 0, x1 = Math.max(...xs, x0 + 1);
  plot("curve", [{points: loss, color: COLORS[0]}], x0, x1);
  plot("evals", evals, x0, x1);
  const items = $("evallabels"); items.replaceChildren();
  for (const e of evals) {
    const li = document.createElement("li"); li.style.color = e.color;
    const last = e.points[e.points.length - 1];
    li.textContent = e.label + (last ? ": " + last[1].toFixed(4) + " after " + last[0] +
      (last[0] === 1 ? " round" : " rounds") : "");
    items.appendChild(li);
  }
  if (evals.length === 0) {
    const li = document.createElement("li");
    li.textContent = evalEvery > 0 ? "no evaluation recorded yet (every " + evalEvery +
      " rounds)" : "this aggregator runs no live evaluation (--set live_eval_every=0)";
    items.appendChild(li);
  }
}
async function get(path) {
  const r = await fetch(path, {headers: {"Authorization": "Bearer " + token}});
  const body = await r.json();
  if (!r.ok) throw new Error(path + ": " + (body.detail || body.reason || r.status));
  return body;
}
async function poll() {
  if (!token) { $("err").textContent = "paste a token to watch this aggregator"; return; }
  try {
    const [s, h] = await Promise.all([get("/v1/status?rounds=10"), get("/v1/history")]);
    $("err").textContent = "";
    $("uptime").textContent = "up " + Math.round(s.uptime_s) + " s";
    const n = s.settings.max_rounds;
    $("done").textContent = s.done ?
      "done: every block finished its " + n + (n === 1 ? " round" : " rounds") : "";
    rows("blocks", s.blocks.map(b => [b.block, b.version, b.done ? b.round + " (done)" : b.round,
      b.deadline_in === null ? "-" : b.deadline_in.toFixed(1) + " s", b.live_replicas,
      b.reported.length + "/" + b.expected.length,
      (s.participation[String(b.block)] || []).map(r => pct(r.participation)).join(" ")]));
    $("accepted").textContent = s.updates.accepted;
    $("refused").textContent = s.updates.refused;
    $("bytes").textContent = mb(s.bytes.total);
    $("codecs").textContent = s.codecs;
    rows("reasons", Object.entries(s.updates.refused_by_reason).sort((a, b) => b[1] - a[1]));
    rows("workers", s.workers.list.map(w => [w.worker_id, w.block, liveness(w),
      w.last_seen_s.toFixed(0) + " s ago", w.accepted, w.refused, w.name || "-"]));
    $("losslabel").textContent = h.loss_label;
    curves(h, s.settings.live_eval_every);
  } catch (e) { $("err").textContent = String(e.message || e); }
}
poll(); setInterval(poll, POLL_MS);
</script></body></html>
"""


def page() -> str:
    return PAGE.replace("__POLL_MS__", str(POLL_MS))


def add_routes(
    app: FastAPI,
    service: AggregatorService,
    token: Callable[[str], Any],
    respond: Callable[[Request, Any], JSONResponse],
    refusals: dict[int | str, dict[str, Any]],
) -> None:
    """`/dashboard` (the page) and `/v1/history` (its data, behind `token(endpoint)`, the app's
    authentication dependency; `respond` is the app's JSON response with byte accounting)."""
    cache: dict[str, Any] = {}
    authenticated = token("history")  # a default, not in Annotated: this module's annotations
    # are strings, and FastAPI resolves them in the module's globals, where `token` is unknown

    @app.get(
        "/v1/history",
        responses=refusals,
        summary="The loss curve, rounds per block, validation CEs",
    )
    def history(request: Request, _: TokenRow = authenticated) -> JSONResponse:
        # the history changes only when a round closes or an evaluation is recorded: read
        # the ledger (and evals.jsonl) again only then
        evals = service.evaluations
        key = (
            tuple(st.rounds.round for st in service.blocks.values()),
            None if evals is None else evals.recorded,
        )
        if cache.get("key") != key:
            cache["body"] = history_json(from_state(service.storage))
            cache["key"] = key
        return respond(request, cache["body"])

    @app.get("/dashboard", response_class=HTMLResponse, summary="Live dashboard (HTML)")
    def dashboard() -> HTMLResponse:
        return HTMLResponse(page())
