// Flywheel's dashboard: a hash-routed page per view, fed by /ui/api/* (and /admin/* for adapter
// actions, with the admin key). No build step: plain DOM, uPlot for the charts. Every value from
// the database goes into the page as text (h() below), never as HTML.
"use strict";

const KEY = "flywheel-key";
const main = document.getElementById("main");
let who = null;

// ---- helpers -------------------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "style") el.style.cssText = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

class HttpError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, options = {}) {
  const key = sessionStorage.getItem(KEY);
  const headers = Object.assign({}, options.headers || {});
  if (key) headers.Authorization = `Bearer ${key}`;
  const response = await fetch(path, Object.assign({}, options, { headers }));
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    const message = (body.error && body.error.message) || response.statusText;
    throw new HttpError(response.status, message);
  }
  return body;
}

function fmt(x, digits = 3) {
  if (x === null || x === undefined) return "—";
  if (typeof x === "number") return Number.isInteger(x) ? x.toLocaleString() : x.toFixed(digits);
  return String(x);
}

function ago(iso) {
  if (!iso) return "—";
  const s = (Date.now() - Date.parse(iso)) / 1000;
  if (s < 90) return `${Math.round(s)} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  if (s < 172800) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

function when(iso) { return iso ? new Date(iso).toLocaleString() : "—"; }

function query() {
  const q = location.hash.split("?")[1] || "";
  return Object.fromEntries(new URLSearchParams(q));
}

function withQuery(base, params) {
  const q = new URLSearchParams(Object.entries(params).filter(([, v]) => v !== "" && v != null));
  const s = q.toString();
  return s ? `${base}?${s}` : base;
}

function card(label, value, sub) {
  return h("div", { class: "card" },
    h("div", { class: "label" }, label), h("div", { class: "value" }, value),
    sub ? h("div", { class: "sub" }, sub) : null);
}

function table(columns, rows, rowAttrs, attrs) {
  return h("table", attrs || {},
    h("thead", {}, h("tr", {}, columns.map(c => h("th", { class: c.num ? "num" : null }, c.label)))),
    h("tbody", {}, rows.length ? rows.map(r => h("tr", rowAttrs ? rowAttrs(r) : {},
      columns.map(c => h("td", { class: c.num ? "num" : null }, c.cell(r)))))
      : h("tr", {}, h("td", { colspan: columns.length, class: "muted" }, "nothing yet"))));
}

function showError(e) {
  if (e instanceof HttpError && (e.status === 401 || e.status === 403)) {
    return h("div", { class: "notice" }, e.message,
      " — enter a key in the box at the top right (an API key with the read scope shows your ",
      "tenant's episodes; the admin key shows every tenant's and can change adapters).");
  }
  return h("div", { class: "error" }, e.message || String(e));
}

function chart(title, seriesLabels, data, opts = {}) {
  const el = h("div", { class: "panel chart" }, h("h2", {}, title));
  const width = Math.max(320, Math.min(640, (main.clientWidth || 1200) / 2 - 60));
  const colors = ["#3057d5", "#c23b31", "#1b8a4b", "#b7791f", "#7b3fc4", "#0f8a96"];
  const series = [{ label: opts.xLabel || "time", value: opts.xValue }];
  seriesLabels.forEach((label, i) => series.push({
    label, stroke: colors[i % colors.length], width: 2, spanGaps: !!opts.spanGaps,
    points: { show: opts.points !== undefined ? opts.points : true, size: 5 },
    value: (u, v) => fmt(v),
  }));
  const axes = [opts.xAxis || {}, { label: opts.yLabel || "", size: 55 }];
  const scales = { x: { time: opts.time !== false } };
  if (data[0].length === 0) {
    el.append(h("p", { class: "muted" }, "no data in this window"));
  } else {
    new uPlot({ width, height: 220, series, axes, scales }, data, el);
  }
  return el;
}

// ---- pages ---------------------------------------------------------------------------------

async function overview() {
  const q = query();
  const hours = q.hours || "6";
  const data = await api(withQuery("/ui/api/overview", { hours, agent: q.agent, task: q.task }));
  const choose = (name, options, current) => h("label", {}, name,
    h("select", { onchange: (e) => { location.hash = withQuery("#/", Object.assign(query(), { [name]: e.target.value })); } },
      options.map(([value, label]) => h("option", { value, selected: value === current }, label))));
  const filters = h("div", { class: "filters" },
    choose("hours", [["1", "last hour"], ["6", "last 6 hours"], ["24", "last 24 hours"], ["168", "last 7 days"]], hours),
    choose("agent", [["", "every agent"], ...data.agents.map(a => [a.agent || "", `${a.agent || "(no agent)"} · ${fmt(a.calls)} calls`])], q.agent || ""),
    choose("task", [["", "every task"], ...data.tasks.slice(0, 100).map(t => [t.task || "", `${t.task || "(no task)"} · ${fmt(t.calls)} calls`])], q.task || ""));

  const calls = data.calls.reduce((s, b) => s + b.calls, 0);
  const failed = data.calls.reduce((s, b) => s + b.failed, 0);
  const lastRate = data.calls.length ? data.calls[data.calls.length - 1].calls / data.bucket_s : 0;
  const episodes = data.rewards.reduce((s, b) => s + b.episodes, 0);
  const rewarded = data.rewards.reduce((s, b) => s + b.rewarded, 0);
  const lineages = data.lineages.length ? data.lineages
    : [{ lineage: "policy", version: 0, name: null, since: null }];
  const open = Object.fromEntries(data.canaries.filter(c => !c.decided_at).map(c => [c.lineage, c]));
  const cards = h("div", { class: "cards" },
    lineages.map(l => card(`current · ${l.lineage}`, l.version ? `v${l.version}` : "base model",
      l.pinned ? `pinned ${ago(l.pinned.since)}${l.pinned.note ? `: ${l.pinned.note}` : ""}`
        : open[l.lineage] ? (open[l.lineage].fraction
          ? `canary: v${open[l.lineage].candidate} on ${Math.round(open[l.lineage].fraction * 100)}% of episodes`
          : `held: v${open[l.lineage].candidate}, served to no one until the gate decides`)
          : l.since ? `since ${ago(l.since)}` : "no adapter yet")),
    card("calls", fmt(calls), `${fmt(lastRate, 2)}/s in the last ${data.bucket_s} s · ${fmt(failed)} failed`),
    card("episodes", fmt(episodes), `${fmt(rewarded)} rewarded`),
    card("training data", data.training.ratio == null ? "—" : `${fmt(data.training.ratio * 100, 0)}%`,
      `of the calls decided: ${fmt(data.training.trained)} trained`),
    (data.queue.length ? data.queue : [{ lineage: "policy", trainable: 0 }]).map(qr => card(
      `trainer queue · ${qr.lineage}`, fmt(qr.trainable),
      qr.trainable ? `credited, untrained; oldest from v${qr.oldest_version}, credited ${ago(qr.oldest_credited_at)}` : "credited, untrained")),
    data.demonstrations.map(d => card(
      `demonstrations · ${d.lineage}`, fmt(d.total),
      `${fmt(d.trained)} trained (up to ${fmt(d.epochs)} epochs) · ${fmt(d.waiting)} never yet · ${fmt(d.set_aside)} set aside · newest ${ago(d.newest)}`)),
    card("recording (this replica)", data.writer.database_up ? "up" : "Postgres down",
      data.writer.queued == null ? "" // its backlog (every tenant's) is the operator's to see
        : `${fmt(data.writer.queued)} queued · ${fmt(data.writer.journaled)} journaled`));

  const t = data.rewards.map(b => Date.parse(b.at) / 1000);
  const rewardChart = chart("Mean episode reward over time", ["mean reward"],
    [t, data.rewards.map(b => b.mean)], { yLabel: "reward", spanGaps: true });
  const ct = data.calls.map(b => Date.parse(b.at) / 1000);
  const callChart = chart("Calls per second", ["calls/s", "failed/s"],
    [ct, data.calls.map(b => b.calls / data.bucket_s), data.calls.map(b => b.failed / data.bucket_s)],
    { yLabel: "per second", points: false });

  // Reward per version: one series per lineage over the versions it served.
  const versionIds = [...new Set(data.versions.map(v => v.version))].sort((a, b) => a - b);
  const lineageNames = [...new Set(data.versions.map(v => v.lineage || "policy"))];
  const byKey = Object.fromEntries(data.versions.map(v => [`${v.lineage || "policy"}|${v.version}`, v.mean]));
  const versionChart = chart("Mean episode reward per policy version", lineageNames,
    [versionIds, ...lineageNames.map(l => versionIds.map(v => byKey[`${l}|${v}`] ?? null))],
    { time: false, xLabel: "version", xValue: (u, v) => (v == null ? "" : `v${v}`), spanGaps: true,
      xAxis: { label: "policy version", values: (u, vals) => vals.map(v => (Number.isInteger(v) ? `v${v}` : "")) },
      yLabel: "reward" });

  const versions = table([
    { label: "lineage", cell: v => v.lineage || "policy" },
    { label: "version", cell: v => (v.version ? `v${v.version}` : "base model") },
    { label: "episodes", num: true, cell: v => fmt(v.episodes) },
    { label: "rewarded", num: true, cell: v => fmt(v.rewarded) },
    { label: "mean reward", num: true, cell: v => fmt(v.mean) },
    { label: "sd", num: true, cell: v => fmt(v.sd) },
    { label: "", cell: v => h("a", { href: withQuery("#/episodes", { version: v.version }) }, "episodes") },
  ], data.versions, null, { id: "versions" });
  const tr = data.training;
  const decided = tr.calls - tr.awaiting_reward - tr.queued;
  const training = h("div", { class: "panel", id: "training" },
    h("h2", {}, "Training data (calls in this window)"),
    h("p", {}, tr.ratio == null ? "no call decided yet"
      : `${fmt(tr.trained)} of ${fmt(decided)} decided calls became training data (${fmt(tr.ratio * 100, 0)}%)`,
      ` · ${fmt(tr.awaiting_reward)} wait for a reward · ${fmt(tr.queued)} for a trainer`),
    table([
      { label: "not trained", cell: r => r.meaning },
      { label: "calls", num: true, cell: r => fmt(r.calls) },
      { label: "what to change", cell: r => r.fix },
    ], tr.not_trained));
  const canaries = canaryTable(data.canaries);
  return [h("h1", {}, "Overview"), filters, cards,
    h("div", { class: "grid2", style: "margin-top:12px" }, rewardChart, callChart),
    h("div", { class: "grid2", style: "margin-top:12px" }, versionChart,
      training),
    h("h2", {}, "Reward per version (episodes that version served)"), versions,
    h("h2", {}, "Canary decisions"), canaries];
}

function canaryTable(rows) {
  return table([
    { label: "lineage", cell: c => c.lineage },
    { label: "candidate", cell: c => `v${c.candidate}` },
    { label: "against", cell: c => (c.baseline ? `v${c.baseline}` : "base model") },
    { label: "opened", cell: c => ago(c.opened_at) },
    { label: "decision", cell: c => (c.action
      ? h("span", { class: `pill ${c.action === "promote" ? "good" : c.action === "rollback" ? "bad" : ""}` }, c.action)
      : h("span", { class: "pill warn" }, c.fraction ? `open · ${Math.round(c.fraction * 100)}%` : "held by the gate")) },
    { label: "episodes (cand. / base)", num: true, cell: c => (c.evidence ? `${fmt(c.evidence.candidate_episodes)} / ${fmt(c.evidence.baseline_episodes)}` : "—") },
    { label: "mean (cand. / base)", num: true, cell: c => (c.evidence ? `${fmt(c.evidence.candidate_mean)} / ${fmt(c.evidence.baseline_mean)}` : "—") },
    { label: "why", cell: c => c.reason || "" },
  ], rows, null, { class: "canaries" });
}

async function episodes() {
  const q = query();
  const cursors = (q.trail || "").split(",").filter(Boolean);
  const page = await api(withQuery("/ui/api/episodes", {
    q: q.q, task: q.task, agent: q.agent, version: q.version, min_reward: q.min_reward,
    max_reward: q.max_reward, limit: 50, after: cursors[cursors.length - 1],
  }));
  const field = (name, label, attrs = {}) => h("label", {}, label,
    h("input", Object.assign({ name, value: q[name] || "", size: 14 }, attrs)));
  const form = h("form", { class: "filters", onsubmit: (e) => {
    e.preventDefault();
    const values = Object.fromEntries(new FormData(e.target));
    location.hash = withQuery("#/episodes", values);
  } },
  field("q", "episode id (or its start)", { size: 22 }), field("task", "task"), field("agent", "agent"),
  field("version", "policy version", { size: 6, inputmode: "numeric" }),
  field("min_reward", "reward ≥", { size: 6 }), field("max_reward", "reward ≤", { size: 6 }),
  h("button", { type: "submit", class: "primary" }, "Search"),
  h("a", { href: "#/episodes" }, "clear"));
  const rows = table([
    { label: "episode", cell: e => h("a", { href: `#/episode/${encodeURIComponent(e.id)}` }, e.id) },
    { label: "task", cell: e => e.task_id || "—" },
    { label: "agents", cell: e => e.agents.join(", ") || "—" },
    { label: "versions", cell: e => e.versions.map(v => (v ? `v${v}` : "base")).join(", ") || "—" },
    { label: "calls", num: true, cell: e => (e.failed ? h("span", {}, fmt(e.calls), " ", h("span", { class: "pill bad" }, `${e.failed} failed`)) : fmt(e.calls)) },
    { label: "tokens out", num: true, cell: e => fmt(e.completion_tokens) },
    { label: "reward", num: true, cell: e => fmt(e.final_reward) },
    { label: "started", cell: e => when(e.created_at) },
  ], page.data, null, { id: "episodes" });
  const go = (trail) => withQuery("#/episodes", Object.assign(query(), { trail: trail.join(",") }));
  const pager = h("div", { class: "pager" },
    h("button", { disabled: !cursors.length, onclick: () => { location.hash = go(cursors.slice(0, -1)); } }, "← Newer"),
    h("span", { class: "muted" }, `page ${cursors.length + 1}`),
    h("button", { disabled: !page.next, onclick: () => { location.hash = go([...cursors, page.next]); } }, "Older →"));
  return [h("h1", {}, "Episodes"), form, rows, pager];
}

function logprobColor(lp) {
  if (lp === null || lp === undefined) return "transparent";
  const p = Math.exp(lp); // 1: green, 0.5: yellow, 0: red
  const hue = Math.round(120 * p);
  return `hsl(${hue}, 75%, 82%)`;
}

async function showTokens(transition, target, button) {
  button.disabled = true;
  try {
    const data = await api(`/ui/api/transitions/${transition.id}/tokens`);
    const spans = data.tokens.map(t => h("span", {
      style: `background:${logprobColor(t.logprob)}`,
      title: `id ${t.id} · logprob ${fmt(t.logprob, 4)} · p ${t.logprob == null ? "—" : fmt(Math.exp(t.logprob), 3)}`,
    }, t.text === null ? `[${t.id}]` : t.text));
    const scale = h("span", { class: "legend-scale" },
      [0.05, 0.25, 0.5, 0.75, 0.95].map(p => h("span", { style: `background:${logprobColor(Math.log(p))}`, title: `p ${p}` })));
    target.replaceChildren(...[
      h("div", { class: "muted" }, `${data.tokens.length} of ${data.total} completion tokens, coloured by the behaviour policy's probability (red: unlikely, green: likely; hover for the logprob)`, scale),
      data.note ? h("div", { class: "notice" }, data.note) : null,
      h("div", { class: "tokens" }, spans)].filter(Boolean));
  } catch (e) {
    target.replaceChildren(showError(e));
    button.disabled = false;
  }
}

function messageText(m) {
  if (m === null || m === undefined) return "";
  if (typeof m === "string") return m;
  if (typeof m.content === "string") return m.content;
  if (Array.isArray(m.content)) return m.content.map(p => (typeof p === "string" ? p : p.text ?? JSON.stringify(p))).join("");
  return JSON.stringify(m, null, 1);
}

async function episode(id) {
  const ep = await api(`/ui/api/episodes/${encodeURIComponent(id)}`);
  const stepRewards = {};
  for (const r of ep.rewards) if (r.transition_id) (stepRewards[r.transition_id] ||= []).push(r);
  const head = h("div", { class: "cards" },
    card("final reward", fmt(ep.final_reward), ep.final_reward === null ? "not rewarded yet" : null),
    card("task", ep.task_id || "—"),
    card("calls", fmt(ep.transitions.length)),
    card("started", when(ep.created_at)));
  const rewards = table([
    { label: "reward", num: true, cell: r => fmt(r.reward) },
    { label: "kind", cell: r => (r.transition_id || r.pending ? "step" : "final") },
    { label: "source", cell: r => r.source || "client" },
    { label: "call", cell: r => (r.transition_id ? `#${ep.transitions.findIndex(t => t.id === r.transition_id) + 1}` : r.pending ? "pending" : "—") },
    { label: "posted", cell: r => when(r.created_at) },
  ], ep.rewards);
  const calls = ep.transitions.map((t, i) => {
    const tokens = h("div", {});
    const button = h("button", { onclick: () => showTokens(t, tokens, button) }, "Show tokens by logprob");
    const messages = (t.messages || []).map(m => h("div", { class: "msg" },
      h("span", { class: "role" }, (m && m.role) || (m && m.type) || "prompt"), messageText(m),
      m && m.tool_calls ? h("pre", {}, JSON.stringify(m.tool_calls, null, 1)) : null));
    const own = stepRewards[t.id] || [];
    return h("div", { class: "transition" },
      h("div", { class: "head" },
        h("strong", {}, `#${i + 1}`),
        h("span", { class: `pill ${t.status === "ok" ? "good" : "bad"}` }, t.status),
        h("span", {}, `agent ${t.agent_name || "—"}`),
        h("span", {}, t.policy_version === null ? `model ${t.model_used || t.model_requested}` : `${t.lineage || "policy"} v${t.policy_version}`),
        h("span", { class: "muted" }, `${t.route} · ${fmt(t.latency_ms, 0)} ms · ${fmt(t.usage.prompt_tokens)} → ${fmt(t.usage.completion_tokens)} tokens`),
        h("span", {}, `return ${fmt(t.return)}`),
        own.length ? h("span", {}, `step rewards ${own.map(r => `${fmt(r.reward)} (${r.source || "client"})`).join(", ")}`) : null,
        t.trained_version ? h("span", { class: "pill" }, `trained into v${t.trained_version}`) : null),
      h("div", { class: "body" },
        h("details", {}, h("summary", {}, `prompt: ${messages.length} messages`), messages),
        h("div", { class: "msg completion" }, h("span", { class: "role" }, `completion · ${t.finish_reason || ""}`),
          t.text || (t.tool_calls ? "" : "(no text)"),
          t.tool_calls ? h("pre", {}, JSON.stringify(t.tool_calls, null, 1)) : null,
          t.tool_errors ? h("div", { class: "error" }, JSON.stringify(t.tool_errors)) : null,
          t.error ? h("div", { class: "error" }, JSON.stringify(t.error)) : null),
        t.usage.completion_tokens ? button : null, tokens));
  });
  return [h("p", {}, h("a", { href: "#/episodes" }, "← episodes")), h("h1", {}, `Episode ${ep.id}`), head,
    h("h2", {}, "Rewards"), rewards, h("h2", {}, "Calls"), calls];
}

async function adapters() {
  if (who && !who.admin) {
    return [h("h1", {}, "Adapters"), h("div", { class: "notice" },
      !who.admin_enabled
        ? "Admin endpoints are off on this proxy: set FLYWHEEL_ADMIN_KEY to list and activate adapters here."
        : sessionStorage.getItem(KEY)
          ? "The key in use is not the admin key (FLYWHEEL_ADMIN_KEY): the adapter pages need it."
          : "The adapter pages need the admin key (FLYWHEEL_ADMIN_KEY): enter it at the top right.")];
  }
  const [list, canaries, served, lines] = await Promise.all([
    api("/admin/adapters"), api("/admin/canaries?limit=50"), api("/ui/api/versions?hours=720"),
    api("/admin/lineages")]);
  const pins = Object.fromEntries(lines.data.filter(l => l.pinned).map(l => [l.lineage, l.pinned]));
  const reward = Object.fromEntries(served.data.map(v => [`${v.lineage || "policy"}|${v.version}`, v]));
  const byLineage = {};
  for (const a of list.data) (byLineage[a.lineage] ||= []).push(a);
  if (!Object.keys(byLineage).length) byLineage.policy = [];
  const openCandidates = new Set(canaries.data.filter(c => !c.decided_at).map(c => c.candidate));
  const status = h("div", {});
  const label = version => (version ? `v${version}` : "the base model");
  const post = async (doing, path) => {
    status.replaceChildren(h("div", { class: "notice" }, doing));
    try {
      await api(path, { method: "POST" });
      await render();
    } catch (e) {
      status.replaceChildren(showError(e));
    }
  };
  const activate = (lineage, version) => {
    if (!confirm(`Serve ${label(version)} as the current ${lineage} policy on every replica?`)) return;
    post(`activating ${label(version)}…`, withQuery(`/admin/adapters/${version}/activate`, { lineage }));
  };
  const pin = (lineage, version) => {
    const note = prompt(`Pin ${lineage} at ${label(version)}: it serves that version and the trainer publishes nothing to it until it is unpinned. Why? (optional, shown with the pin)`, "");
    if (note === null) return;
    post(`pinning ${label(version)}…`, withQuery(`/admin/adapters/${version}/pin`, { lineage, note: note || undefined }));
  };
  const unpin = lineage => post(`unpinning ${lineage}…`, `/admin/lineages/${encodeURIComponent(lineage)}/unpin`);
  const sections = Object.entries(byLineage).sort().map(([lineage, rows]) => {
    const anyCurrent = rows.some(a => a.is_current);
    const base = reward[`${lineage}|0`];
    const all = [...rows.slice().reverse(), { version: 0, lineage, is_current: !anyCurrent, base: true }];
    const held = pins[lineage];
    const heading = h("h2", {}, `Lineage ${lineage}`, " ",
      held ? [h("span", { class: "pill warn" }, `pinned at ${label(held.version)} ${ago(held.since)}`),
        held.note ? h("span", { class: "muted" }, ` ${held.note} `) : " ",
        h("button", { class: "unpin", onclick: () => unpin(lineage) }, "Unpin")] : null);
    return [heading, table([
      { label: "version", cell: a => [a.base ? "base model" : `v${a.version}`, " ",
        a.is_current ? h("span", { class: "pill good" }, "current") : null,
        openCandidates.has(a.version) ? h("span", { class: "pill warn" }, "canary") : null,
        a.retired_at ? h("span", { class: "pill" }, "retired") : null] },
      { label: "created", cell: a => (a.base ? "—" : when(a.created_at)) },
      { label: "parent", cell: a => (a.stats && a.stats.parent ? `v${a.stats.parent}` : a.base ? "" : "base") },
      { label: "step", cell: a => (a.base ? "" : a.stats && a.stats.kind === "sft" ? "supervised" : "GRPO") },
      { label: "trained on", num: true, cell: a => (a.base ? "" : a.stats && a.stats.kind === "sft"
        ? `${fmt(a.stats.demonstrations)} demos` : fmt(a.trained_transitions)) },
      { label: "batch reward", num: true, cell: a => fmt(a.stats && a.stats.reward_mean) },
      { label: "loss", num: true, cell: a => fmt(a.stats && a.stats.loss, 4) },
      { label: "train / swap", num: true, cell: a => (a.stats && a.stats.train_s != null ? `${fmt(a.stats.train_s, 1)} s / ${fmt(a.stats.swap_s * 1000, 0)} ms` : "") },
      { label: "before serving", cell: a => beforeServing(a.stats) },
      { label: "reward in service", num: true, cell: a => { const r = a.base ? base : reward[`${lineage}|${a.version}`]; return r ? `${fmt(r.mean)} (${fmt(r.rewarded)} ep.)` : "—"; } },
      { label: "", cell: a => (a.retired_at ? "" : [
        a.is_current || held ? null : h("button", { onclick: () => activate(lineage, a.version) },
          a.base ? "Roll back to base" : openCandidates.has(a.version) ? "Promote now" : "Activate"),
        held && held.version === a.version ? null : h("button", { class: "pin", onclick: () => pin(lineage, a.version) }, "Pin")]) },
    ], all, a => ({ class: a.is_current ? "current" : a.retired_at ? "retired" : null }), { class: "adapters" })];
  });
  return [h("h1", {}, "Adapters"), h("p", { class: "muted" },
    "Activating a version loads it into every vLLM replica and then moves the lineage's alias (POST /admin/adapters/N/activate, as `flywheel adapters activate`). Pinning does the same and holds the lineage there: the trainer publishes nothing to it and no canary opens until it is unpinned. Reward in service: the last 30 days' episodes that version served."),
  status, sections, h("h2", {}, "Canaries"), canaryTable(canaries.data)];
}

// What a version was judged on before it served (issue 42): the promotion gate's verdict (its
// reason on hover), its eval-set scores against the current version's, its off-policy estimate.
function beforeServing(stats) {
  if (!stats) return "";
  const gate = stats.gate;
  const pill = gate ? h("span", {
    class: `pill ${gate.outcome === "pass" ? "good" : gate.outcome === "fail" ? "bad" : "warn"}`,
    title: gate.reason }, `gate ${gate.outcome}`) : null;
  const scores = Object.entries(stats.evals || {}).sort().map(([name, e]) =>
    h("div", { class: "eval" }, `${name} ${fmt(e.score)} vs ${fmt(e.current)}`));
  const ope = stats.ope;
  const estimate = !ope ? null : ope.refused ? h("div", {}, "estimate refused")
    : ope.candidate && ope.candidate.value != null
      ? h("div", {}, `est. ${fmt(ope.candidate.value)} vs ${fmt(ope.current.value)}`) : null;
  const why = gate && gate.outcome !== "pass" ? h("div", { class: "muted gate-reason" }, gate.reason) : null;
  return [pill, ...scores, estimate, why];
}

// ---- routing -------------------------------------------------------------------------------

async function render() {
  const [path] = location.hash.replace(/^#/, "").split("?");
  const page = path.startsWith("/episode/") ? "episodes" : path === "/episodes" ? "episodes"
    : path === "/adapters" ? "adapters" : "overview";
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.page === page);
  delete main.dataset.ready;
  try {
    if (!who) {
      who = await api("/ui/api/whoami");
      document.getElementById("who").textContent = `tenant ${who.tenant}${who.admin ? " · admin" : ""}`;
    }
    let nodes;
    if (path.startsWith("/episode/")) nodes = await episode(decodeURIComponent(path.slice(9)));
    else if (path === "/episodes") nodes = await episodes();
    else if (path === "/adapters") nodes = await adapters();
    else nodes = await overview();
    main.replaceChildren(...[nodes].flat(3));
  } catch (e) {
    main.replaceChildren(showError(e));
  }
  main.dataset.ready = location.hash || "#/"; // the browser tests wait on this
}

document.getElementById("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const key = document.getElementById("key").value.trim();
  if (key) sessionStorage.setItem(KEY, key); else sessionStorage.removeItem(KEY);
  document.getElementById("key").value = "";
  who = null;
  render();
});
window.addEventListener("hashchange", render);
render();
