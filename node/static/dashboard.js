// The dashboard at GET / (node/static/dashboard.html): polls /dashboard and draws it with uPlot (shipped here).
"use strict";
const $ = id => document.getElementById(id);
const esc = s => String(s ?? "").replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
const short = id => id ? String(id).slice(-8) : "-";
const fmtBytes = n => n == null ? "-" : n >= 1e9 ? (n / 1e9).toFixed(2) + " GB" : n >= 1e6 ? (n / 1e6).toFixed(2) + " MB"
  : n >= 1e3 ? (n / 1e3).toFixed(1) + " kB" : Math.round(n) + " B";
const fmtNum = v => v == null ? "-" : Math.abs(v) >= 100 ? v.toFixed(1) : v.toPrecision(4);
// axis ticks: as many digits as the spacing between ticks needs (uPlot's default rounds 0.001 steps to "0")
function fmtTicks(vals) {
  const finite = vals.filter(v => v != null);
  const step = finite.length > 1 ? Math.abs(finite[1] - finite[0]) : Math.abs(finite[0] || 1);
  const digits = step > 0 ? Math.max(0, -Math.floor(Math.log10(step))) : 2;
  if (digits > 4) return vals.map(v => v == null ? "" : Math.abs(v) < step / 1e6 ? "0" : v.toExponential(1));
  return vals.map(v => v == null ? "" : (Math.abs(v) < 1e-12 ? 0 : v).toFixed(digits));
}
const ago = t => t ? Math.max(0, Date.now() / 1000 - t).toFixed(0) + " s ago" : "-";
function hue(id) { let h = 0; for (const c of String(id)) h = (h * 31 + c.charCodeAt(0)) >>> 0; return h % 360; }
const color = (id, me) => id === me ? "#1d4ed8" : `hsl(${hue(id)},55%,${id === me ? 40 : 55}%)`;

// ---------------------------------------------------------------- charts (uPlot, shipped with the node)
const charts = {};  // name -> {u, key, ids}
function chartWidth(el) { return Math.max(240, el.clientWidth || el.parentElement.clientWidth - 32); }
function draw(name, series, data, opts = {}) {
  // series: [{id, label, color, width}], data: [xs, ys...]; a new set of series makes a new chart
  const el = $("chart-" + name);
  if (!data[0].length) {
    if (charts[name]) { charts[name].u.destroy(); delete charts[name]; }
    el.innerHTML = '<p class="empty">' + esc(opts.empty || "nothing yet") + "</p>";
    return;
  }
  const key = series.map(s => s.id + "|" + s.label).join(",");
  const c = charts[name];
  if (c && c.key === key) { c.u.setData(data); return; }
  if (c) c.u.destroy();
  el.innerHTML = "";
  const u = new uPlot({
    width: chartWidth(el), height: 220,
    scales: {x: {time: !!opts.time}, y: {distr: opts.log ? 3 : 1}},
    axes: [{label: opts.xlabel || ""}, {label: opts.ylabel || "", size: 60,
      values: opts.bytes ? (u, vals) => vals.map(fmtBytes) : (u, vals) => fmtTicks(vals)}],
    legend: {live: true},
    series: [{label: opts.xlabel || "x"}, ...series.map(s => ({label: s.label, stroke: s.color, width: s.width || 1.5,
      spanGaps: true, points: {show: data[0].length < 40},
      value: opts.bytes ? (u, v) => v == null ? "-" : fmtBytes(v) : (u, v) => fmtNum(v)}))],
  }, data, el);
  charts[name] = {u, key, ids: series.map(s => s.id)};
}
new ResizeObserver(() => { for (const n in charts) charts[n].u.setSize({width: chartWidth($("chart-" + n)), height: 220}); })
  .observe(document.querySelector("main"));

// the points each chart draws, per series id (read by the browser test, and handy in the console)
function plotted(name) {
  const c = charts[name]; if (!c) return {};
  const out = {};
  c.ids.forEach((id, i) => { out[id] = c.u.data[0].map((x, k) => [x, c.u.data[i + 1][k]]).filter(p => p[1] != null); });
  return out;
}

function perPeer(progress, me, col) {
  // one series per peer: [x = step (col 1) or round (col 2), y = column col]; joined on x for uPlot
  const ids = Object.keys(progress).filter(id => progress[id].points.some(p => p[col] != null))
    .sort((a, b) => (a === me) - (b === me) || a.localeCompare(b));
  const xcol = col === 4 ? 2 : 1;
  const tables = ids.map(id => {
    const pts = progress[id].points.filter(p => p[col] != null);
    return [pts.map(p => p[xcol]), pts.map(p => p[col])];
  });
  const data = tables.length ? uPlot.join(tables) : [[]];
  return {data, series: ids.map(id => ({id, label: (id === me ? "this node " : "") + short(id), color: color(id, me),
    width: id === me ? 3 : 1.5}))};
}

// ---------------------------------------------------------------- panels
function renderLoops(d) {
  if (!d.loops.length) {
    $("loops").innerHTML = '<p class="empty">this node runs no training loop (add a [loops.&lt;name&gt;] table to its config, ' +
      "or try <code>swarmd demo</code>)</p>";
    return;
  }
  $("loops").innerHTML = d.loops.map(l => {
    const cls = l.state === "failed" || l.state === "refused" ? "bad" : l.state === "running" ? "ok" : "warn";
    const last = l.timeline.length ? l.timeline[l.timeline.length - 1] : null;
    return '<div class="loop"><b>' + esc(l.key) + '</b> <span class="' + cls + '">' + esc(l.state) + "</span> &middot; round " +
      esc(l.round) + (l.total_rounds ? " / " + esc(l.total_rounds) : "") + " &middot; step " + esc(l.step) +
      " &middot; task <code>" + esc(l.task) + "</code>" +
      (last ? " &middot; last round: " + last.participants + " peers, " + last.waited_s + " s of " + last.deadline_s + " s" : "") +
      (l.work || []).map(w => '<br><span class="warn">' + esc(w.what) + ": " + (w.percent == null ? "" : w.percent.toFixed(0) +
        "% of " + (w.unit === "B" ? fmtBytes(w.total) : w.total + " " + esc(w.unit)) + ", ") + w.elapsed_s.toFixed(0) +
        " s</span>").join("") +
      (l.error ? '<br><span class="bad">' + esc(l.error) + "</span>" : "") + "</div>";
  }).join("");
}

function renderTimeline(d) {
  const rows = [];
  for (const l of d.loops) for (const e of l.timeline) rows.push([l, e]);
  rows.sort((a, b) => b[1].closed_at - a[1].closed_at);
  if (!rows.length) { $("timeline").innerHTML = '<p class="empty">no round closed yet</p>'; return; }
  const ids = xs => xs.map(x => '<code title="' + esc(x) + '">' + esc(short(x)) + "</code>").join(" ");
  $("timeline").innerHTML = "<table><thead><tr><th>loop</th><th>round</th><th>closed</th><th>waited / deadline</th>" +
    "<th>took part</th><th>missing</th><th>late</th><th>rejected (why)</th><th>sent</th></tr></thead><tbody>" +
    rows.slice(0, 30).map(([l, e]) => "<tr><td>" + esc(l.service) + "</td><td>" + e.round +
      (e.fragment ? "/" + e.fragment : "") + "</td><td>" + new Date(e.closed_at * 1000).toLocaleTimeString() +
      "</td><td>" + e.waited_s.toFixed(2) + " s / " + e.deadline_s.toFixed(1) + " s</td><td>" + e.participants +
      '</td><td class="wrap ' + (e.missing ? "bad" : "") + '">' + (e.missing ? e.missing + ": " + ids(e.peers.missing) : "0") +
      '</td><td class="wrap ' + (e.late ? "warn" : "") + '">' + (e.late ? e.late + ": " + ids(e.peers.late) : "0") +
      '</td><td class="wrap ' + (e.rejected ? "bad" : "") + '">' + (e.rejected ? Object.entries(e.peers.rejected)
        .map(([p, why]) => ids([p]) + " " + esc(why)).join(", ") : "0") + "</td><td>" + fmtBytes(e.bytes_sent) +
      "</td></tr>").join("") + "</tbody></table>";
}

function renderPeers(d) {
  const peers = d.peers;
  $("npeers").textContent = d.connected + " connected, " + d.members + " members";
  if (!peers.length) { $("peers").innerHTML = '<p class="empty">no peers yet</p>'; return; }
  $("peers").innerHTML = "<table><thead><tr><th>peer</th><th>path</th><th>latency</th><th>penalty</th><th>last seen</th>" +
    "<th>version</th><th>loops</th></tr></thead><tbody>" + peers.map(p => "<tr><td><code title=\"" + esc(p.peer_id) + "\">" +
      esc(short(p.peer_id)) + "</code></td><td class=\"" + (p.connected ? "" : "bad") + "\">" +
      esc(p.connected ? p.path : "not connected") + (p.relay ? " via <code>" + esc(short(p.relay)) + "</code>" : "") +
      "</td><td>" + (p.latency_ms == null ? "-" : p.latency_ms.toFixed(2) + " ms") + "</td><td class=\"" +
      (p.penalty_score > 0 ? "warn" : "") + "\">" + esc(p.penalty_score) + "</td><td>" + ago(p.last_seen) + "</td><td>" +
      esc(p.version) + "</td><td>" + esc((p.loops || []).join(", ")) + "</td></tr>").join("") + "</tbody></table>";
}

function renderDoctor(d) {
  const r = d.doctor;
  $("doctor").innerHTML = "<p><span class=\"k\">reachability</span> <b>" + esc(r.reachability) + "</b> (" +
    esc(r.reachability_source) + ") &middot; <span class=\"k\">NAT</span> " + esc(r.nat) + "<br><span class=\"k\">paths</span> " +
    r.direct + " direct (" + r.punched + " hole-punched), " + r.relayed + " relayed, " + r.unconnected +
    " members not connected &middot; <span class=\"k\">hole punching</span> " + esc(r.punch) +
    (r.relays.length ? "<br><span class=\"k\">relays</span> " + r.relays.map(x => "<code>" + esc(x) + "</code>").join(" ") : "") +
    "</p>" + (r.hints.length ? '<ul class="hints">' + r.hints.map(h => '<li class="warn">' + esc(h) + "</li>").join("") + "</ul>"
      : '<p class="ok">no problems found</p>');
}

function render(d) {
  $("version").textContent = d.version; $("peer").textContent = d.peer_id; $("swarm").textContent = d.swarm;
  $("uptime").textContent = Math.round(d.uptime_s) + " s";
  renderLoops(d);
  const loss = perPeer(d.progress, d.peer_id, 3);
  draw("loss", loss.series, loss.data, {xlabel: "step", ylabel: "loss", empty: "no peer has reported progress yet"});
  const reward = perPeer(d.progress, d.peer_id, 4);
  $("reward-card").style.display = reward.series.length ? "" : "none";
  draw("reward", reward.series, reward.data, {xlabel: "round", ylabel: "reward"});
  const t = d.traffic, tseries = [], tdata = [t.t];
  for (const dir of ["in", "out"]) for (const proto of Object.keys(t[dir]).sort()) {
    if (!t[dir][proto].some(v => v > 0)) continue;
    const name = proto.replace(/^\/swarmd\//, "").replace(/\/[0-9.]+$/, "");
    tseries.push({id: proto + " " + dir, label: name + " " + dir, color: `hsl(${hue(proto)},60%,${dir === "in" ? 40 : 60}%)`});
    tdata.push(t[dir][proto]);
  }
  draw("traffic", tseries, tseries.length ? tdata : [[]], {time: true, ylabel: "B/s", bytes: true, empty: "no traffic yet"});
  const bseries = [], rounds = new Set();
  for (const l of d.loops) for (const e of l.timeline) rounds.add(e.round);
  const xs = [...rounds].sort((a, b) => a - b), bdata = [xs];
  for (const l of d.loops) {
    if (!l.timeline.length) continue;
    const by = {}; for (const e of l.timeline) by[e.round] = (by[e.round] || 0) + e.bytes_sent;
    bseries.push({id: l.key, label: l.key, color: `hsl(${hue(l.key)},60%,45%)`, width: 2});
    bdata.push(xs.map(x => by[x] ?? null));
  }
  draw("round-bytes", bseries, bseries.length ? bdata : [[]], {xlabel: "round", ylabel: "bytes", bytes: true,
    empty: "no round closed yet"});
  renderTimeline(d); renderPeers(d); renderDoctor(d);
}

// ---------------------------------------------------------------- polling
let last = null, lastOk = null, failures = 0, timer = null;
async function tick() {
  try {
    const r = await fetch("/dashboard", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    const d = await r.json();
    last = d; lastOk = Date.now(); failures = 0;
    document.body.classList.remove("down");
    $("state").dataset.state = "live"; $("state").textContent = "live";
    render(d);
  } catch (e) {
    failures += 1;
    if (failures >= 2 || last === null) {
      document.body.classList.add("down");
      $("state").dataset.state = "down"; $("state").textContent = "not answering";
      $("banner").textContent = "The node is not answering (" + (e.message || e) + ")" + (lastOk ? "; what you see is " +
        "its last answer, from " + new Date(lastOk).toLocaleTimeString() + "." : ".") + " Retrying every few seconds.";
    }
  }
  timer = setTimeout(tick, Math.max(2000, ((last && last.interval) || 2) * 1000));
}
window.swarmd = {get data() { return last; }, charts, plotted};
tick();
