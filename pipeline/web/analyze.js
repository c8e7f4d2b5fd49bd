// The analyse page: publish through POST /api/analyze (wait=false), then follow the answer on
// /api/events?event_id=... as it lands. Model text is only ever set as textContent.
"use strict";
const $ = (id) => document.getElementById(id);
let maxChars = 8000;
let timer = null;

function detectLanguage(text) {  // the server's rule: one CJK character ~ one word ~ five Latin letters
  const cjk = (text.match(/[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]/g) || []).length;
  const latin = (text.match(/[A-Za-z]/g) || []).length;
  if (!text.trim()) return "—";
  return cjk > 0 && cjk * 5 >= latin ? "中文 · Chinese" : "英文 · English";
}

function tooLong(length) {
  return `文档过长：${length} 字符，上限 ${maxChars}。请删减，或分成几段分别提交。`
    + ` · The document is too long: ${length} characters, the limit is ${maxChars}. Shorten it, or send it in parts.`;
}

function updateInput() {
  const text = $("text").value;
  $("language").textContent = detectLanguage(text);
  const over = text.length > maxChars;
  $("count").textContent = `${text.length} / ${maxChars} 字符 · characters` + (over ? " — 超出上限 · too long" : "");
  $("count").style.color = over ? "var(--bad)" : "";
  if (!timer) $("analyze").disabled = over;  // not while an analysis is under way
  if (over) showError(tooLong(text.length), "too-long");
  else if ($("error").dataset.kind === "too-long") hideError();
}

function hideError() {
  $("error").hidden = true;
  $("error").textContent = "";
  delete $("error").dataset.kind;
}

function showError(message, kind) {
  $("error").textContent = message;
  $("error").hidden = false;
  if (kind) $("error").dataset.kind = kind; else delete $("error").dataset.kind;
}

function setBusy(busy, label) {
  $("analyze").disabled = busy;
  clearInterval(timer);
  timer = null;
  if (!busy) { $("status").textContent = label || ""; updateInput(); return; }
  const started = Date.now();
  const tick = () => {
    const s = ((Date.now() - started) / 1000).toFixed(0);
    $("status").replaceChildren(Object.assign(document.createElement("span"), { className: "spinner" }),
      `${label}（${s} 秒 · s）`);
  };
  tick();
  timer = setInterval(tick, 1000);
}

function fillList(id, items) {
  $(id).replaceChildren(...(items.length ? items : ["—"]).map((t) => Object.assign(document.createElement("li"), { textContent: t })));
}

const POLARITY = { positive: "积极 · positive", neutral: "中性 · neutral", negative: "消极 · negative" };
const CATEGORY = { safety: "安全隐患 · safety", product_quality: "产品质量 · product quality", delivery: "物流配送 · delivery",
  billing: "收费退款 · billing", customer_service: "服务态度 · customer service", after_sales: "售后维修 · after-sales",
  misleading_claims: "虚假宣传 · misleading claims", account_access: "账户系统 · account & app", privacy: "隐私数据 · privacy", other: "其他 · other" };
const URGENCY = { critical: "紧急 · critical", high: "高 · high", medium: "中 · medium", low: "低 · low" };

function clearReport() {  // a new submission never sits beside the previous document's report
  $("viewpoint").textContent = "分析结果将显示在这里。· The analysis appears here.";
  $("viewpoint").classList.add("placeholder");
  for (const id of ["facts", "data", "conclusions", "sentiment", "rationale", "triage", "fields", "timings"]) $(id).replaceChildren();
  $("triage-block").hidden = true;
  $("fields-block").hidden = true;
  document.getElementById("injection-warning")?.remove();
}

// The report as far as it is written (`event: partial`, the labels first, then each field once it
// is complete) or whole (the analysis event): whatever is not there yet is left as it is.
function renderAnalysis(a) {
  if (a.core_viewpoint) { $("viewpoint").textContent = a.core_viewpoint; $("viewpoint").classList.remove("placeholder"); }
  const layers = a.key_information || {};
  for (const name of ["facts", "data", "conclusions"]) if (layers[name]) fillList(name, layers[name]);
  const s = a.sentiment;
  const badge = Object.assign(document.createElement("span"), { className: `badge polarity-${s.polarity}`, textContent: POLARITY[s.polarity] || s.polarity });
  $("sentiment").replaceChildren(badge, ` 质疑 · doubt: ${s.implies_doubt ? "是 · yes" : "否 · no"}；期待 · expectation: ${s.implies_expectation ? "是 · yes" : "否 · no"}`);
  if (s.rationale) $("rationale").textContent = s.rationale;
  $("triage-block").hidden = !a.triage;
  if (a.triage) {
    const t = a.triage;
    const u = Object.assign(document.createElement("span"), { className: `badge urgency-${t.urgency}`, textContent: URGENCY[t.urgency] || t.urgency });
    const signals = (t.safety_signals || []).length ? ` — 安全信号 · safety signals: ${t.safety_signals.join(", ")}` : "";
    $("triage").replaceChildren(u, ` 类别 · category: ${CATEGORY[t.category] || t.category}`, t.escalate ? " — 需升级 · escalate" : "", signals);
  }
  if (a.fields) {
    const own = Object.entries(a.fields);  // the kind's own fields (KINDS_FILE)
    $("fields-block").hidden = own.length === 0;
    const shown = (v) => (Array.isArray(v) ? v.join("；") || "—" : typeof v === "boolean" ? (v ? "是 · yes" : "否 · no") : v);
    $("fields").replaceChildren(...own.flatMap(([k, v]) => [Object.assign(document.createElement("dt"), { textContent: k }),
      Object.assign(document.createElement("dd"), { textContent: shown(v) })]));
  }
}

function render(event) {
  const a = event.analysis;
  renderAnalysis(a);
  document.getElementById("injection-warning")?.remove();
  if (a.suspected_injection) {
    const warn = Object.assign(document.createElement("p"), { id: "injection-warning", className: "badge urgency-high",
      textContent: `疑似注入指令，已对模型隐去 · suspected injection, withheld from the model: ${a.injection_excerpts.join(" / ")}` });
    $("rationale").after(warn);
  }
  const tm = event.timings;
  const rows = [["排队 · queued", `${(tm.queued_ms / 1000).toFixed(2)} s`], ["首个 token · first token", `${(tm.time_to_first_token_ms / 1000).toFixed(2)} s`],
    ["总计 · total", `${(tm.total_ms / 1000).toFixed(2)} s`], ["tokens", `${tm.prompt_tokens} → ${tm.output_tokens}`], ["模型 · model", event.model]];
  $("timings").replaceChildren(...rows.flatMap(([k, v]) => [Object.assign(document.createElement("dt"), { textContent: k }),
    Object.assign(document.createElement("dd"), { textContent: v })]));
  $("result").focus();
}

// What to do, in plain words; the server's own sentence only where none of these applies.
const MESSAGES = {
  503: "消息总线暂时不可用，文档没有发出。请一分钟后再试；若一直如此，请联系服务的运维人员。"
    + " · The message bus cannot be reached right now, so nothing was sent. Try again in a minute; if it persists, tell whoever runs the service.",
  504: "等待超时，结果稍后可能仍会出现。 · Timed out waiting; the result may still arrive.",
  422: "输入无效，请检查文本和类型。 · Invalid input: check the text and the kind.",
};

async function analyze(event) {
  event.preventDefault();
  hideError();
  clearReport();
  $("status").textContent = "";
  const text = $("text").value;
  if (!text.trim()) { showError("请先粘贴文本 · Paste a document first"); $("text").focus(); return; }
  if (text.length > maxChars) { showError(tooLong(text.length), "too-long"); return; }
  setBusy(true, "正在提交 · Sending");
  let response;
  try {
    response = await fetch("/api/analyze", { method: "POST", headers: { "content-type": "application/json" },
      body: JSON.stringify({ text, kind: $("kind").value, wait: false }) });
  } catch (err) {
    setBusy(false); showError("无法连接服务，请检查网络后重试。 · Cannot reach the service: check the connection and try again."); return;
  }
  if (response.status === 401) { location.assign("/login?next=/"); return; }  // HTTP_TOKEN set, no session
  if (response.status !== 202) {
    const body = await response.json().catch(() => ({}));
    const detail = typeof body.detail === "string" ? body.detail : "";
    setBusy(false);
    if (response.status === 413) showError(tooLong(text.length), "too-long");
    else showError(MESSAGES[response.status] || `错误 ${response.status} · Error ${response.status}: ${detail}`);
    return;
  }
  const accepted = await response.json();
  setBusy(true, "已提交，正在排队等待分析 · Sent; waiting for the analyser");
  const source = new EventSource(`/api/events?event_id=${encodeURIComponent(accepted.event_id)}`);
  source.addEventListener("partial", (e) => {  // the report fills in as the model writes it
    setBusy(true, "正在撰写报告 · Writing the report");
    renderAnalysis(JSON.parse(e.data).analysis);
  });
  source.addEventListener("analysis", (e) => { source.close(); setBusy(false, "完成 · Done"); render(JSON.parse(e.data)); });
  source.addEventListener("dead_letter", (e) => {
    source.close(); const d = JSON.parse(e.data);
    setBusy(false);
    showError(`分析失败，文档已转入死信队列（${d.error_type}）。可修改后重新提交。 · The analysis failed and the document went to the dead-letter topic (${d.error_type}): ${d.error_message}. Edit it and try again.`);
  });
  source.onerror = () => { if (source.readyState === EventSource.CONNECTING) setBusy(true, "重新连接中 · Reconnecting"); };
}

$("form").addEventListener("submit", analyze);
$("text").addEventListener("input", updateInput);
$("text").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("form").requestSubmit(); });
// Kinds beyond the three built in (the worker's KINDS_FILE) join the selector.
fetch("/api/kinds").then((r) => (r.ok ? r.json() : Promise.reject(r.status))).then((kinds) => {
  const known = new Set([...$("kind").options].map((o) => o.value));
  for (const k of kinds) if (!known.has(k.name)) $("kind").append(new Option(`${k.title.zh} · ${k.title.en}`, k.name));
}).catch(() => {});
fetch("/api/limits").then((r) => (r.ok ? r.json() : Promise.reject(r.status))).then((l) => { maxChars = l.max_document_chars; updateInput(); }).catch(() => {});
updateInput();
