// vkrt's chat and status page: plain JavaScript, no dependencies, nothing loaded from elsewhere.
// Chat streams over /v1/chat/completions (server-sent events); the status panel reads /metrics.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "vkrt.conversations";   // localStorage: the conversations, nowhere else
const SETTINGS = "vkrt.settings";     // localStorage: system prompt and sampling settings
const KEY = "vkrt.apiKey";            // sessionStorage: the API key, for this tab only
const POLL_MS = 2000;
const WINDOW_MS = 5 * 60 * 1000;      // the tokens/s chart's span

// ---- talking to the server ----------------------------------------------------------------

class Unauthorized extends Error {}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  const key = sessionStorage.getItem(KEY);
  if (key) headers.Authorization = `Bearer ${key}`;
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) {
    askForKey(key ? "That key was refused." : "");
    throw new Unauthorized("the server needs an API key");
  }
  return response;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `HTTP ${response.status}`;
  }
}

function askForKey(message) {
  const dialog = $("key-dialog");
  $("key-button").hidden = false;
  $("key-error").textContent = message;
  $("key-error").hidden = !message;
  if (!dialog.open) dialog.showModal();
}

$("key-form").addEventListener("submit", () => {
  sessionStorage.setItem(KEY, $("key-input").value.trim());
  $("key-input").value = "";
  loadModels();
  pollMetrics();
});
$("key-button").addEventListener("click", () => askForKey(""));

// ---- models -------------------------------------------------------------------------------

let models = [];

async function loadModels() {
  try {
    const response = await api("/v1/models");
    if (!response.ok) throw new Error(await errorText(response));
    models = (await response.json()).data;
    const select = $("model");
    const previous = select.value;
    select.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
    if (models.some((m) => m.id === previous)) select.value = previous;
    $("connection").textContent = "connected";
    $("connection").className = "ok";
  } catch (error) {
    if (error instanceof Unauthorized) return;
    $("connection").textContent = `not connected: ${error.message}`;
    $("connection").className = "error";
  }
}

// ---- conversations (localStorage) ---------------------------------------------------------

let conversations = load(STORE, []);
let current = conversations[0] || null;

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversations));
}

function newConversation() {
  current = { id: String(Date.now()), title: "New chat", messages: [] };
  conversations.unshift(current);
  save();
  renderConversations();
  renderMessages();
}

function renderConversations() {
  const list = $("conversations");
  list.replaceChildren(...conversations.map((c) => {
    const item = document.createElement("li");
    item.className = c === current ? "current" : "";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "title";
    open.textContent = c.title;
    open.addEventListener("click", () => { if (!busy) { current = c; renderConversations(); renderMessages(); } });
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "delete";
    remove.title = "delete this conversation";
    remove.textContent = "×";
    remove.addEventListener("click", () => {
      if (busy && c === current) return;
      conversations = conversations.filter((other) => other !== c);
      if (current === c) current = conversations[0] || null;
      save();
      renderConversations();
      renderMessages();
    });
    item.append(open, remove);
    return item;
  }));
}

// ---- settings -----------------------------------------------------------------------------

const SETTING_INPUTS = { system: "system", temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens" };

function restoreSettings() {
  const saved = load(SETTINGS, {});
  for (const [name, id] of Object.entries(SETTING_INPUTS)) {
    if (saved[name] !== undefined) $(id).value = saved[name];
    $(id).addEventListener("change", saveSettings);
  }
}

function saveSettings() {
  const values = {};
  for (const [name, id] of Object.entries(SETTING_INPUTS)) values[name] = $(id).value;
  localStorage.setItem(SETTINGS, JSON.stringify(values));
}

function number(id) {
  const value = Number($(id).value);
  return $(id).value.trim() === "" || Number.isNaN(value) ? undefined : value;
}

// ---- rendering messages -------------------------------------------------------------------

function renderMessages() {
  const box = $("messages");
  box.replaceChildren(...(current ? current.messages.map(messageView) : []));
  box.scrollTop = box.scrollHeight;
}

// One message: reasoning folded, the answer (code fences and JSON as blocks), tool calls.
function messageView(message) {
  const view = document.createElement("article");
  view.className = `msg ${message.role}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role;
  view.append(role);
  if (message.reasoning) {
    const details = document.createElement("details");
    details.className = "reasoning";
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    const text = document.createElement("pre");
    text.textContent = message.reasoning;
    details.append(summary, text);
    view.append(details);
  }
  const content = document.createElement("div");
  content.className = "content";
  content.append(...formatted(message.content || ""));
  view.append(content);
  for (const call of message.tool_calls || []) view.append(toolCallView(call));
  if (message.error) {
    const error = document.createElement("p");
    error.className = "error";
    error.textContent = message.error;
    view.append(error);
  }
  if (message.stopped) {
    const note = document.createElement("p");
    note.className = "muted small stopped";
    note.textContent = "stopped";
    view.append(note);
  }
  if (message.role === "assistant" && !message.streaming) {
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy";
    copy.textContent = "Copy";
    copy.addEventListener("click", () => copyText(message.content || "", copy));
    view.append(copy);
  }
  return view;
}

// Text as paragraphs, ``` fences as code blocks, a reply that is JSON as a formatted block.
function formatted(text) {
  const json = prettyJson(text);
  if (json !== null) return [block(json, "json")];
  const parts = text.split(/```[^\n]*\n?/);
  return parts.map((part, i) => {
    if (i % 2 === 1) return block(part.replace(/\n$/, ""), "code");
    const span = document.createElement("span");
    span.className = "text";
    span.textContent = part;
    return span;
  });
}

function prettyJson(text) {
  const trimmed = text.trim();
  if (!/^[[{]/.test(trimmed)) return null;
  try {
    return JSON.stringify(JSON.parse(trimmed), null, 2);
  } catch {
    return null;
  }
}

function block(text, kind) {
  const pre = document.createElement("pre");
  pre.className = kind;
  pre.textContent = text;
  return pre;
}

function toolCallView(call) {
  const view = document.createElement("div");
  view.className = "tool-call";
  const name = document.createElement("div");
  name.className = "tool-name";
  name.textContent = `tool call: ${call.function?.name || "?"}`;
  const args = call.function?.arguments || "";
  view.append(name, block(prettyJson(args) ?? args, "json"));
  return view;
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {  // no clipboard API outside a secure context (a remote plain-HTTP page): the old way
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

// ---- sending and streaming ----------------------------------------------------------------

let busy = false;
let controller = null;

function setBusy(value) {
  busy = value;
  $("send").disabled = value;
  $("stop").disabled = !value;
  $("chat").dataset.state = value ? "streaming" : "idle";
}

async function send(text) {
  if (!current) newConversation();
  const conversation = current;
  conversation.messages.push({ role: "user", content: text });
  if (conversation.title === "New chat") conversation.title = text.slice(0, 40);
  const reply = { role: "assistant", content: "", streaming: true };
  conversation.messages.push(reply);
  save();
  renderConversations();
  renderMessages();
  setBusy(true);
  controller = new AbortController();
  const view = () => $("messages").lastElementChild;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody(conversation.messages.slice(0, -1))),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices?.[0]?.delta || {};
      if (delta.reasoning_content) reply.reasoning = (reply.reasoning || "") + delta.reasoning_content;
      if (delta.content) reply.content += delta.content;
      for (const call of delta.tool_calls || []) mergeToolCall(reply, call);
      if (conversation === current) {
        view().replaceWith(messageView(reply));
        $("messages").scrollTop = $("messages").scrollHeight;
      }
    });
  } catch (error) {
    if (error.name === "AbortError") reply.stopped = true;
    else if (!(error instanceof Unauthorized)) reply.error = error.message;
    else reply.error = "the server needs an API key";
  } finally {
    reply.streaming = false;
    controller = null;
    setBusy(false);
    save();
    if (conversation === current) renderMessages();
  }
}

function requestBody(messages) {
  const system = $("system").value.trim();
  const history = messages
    .filter((m) => m.role !== "assistant" || m.content || m.tool_calls)  // not a failed reply
    .map(({ role, content, tool_calls }) => (tool_calls ? { role, content, tool_calls } : { role, content }));
  return {
    model: $("model").value || undefined,
    messages: system ? [{ role: "system", content: system }, ...history] : history,
    stream: true,
    temperature: number("temperature"),
    top_p: number("top-p"),
    max_tokens: number("max-tokens"),
  };
}

function mergeToolCall(reply, delta) {
  reply.tool_calls = reply.tool_calls || [];
  const call = reply.tool_calls[delta.index ?? reply.tool_calls.length] ||= {
    id: delta.id, type: "function", function: { name: "", arguments: "" } };
  if (delta.id) call.id = delta.id;
  if (delta.function?.name) call.function.name += delta.function.name;
  if (delta.function?.arguments) call.function.arguments += delta.function.arguments;
}

// Server-sent events: "data: {json}" lines, events separated by a blank line, "[DONE]" last.
async function readEvents(response, onChunk) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onChunk(JSON.parse(data));
      }
    }
  }
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || busy) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
// Aborting the fetch closes the connection; the server aborts the request when it sees that.
$("stop").addEventListener("click", () => controller?.abort());
$("new-chat").addEventListener("click", () => { if (!busy) newConversation(); });

// ---- status panel (/metrics) --------------------------------------------------------------

// Prometheus text format -> {name: [{labels, value}]}.
function parseMetrics(text) {
  const metrics = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = line.match(/^([^\s{]+)(?:\{(.*)\})?\s+(\S+)/);
    if (!match) continue;
    const labels = {};
    for (const [, key, value] of (match[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) {
      labels[key] = value.replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    }
    (metrics[match[1]] ||= []).push({ labels, value: Number(match[3]) });
  }
  return metrics;
}

const value = (metrics, name) => metrics[name]?.[0]?.value;
const sum = (metrics, name) => (metrics[name] || []).reduce((total, s) => total + s.value, 0);

// The q-quantile of a cumulative histogram, interpolated within its bucket (PromQL's way).
function quantile(metrics, name, q) {
  const buckets = (metrics[`${name}_bucket`] || [])
    .map((s) => ({ le: s.labels.le === "+Inf" ? Infinity : Number(s.labels.le), count: s.value }))
    .sort((a, b) => a.le - b.le);
  const total = buckets.at(-1)?.count || 0;
  if (!total) return undefined;
  const rank = q * total;
  let lower = 0;
  let below = 0;
  for (const { le, count } of buckets) {
    if (count >= rank) {
      if (le === Infinity) return lower;  // beyond the last finite bound: say that bound
      return lower + (le - lower) * ((rank - below) / Math.max(count - below, 1e-12));
    }
    lower = le;
    below = count;
  }
  return lower;
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

const seconds = (s) => (s === undefined ? "–" : s < 1 ? `${(s * 1000).toFixed(0)} ms` : `${s.toFixed(2)} s`);
const percent = (x) => `${(100 * x).toFixed(1)}%`;
const show = (id, text) => { $(id).textContent = text; };

let samples = [];  // [{t, tokens}] of vkrt_engine_generation_tokens_total, for the chart

async function pollMetrics() {
  let metrics;
  try {
    const response = await api("/metrics");
    if (response.status === 404) throw new Error("metrics are disabled on this server (--disable-metrics)");
    if (!response.ok) throw new Error(await errorText(response));
    metrics = parseMetrics(await response.text());
    $("status-error").hidden = true;
  } catch (error) {
    if (!(error instanceof Unauthorized)) {
      $("status-error").textContent = `status unavailable: ${error.message}`;
      $("status-error").hidden = false;
    }
    return;
  }
  showStatus(metrics);
}

function showStatus(metrics) {
  show("st-model", models.map((m) => m.id).join(", ") || "–");
  const context = models[0]?.max_model_len;
  show("st-context", context ? `${context} tokens` : "loading…");
  const device = metrics.vkrt_device_info?.[0]?.labels;
  show("st-device", device ? `${device.device} (${device.backend})` : "loading…");
  const total = value(metrics, "vkrt_device_memory_bytes");
  const reserved = value(metrics, "vkrt_device_memory_reserved_bytes");
  show("st-memory", reserved === undefined ? "–"
    : total ? `${bytes(reserved)} of ${bytes(total)} reserved` : `${bytes(reserved)} reserved`);
  show("st-running", String(value(metrics, "vkrt_num_requests_running") ?? "–"));
  show("st-waiting", String(value(metrics, "vkrt_num_requests_waiting") ?? "–"));
  const blocks = value(metrics, "vkrt_num_kv_blocks");
  const free = value(metrics, "vkrt_num_free_kv_blocks");
  show("st-kv", blocks ? `${percent(value(metrics, "vkrt_kv_cache_usage_ratio"))} (${blocks - free} of ${blocks} blocks)` : "–");
  const slots = value(metrics, "vkrt_num_state_slots");
  $("st-state").hidden = $("st-state-label").hidden = !slots;
  if (slots) show("st-state", `${slots - value(metrics, "vkrt_num_free_state_slots")} of ${slots} slots`);
  const queries = sum(metrics, "vllm:prefix_cache_queries_total");
  const hits = sum(metrics, "vllm:prefix_cache_hits_total");
  show("st-prefix", value(metrics, "vkrt_prefix_caching_enabled") === 0 ? "off"
    : queries ? `${percent(hits / queries)} of ${queries} prompt tokens` : "no prompts yet");
  show("st-requests", String(sum(metrics, "vkrt_requests_total")));
  const tokens = value(metrics, "vkrt_engine_generation_tokens_total") ?? 0;
  show("st-tokens", String(tokens));
  for (const [row, name] of [["ttft", "vkrt_time_to_first_token_seconds"], ["itl", "vkrt_inter_token_latency_seconds"]]) {
    for (const q of [50, 90, 99]) show(`st-${row}-p${q}`, seconds(quantile(metrics, name, q / 100)));
  }
  const now = Date.now();
  samples.push({ t: now, tokens });
  samples = samples.filter((s) => now - s.t <= WINDOW_MS);
  drawRate();
}

// Tokens/s between consecutive samples, as a line over the last five minutes.
function drawRate() {
  const rates = [];
  for (let i = 1; i < samples.length; i += 1) {
    const dt = (samples[i].t - samples[i - 1].t) / 1000;
    const dn = samples[i].tokens - samples[i - 1].tokens;
    rates.push({ t: samples[i].t, rate: dt > 0 && dn >= 0 ? dn / dt : 0 });  // a restart resets the counter
  }
  const canvas = $("rate-chart");
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  const max = Math.max(1, ...rates.map((r) => r.rate));
  canvas.dataset.samples = String(rates.length);
  canvas.dataset.max = String(Math.max(0, ...rates.map((r) => r.rate)));
  show("st-rate", rates.length ? `${rates.at(-1).rate.toFixed(1)} now, peak ${Number(canvas.dataset.max).toFixed(1)}` : "–");
  ctx.clearRect(0, 0, width, height);
  ctx.strokeStyle = "#ccc";
  ctx.strokeRect(0.5, 0.5, width - 1, height - 1);
  ctx.fillStyle = "#888";
  ctx.font = "10px sans-serif";
  ctx.fillText(max.toFixed(0), 4, 12);
  if (rates.length < 2) return;
  const now = samples.at(-1).t;
  ctx.strokeStyle = "#2b6cb0";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  rates.forEach((r, i) => {
    const x = width - ((now - r.t) / WINDOW_MS) * width;
    const y = height - 2 - (r.rate / max) * (height - 16);
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
}

// ---- start --------------------------------------------------------------------------------

restoreSettings();
renderConversations();
renderMessages();
setBusy(false);
loadModels().then(pollMetrics);
setInterval(() => { if (!document.hidden) pollMetrics(); }, POLL_MS);
setInterval(() => { if (!models[0]?.max_model_len && !$("key-dialog").open) loadModels(); }, 5000);
