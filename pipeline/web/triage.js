// The triage board: complaint analyses from /api/events, newest first. EventSource reconnects by
// itself and sends Last-Event-ID, so nothing is missed or shown twice (items are keyed by event id).
"use strict";
const $ = (id) => document.getElementById(id);
const items = new Map();  // event_id -> analysis event
const URGENCY = ["critical", "high", "medium", "low"];
const LABEL = { critical: "紧急 · Critical", high: "高 · High", medium: "中 · Medium", low: "低 · Low" };
const KEEP = 500;
const PAGE = 50;  // cards shown at first, and added by "show more"
let limit = PAGE;
// The taxonomy (schemas/taxonomy.py): the filter lists it, not whatever has arrived.
const CATEGORY = { safety: "安全隐患 · Safety", product_quality: "产品质量 · Product quality", delivery: "物流配送 · Delivery",
  billing: "收费退款 · Billing", customer_service: "服务态度 · Customer service", after_sales: "售后维修 · After-sales",
  misleading_claims: "虚假宣传 · Misleading claims", account_access: "账户系统 · Account & app", privacy: "隐私数据 · Privacy",
  other: "其他 · Other" };
const POLARITY = { positive: "积极 · positive", neutral: "中性 · neutral", negative: "消极 · negative" };
const LOCALE = document.documentElement.lang || "zh-CN";  // the page's language, not the browser's
const WHEN = new Intl.DateTimeFormat(LOCALE, { dateStyle: "medium", timeStyle: "medium", hour12: false });

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
  const select = $("category");
  select.replaceChildren(el("option", { value: "", textContent: "全部 · All" }),
    ...Object.entries(CATEGORY).map(([code, label]) => el("option", { value: code, textContent: label })));
}

function render() {
  const matching = visible();
  const shown = matching.slice(0, limit);
  $("board").replaceChildren(...shown.map((e) => {
    const t = e.analysis.triage;
    const item = el("li", { className: t.escalate ? "escalate" : "" },
      el("div", { className: "meta" },
        el("span", { className: `badge urgency-${t.urgency}`, textContent: LABEL[t.urgency] || t.urgency }),
        el("span", { textContent: `类别 · ${CATEGORY[t.category] || t.category}` }),
        t.escalate ? el("span", { className: "escalate-flag", textContent: "⚑ 需升级 · Escalate" }) : "",
        el("span", { textContent: `情绪 · ${POLARITY[e.analysis.sentiment.polarity] || e.analysis.sentiment.polarity}` }),
        el("time", { dateTime: e.created_at, textContent: WHEN.format(new Date(e.created_at)) }),
        el("span", { textContent: e.document_id })),
      el("p", { textContent: e.analysis.core_viewpoint }));
    item.dataset.eventId = e.event_id;
    item.dataset.category = t.category;
    return item;
  }));
  const more = matching.length - shown.length;
  $("more").hidden = more <= 0;
  $("more").textContent = `再显示 ${Math.min(PAGE, more)} 条（还有 ${more} 条）· Show ${Math.min(PAGE, more)} more (${more} left)`;
  $("summary").textContent = `显示 ${shown.length} / ${matching.length} 条（共 ${items.size} 条）投诉分析`
    + ` · showing ${shown.length} of ${matching.length} (${items.size} in all) complaint analyses`;
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
  pending = setTimeout(() => { pending = null; render(); }, 100);
}

const LIVE = {  // the worker's word on the broker, sent on the stream every few seconds
  up: ["live up", "实时 · live"],
  down: ["live down", "消息总线不可达，暂停更新 · broker unreachable, paused"],
  unknown: ["live down", "连接消息总线中 · connecting to the broker"],
};

function showLive([className, text]) {
  $("live").className = className;
  $("live").textContent = text;
}

function connect() {
  const source = new EventSource("/api/events?replay=1000");
  source.onopen = () => showLive(LIVE.unknown);  // the stream is up; the broker's state comes next
  source.addEventListener("state", (e) => showLive(LIVE[JSON.parse(e.data).broker] || LIVE.unknown));
  source.onerror = () => {
    $("live").className = "live down"; $("live").textContent = "重新连接中 · reconnecting";
    if (source.readyState !== EventSource.CLOSED) return;  // dropped: EventSource reconnects by itself
    // Refused (EventSource gives up on any status but 200): to the login page on a 401, else retry.
    fetch("/api/limits").then((r) => { if (r.status === 401) location.assign("/login?next=/triage"); else setTimeout(connect, 5000); },
      () => setTimeout(connect, 5000));
  };
  source.addEventListener("analysis", (e) => { if (add(JSON.parse(e.data))) schedule(); });
}

for (const id of ["urgency", "category", "escalated-only"]) $(id).addEventListener("change", () => { limit = PAGE; render(); });
$("more").addEventListener("click", () => { limit += PAGE; render(); });
setInterval(renderCounts, 30 * 1000);
renderCategories();
render();
connect();
