// The triage board: complaint analyses from /api/events, newest first. EventSource reconnects by
// itself and sends Last-Event-ID, so nothing is missed or shown twice (items are keyed by event id).
"use strict";
const $ = (id) => document.getElementById(id);
const items = new Map();  // event_id -> analysis event
const URGENCY = ["critical", "high", "medium", "low"];
const LABEL = { critical: "紧急 · Critical", high: "高 · High", medium: "中 · Medium", low: "低 · Low" };
const KEEP = 500;

function el(tag, props, ...children) {
  const node = Object.assign(document.createElement(tag), props || {});
  node.append(...children);
  return node;
}

function visible() {
  const urgency = $("urgency").value, category = $("category").value, escalated = $("escalated-only").checked;
  return [...items.values()]
    .filter((e) => (!urgency || e.analysis.triage.urgency === urgency) && (!category || e.analysis.triage.category === category)
      && (!escalated || e.analysis.triage.escalate))
    .sort((a, b) => b.created_at.localeCompare(a.created_at));
}

function renderCounts() {
  const since = Date.now() - 3600 * 1000;
  const recent = [...items.values()].filter((e) => Date.parse(e.created_at) >= since);
  $("counts").replaceChildren(...URGENCY.map((u) => el("div", { className: `count urgency-${u}` },
    el("strong", { textContent: String(recent.filter((e) => e.analysis.triage.urgency === u).length) }), LABEL[u])));
}

function renderCategories() {
  const select = $("category"), current = select.value;
  const names = [...new Set([...items.values()].map((e) => e.analysis.triage.category))].sort();
  select.replaceChildren(el("option", { value: "", textContent: "全部 · All" }), ...names.map((n) => el("option", { value: n, textContent: n })));
  select.value = names.includes(current) ? current : "";
}

function render() {
  const shown = visible();
  $("board").replaceChildren(...shown.map((e) => {
    const t = e.analysis.triage;
    const item = el("li", { className: t.escalate ? "escalate" : "" },
      el("div", { className: "meta" },
        el("span", { className: `badge urgency-${t.urgency}`, textContent: LABEL[t.urgency] || t.urgency }),
        el("span", { textContent: `类别 · ${t.category}` }),
        t.escalate ? el("span", { className: "escalate-flag", textContent: "⚑ 需升级 · Escalate" }) : "",
        el("span", { textContent: `情绪 · ${e.analysis.sentiment.polarity}` }),
        el("time", { dateTime: e.created_at, textContent: new Date(e.created_at).toLocaleString() }),
        el("span", { textContent: e.document_id })),
      el("p", { textContent: e.analysis.core_viewpoint }));
    item.dataset.eventId = e.event_id;
    return item;
  }));
  $("summary").textContent = `显示 ${shown.length} / ${items.size} 条投诉分析 · showing ${shown.length} of ${items.size} complaint analyses`;
  renderCounts();
}

function add(event) {
  if (event.kind !== "complaint" || !event.analysis.triage || items.has(event.event_id)) return false;
  items.set(event.event_id, event);
  if (items.size > KEEP) {
    const oldest = [...items.values()].sort((a, b) => a.created_at.localeCompare(b.created_at))[0];
    items.delete(oldest.event_id);
  }
  return true;
}

let pending = null;  // batch re-renders when a replay delivers many events at once
function schedule() {
  if (pending) return;
  pending = setTimeout(() => { pending = null; renderCategories(); render(); }, 100);
}

function connect() {
  const source = new EventSource("/api/events?replay=1000");
  source.onopen = () => { $("live").className = "live up"; $("live").textContent = "实时 · live"; };
  source.onerror = () => {
    $("live").className = "live down"; $("live").textContent = "重新连接中 · reconnecting";
    if (source.readyState !== EventSource.CLOSED) return;  // dropped: EventSource reconnects by itself
    // Refused (EventSource gives up on any status but 200): to the login page on a 401, else retry.
    fetch("/api/limits").then((r) => { if (r.status === 401) location.assign("/login?next=/triage"); else setTimeout(connect, 5000); },
      () => setTimeout(connect, 5000));
  };
  source.addEventListener("analysis", (e) => { if (add(JSON.parse(e.data))) schedule(); });
}

for (const id of ["urgency", "category", "escalated-only"]) $(id).addEventListener("change", render);
setInterval(renderCounts, 30 * 1000);
render();
connect();
