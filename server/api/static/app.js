// h2o-server chat page: a plain client of the server's public API.
// Chat goes through /v1/chat/completions (SSE), conversations come from
// /v1/sessions, the cache view reads /v1/sessions/{id}/cache. No build step.
"use strict";

const STORE_KEY = "h2o-ui.conversations";
const API_KEY = "h2o-ui.api-key";
const DEFAULT_SETTINGS = { policy: "", max_kv: "", max_tokens: 512, temperature: 0.7 };

const $ = (id) => document.getElementById(id);
const state = {
  options: null, // GET /ui/options: model, policies, default cache
  key: readStorage(API_KEY) || "",
  local: JSON.parse(readStorage(STORE_KEY) || "{}"), // id -> {title, messages, settings, updated}
  server: {}, // id -> the session's figures from /v1/sessions
  current: null,
  draft: null, // a new chat not sent yet
  streaming: null, // {id, controller}
  view: "chat",
  cache: null, // the last /cache report shown
  active: -1, // the token the detail line describes
  keyedAt: 0, // when the arrow keys last moved it (scrolling then moves tokens under the mouse)
};

// ------------------------------------------------------------------ helpers

function readStorage(key) {
  try { return localStorage.getItem(key); } catch { return null; }
}

function writeStorage(key, value) {
  try { localStorage.setItem(key, value); } catch { /* private mode: memory only */ }
}

function saveLocal() {
  writeStorage(STORE_KEY, JSON.stringify(state.local));
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  node.append(...children);
  return node;
}

const fmt = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));

function fmtBytes(n) {
  if (n < 1024) return `${n} B`;
  const units = ["KiB", "MiB", "GiB"];
  let v = n / 1024, i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return `${v.toFixed(v < 10 ? 2 : 1)} ${units[i]}`;
}

function newId() {
  const bytes = crypto.getRandomValues(new Uint8Array(6));
  return "chat-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, { method = "GET", body, signal } = {}) {
  const headers = {};
  if (state.key) headers.Authorization = `Bearer ${state.key}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (response.ok) return response;
  let message = response.statusText;
  try { message = (await response.json()).error.message; } catch { /* not JSON */ }
  if (response.status === 401) {
    notice("This server needs an API key: set it with the API key button.", true);
  }
  throw new ApiError(response.status, message);
}

// Server-sent events of a fetch response: yields each event's data.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", data = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buffer.indexOf("\n")) >= 0) {
      let line = buffer.slice(0, nl);
      buffer = buffer.slice(nl + 1);
      if (line.endsWith("\r")) line = line.slice(0, -1);
      if (line === "") {
        if (data.length) yield data.join("\n");
        data = [];
      } else if (line.startsWith("data:")) {
        data.push(line.slice(5).replace(/^ /, ""));
      }
    }
  }
}

function notice(text, withKeyButton = false) {
  const box = $("notice");
  box.replaceChildren(el("span", { text }));
  if (withKeyButton) {
    const button = el("button", { class: "button small", type: "button", text: "Set API key" });
    button.addEventListener("click", openKeyDialog);
    box.append(button);
  }
  const close = el("button", { class: "icon-button", type: "button", "aria-label": "Dismiss" }, "×");
  close.addEventListener("click", () => { box.hidden = true; });
  box.append(close);
  box.hidden = false;
}

// ------------------------------------------------------------------ conversations

function conversation(id = state.current) {
  if (state.draft && state.draft.id === id) return state.draft;
  return state.local[id] || null;
}

function settingsOf(id) {
  const conv = conversation(id);
  if (conv) return conv.settings;
  const s = state.server[id];
  return { ...DEFAULT_SETTINGS, policy: s ? s.policy : "", max_kv: s ? s.max_kv : "" };
}

async function refreshSessions() {
  if (state.options && state.options.api_key_required && !state.key) {
    renderConversations();
    return; // the key dialog is open; nothing to list without it
  }
  try {
    const response = await api("/v1/sessions");
    const list = (await response.json()).data;
    state.server = Object.fromEntries(list.map((s) => [s.id, s]));
  } catch (e) {
    if (e.status !== 401) notice(`Could not list conversations: ${e.message}`);
  }
  renderConversations();
  renderHeader();
}

function conversationIds() {
  const ids = new Set([...Object.keys(state.local), ...Object.keys(state.server)]);
  const when = (id) => Math.max(
    (state.local[id] && state.local[id].updated) || 0,
    ((state.server[id] && state.server[id].last_used) || 0) * 1000,
  );
  return [...ids].sort((a, b) => when(b) - when(a));
}

function describe(id) {
  const s = state.server[id];
  if (!s) return "not in server memory: the next turn rebuilds its cache";
  const where = s.spilled ? " · spilled" : "";
  return `${s.policy} · max_kv ${s.max_kv} · ${fmt(s.logical_tokens)} tokens${where}`;
}

function renderConversations() {
  const list = $("conversations");
  const ids = conversationIds();
  list.replaceChildren(...ids.map((id) => {
    const local = state.local[id];
    const title = local ? local.title : id;
    const button = el("button", { type: "button", class: "conv", "data-id": id },
      el("span", { class: "conv-name", text: title }),
      el("span", { class: "conv-sub", text: local ? describe(id) : `other client · ${describe(id)}` }));
    if (id === state.current) button.setAttribute("aria-current", "true");
    button.addEventListener("click", () => { select(id); closeSidebar(); });
    return el("li", {}, button);
  }));
  $("no-conversations").hidden = ids.length > 0;
}

function renderHeader() {
  const id = state.current;
  const conv = conversation(id);
  $("conv-title").textContent = conv ? conv.title : id || "New chat";
  if (conv && conv.model) $("model-name").value = conv.model;  // where its cache lives
  const s = state.server[id];
  const name = conv ? `${id} · ` : "";
  $("conv-meta").textContent = s ? `${name}${describe(id)}` : (id ? `${id} · no cache yet` : "");
  $("delete-chat").hidden = !(state.local[id] || s);
  const settings = settingsOf(id);
  const d = state.options ? state.options.default : null;
  const policy = settings.policy || (d ? d.policy : "server default");
  const maxKv = settings.max_kv || (d ? d.max_kv : "");
  $("settings-summary").textContent =
    `· ${policy}${maxKv ? ` · max_kv ${maxKv}` : ""} · reply ≤ ${settings.max_tokens} tokens`;
}

function fillSettings() {
  const settings = settingsOf(state.current);
  $("set-policy").value = settings.policy || "";
  $("set-max-kv").value = settings.max_kv || "";
  $("set-max-tokens").value = settings.max_tokens;
  $("set-temperature").value = settings.temperature;
  const foreign = !conversation();
  for (const id of ["set-policy", "set-max-kv", "set-max-tokens", "set-temperature"]) {
    $(id).disabled = foreign;
  }
}

function readSettings() {
  const conv = conversation();
  if (!conv) return;
  conv.settings = {
    policy: $("set-policy").value,
    max_kv: $("set-max-kv").value ? Number($("set-max-kv").value) : "",
    max_tokens: Math.max(1, Number($("set-max-tokens").value) || DEFAULT_SETTINGS.max_tokens),
    temperature: Number($("set-temperature").value),
  };
  if (state.local[conv.id]) saveLocal();
  renderHeader();
}

function select(id) {
  state.current = id;
  if (!conversation(id) && !state.server[id]) {
    state.draft = { id, title: "New chat", messages: [], settings: { ...DEFAULT_SETTINGS }, updated: 0 };
  }
  state.cache = null;
  state.active = -1;
  fillSettings();
  renderConversations();
  renderHeader();
  renderMessages();
  if (state.view === "cache") loadCache();
}

function newChat() {
  const previous = conversation();
  const id = newId();
  state.draft = {
    id, title: "New chat", messages: [], updated: 0,
    settings: { ...(previous ? previous.settings : DEFAULT_SETTINGS) },
  };
  select(id);
  showView("chat");
  $("composer-input").focus();
}

async function deleteChat() {
  const id = state.current;
  if (!window.confirm(`Delete conversation ${id} and its cache?`)) return;
  if (state.server[id]) {
    try {
      await api(`/v1/sessions/${encodeURIComponent(id)}`, { method: "DELETE" });
    } catch (e) {
      if (e.status !== 404) { notice(`Could not delete: ${e.message}`); return; }
    }
  }
  delete state.local[id];
  delete state.server[id];
  saveLocal();
  const next = conversationIds()[0];
  if (next) select(next); else newChat();
}

// ------------------------------------------------------------------ chat

// A small, safe subset of Markdown for replies: ``` fences, `code` and **bold**.
// Nodes are built with textContent only, so no reply can inject markup.
function renderMarkdown(node, text) {
  const json = prettyJson(text);
  if (json !== null) return node.replaceChildren(el("pre", {}, el("code", { text: json })));
  // Odd parts lie inside ``` fences; empty parts add nothing (an empty reply stays :empty).
  const nodes = text.split(/```[^\n]*\n?/).map((part, i) => {
    if (i % 2 === 1) return el("pre", {}, el("code", { text: part.replace(/\n$/, "") }));
    if (!part) return null;
    const span = el("span");
    for (const piece of part.split(/(\*\*[^*\n]+\*\*|`[^`\n]+`)/)) {
      if (/^\*\*.+\*\*$/.test(piece)) span.append(el("strong", { text: piece.slice(2, -2) }));
      else if (/^`.+`$/.test(piece)) span.append(el("code", { text: piece.slice(1, -1) }));
      else if (piece) span.append(piece);
    }
    return span;
  });
  node.replaceChildren(...nodes.filter(Boolean));
}

// A reply that is one JSON value (response_format json_*) is shown indented.
function prettyJson(text) {
  const trimmed = text.trim();
  if (!/^[[{][\s\S]*[\]}]$/.test(trimmed)) return null;
  try { return JSON.stringify(JSON.parse(trimmed), null, 2); } catch { return null; }
}

// Tool calls as `name(arguments)`, one per line, arguments indented when they parse.
function toolCallsText(calls) {
  return calls.map((c) => `${c.name}(${prettyJson(c.arguments) ?? c.arguments})`).join("\n");
}

function messageNode(message) {
  const content = el("div", { class: "content" });
  if (message.role === "assistant") renderMarkdown(content, message.content);
  else content.textContent = message.content;
  if (message.tool_calls && message.tool_calls.length) {
    content.append(el("pre", { class: "tool-calls" }, el("code", { text: toolCallsText(message.tool_calls) })));
  }
  const node = el("div", { class: `message ${message.role}` },
    el("div", { class: "role", text: message.role === "user" ? "You" : "Assistant" }), content);
  if (message.meta) node.append(el("div", { class: "meta", text: message.meta }));
  return node;
}

function renderMessages() {
  const box = $("messages");
  const conv = conversation();
  const nodes = conv ? conv.messages.map(messageNode) : [];
  if (!conv && state.server[state.current]) {
    nodes.push(el("div", { class: "empty" },
      el("h2", { text: "Started by another client" }),
      el("p", { text: "Its messages are not stored in this browser, so it cannot be continued " +
        "here. The Cache tab shows what its cache holds." })));
  }
  if (!nodes.length) nodes.push(emptyChat());
  box.replaceChildren(...nodes);
  const streaming = state.streaming && state.streaming.id === state.current;
  if (streaming) box.append(state.streaming.node);
  $("composer-input").disabled = !conv;
  $("send").disabled = !conv || Boolean(state.streaming);
  box.scrollTop = box.scrollHeight;
}

function emptyChat() {
  return el("div", { class: "empty" },
    el("h2", { text: "Chat with a bounded cache" }),
    el("p", { text: "Every conversation keeps its own KV cache on the server. Under an H2O " +
      "policy it keeps sink tokens, the heavy hitters and a recent window; the Cache tab " +
      "shows which tokens it still holds." }));
}

function setStreaming(on) {
  $("stop").hidden = !on;
  $("send").disabled = on || !conversation();
  $("messages").setAttribute("aria-busy", on ? "true" : "false");
  $("composer-status").textContent = on ? "Generating…" : "";
}

function requestBody(conv) {
  const s = conv.settings;
  const body = {
    // A conversation stays with the model it started on (its cache lives there).
    model: conv.model || (conv.model = $("model-name").value || "default"),
    messages: conv.messages.map(({ role, content }) => ({ role, content })),
    stream: true,
    stream_options: { include_usage: true },
    prompt_cache_key: conv.id,
    max_tokens: s.max_tokens,
    temperature: s.temperature,
  };
  const kv = {};
  if (s.policy) kv.policy = s.policy;
  if (s.max_kv) kv.max_kv = Number(s.max_kv);
  if (Object.keys(kv).length) body.kv_cache = kv;
  return body;
}

async function send(event) {
  if (event) event.preventDefault();
  const input = $("composer-input");
  const text = input.value.trim();
  const conv = conversation();
  if (!text || !conv || state.streaming) return;
  if (state.draft && state.draft.id === conv.id) {
    state.local[conv.id] = conv;
    state.draft = null;
  }
  if (!conv.messages.length) conv.title = text.length > 48 ? `${text.slice(0, 47)}…` : text;
  conv.messages.push({ role: "user", content: text });
  conv.updated = Date.now();
  saveLocal();
  input.value = "";

  const reply = { role: "assistant", content: "" };
  const node = messageNode(reply);
  node.classList.add("streaming");
  const controller = new AbortController();
  state.streaming = { id: conv.id, controller, node };
  renderConversations();
  renderHeader();
  renderMessages();
  setStreaming(true);

  const started = performance.now();
  let usage = null, finish = null, error = null, firstToken = null;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", body: requestBody(conv), signal: controller.signal,
    });
    for await (const data of sseEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) { error = chunk.error.message; break; }
      const choice = chunk.choices && chunk.choices[0];
      if (choice && choice.delta && choice.delta.content) {
        if (firstToken === null) firstToken = performance.now();
        reply.content += choice.delta.content;
        renderMarkdown(node.querySelector(".content"), reply.content);
        if (state.current === conv.id) $("messages").scrollTop = $("messages").scrollHeight;
      }
      if (choice && choice.delta && choice.delta.tool_calls) {  // whole calls, by index
        reply.tool_calls = reply.tool_calls || [];
        for (const call of choice.delta.tool_calls) {
          const into = (reply.tool_calls[call.index] ||= { name: "", arguments: "" });
          if (call.function && call.function.name) into.name = call.function.name;
          into.arguments += (call.function && call.function.arguments) || "";
        }
        const code = el("code", { text: toolCallsText(reply.tool_calls) });
        node.querySelector(".content").replaceChildren(el("pre", { class: "tool-calls" }, code));
      }
      if (choice && choice.finish_reason) finish = choice.finish_reason;
      if (chunk.usage) usage = chunk.usage;
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else error = e.message;
  }
  state.streaming = null;
  node.classList.remove("streaming");
  if (reply.content || reply.tool_calls) {
    reply.meta = replyMeta(finish, usage, started, firstToken);
    conv.messages.push(reply);
  } else {
    // Nothing came back: take the message back so the user can resend it.
    conv.messages.pop();
    if (!input.value) input.value = text;
  }
  if (error) notice(`The server answered with an error: ${error}`);
  conv.updated = Date.now();
  saveLocal();
  setStreaming(false);
  if (state.current === conv.id) renderMessages();
  await refreshSessions();
  if (state.view === "cache" && state.current === conv.id) loadCache();
}

function replyMeta(finish, usage, started, firstToken) {
  const parts = [finish === "stopped" ? "stopped" : finish === "length" ? "length limit" : "done"];
  if (usage) {
    const seconds = (performance.now() - (firstToken || started)) / 1000;
    parts.push(`${usage.completion_tokens} tokens`);
    if (seconds > 0 && usage.completion_tokens > 1) {
      parts.push(`${(usage.completion_tokens / seconds).toFixed(1)} tok/s`);
    }
    const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
    parts.push(`${fmt(cached)} of ${fmt(usage.prompt_tokens)} prompt tokens reused`);
  }
  return parts.join(" · ");
}

function stop() {
  if (state.streaming) state.streaming.controller.abort();
}

// ------------------------------------------------------------------ cache view

async function loadCache() {
  const id = state.current;
  if (!state.server[id]) {
    renderCache(null, "No cache yet: send a message first.");
    return;
  }
  $("refresh-cache").disabled = true;
  try {
    const response = await api(`/v1/sessions/${encodeURIComponent(id)}/cache`);
    const report = await response.json();
    if (state.current !== id) return;
    state.cache = report;
    renderCache(report);
  } catch (e) {
    renderCache(null, `Could not read the cache: ${e.message}`);
  } finally {
    $("refresh-cache").disabled = false;
  }
}

function figure(name, label, value, text) {
  return el("div", { class: "figure", id: `fig-${name}`, "data-value": String(value) },
    el("div", { class: "figure-value", text }),
    el("div", { class: "figure-label", text: label }));
}

function tokenClass(report, i, held) {
  const { sink, recent, kind } = report.segments;
  if (held === null) return "tok unknown";
  if (held === 0) return "tok evicted";
  if (i < sink) return "tok seg-sink";
  if (i >= report.tokens.ids.length - recent && recent > 0) return "tok seg-recent";
  return kind === "h2o" ? "tok seg-heavy" : "tok seg-held";
}

function renderCache(report, message) {
  const tokens = $("tokens");
  $("cache-view").dataset.state = report ? "loaded" : "empty";
  if (!report) {
    $("figures").replaceChildren(el("p", { class: "muted", text: message || "" }));
    tokens.replaceChildren();
    $("head-map").width = 0;
    $("turns").tBodies[0].replaceChildren();
    return;
  }
  const t = report.tokens;
  const pairs = report.layers * report.kv_heads;
  const allHeld = t.held ? t.held.filter((h) => h === pairs).length : 0;
  const noneHeld = t.held ? t.held.filter((h) => h === 0).length : 0;
  $("figures").replaceChildren(
    figure("logical_tokens", "tokens seen", report.logical_tokens, fmt(report.logical_tokens)),
    figure("stored_tokens", `stored per head, max_kv ${fmt(report.max_kv)}`,
      report.stored_tokens, fmt(report.stored_tokens)),
    figure("evictions", "evicted per head", report.evictions, fmt(report.evictions)),
    figure("evicted_everywhere", "gone from every head", noneHeld, fmt(noneHeld)),
    figure("held_everywhere", "kept by every head", allHeld, fmt(allHeld)),
    figure("bytes", "cache memory", report.bytes, fmtBytes(report.bytes)),
    figure("policy", `${report.preset} · ${report.score} score`, report.policy, report.policy),
  );
  if (report.spilled) {
    $("figures").append(el("p", { class: "muted small",
      text: "Spilled to disk: what it holds shows again after its next turn." }));
  }
  const fragment = document.createDocumentFragment();
  for (let i = 0; i < t.ids.length; i++) {
    const held = t.held ? t.held[i] : null;
    const span = el("span", { class: tokenClass(report, i, held), "data-i": String(i) });
    let text = t.text[i];
    if (/^<\|[^|]*\|>$/.test(text)) span.classList.add("special");
    if (text === "") text = "\u200b"; // a split character: keep the token hoverable
    span.textContent = text.replace(/\n/g, "↵\n");
    if (held !== null) span.style.setProperty("--held", pairs ? (held / pairs).toFixed(3) : "0");
    fragment.append(span);
  }
  tokens.replaceChildren(fragment);
  state.active = Math.min(state.active, t.ids.length - 1);
  describeToken(state.active);
  drawHeadMap(report);
  renderTurns(report.turns);
}

function describeToken(i) {
  const report = state.cache;
  const line = $("token-detail");
  for (const old of $("tokens").querySelectorAll(".tok.active")) old.classList.remove("active");
  if (!report || i < 0) {
    line.textContent = "Hover a token, or focus the text and use the arrow keys.";
    return;
  }
  const t = report.tokens;
  const pairs = report.layers * report.kv_heads;
  const span = $("tokens").children[i];
  if (span) span.classList.add("active");
  const segment = span ? span.className.match(/seg-(\w+)|evicted|unknown/) : null;
  const names = { sink: "sink token", heavy: "heavy hitter", recent: "recent window", held: "held" };
  const where = segment ? (segment[1] ? names[segment[1]] : segment[0]) : "";
  const parts = [`position ${fmt(i)}`, JSON.stringify(t.text[i]), where];
  if (t.held) parts.push(`held by ${t.held[i]} of ${pairs} (layer, head) caches`);
  if (t.score && t.score[i] !== null) parts.push(`score ${t.score[i]}`);
  line.textContent = parts.join(" · ");
}

function moveActive(event) {
  const report = state.cache;
  if (!report) return;
  const n = report.tokens.ids.length;
  const steps = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1, PageDown: 50, PageUp: -50 };
  let i = state.active;
  if (event.key in steps) i = Math.max(0, Math.min(n - 1, (i < 0 ? 0 : i) + steps[event.key]));
  else if (event.key === "Home") i = 0;
  else if (event.key === "End") i = n - 1;
  else return;
  event.preventDefault();
  state.active = i;
  state.keyedAt = performance.now();
  describeToken(i);
  const span = $("tokens").children[i];
  if (span) span.scrollIntoView({ block: "nearest" });
}

function decodeBitmap(b64) {
  const raw = atob(b64);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  return bytes;
}

function drawHeadMap(report) {
  const canvas = $("head-map");
  const n = report.tokens.ids.length;
  const heads = report.heads;
  if (!heads.length || !n) { canvas.width = 0; return; }
  const ROW = 2; // pixels per (layer, head); a 1-pixel gap between layers
  const rows = heads.length * ROW + Math.max(0, report.layers - 1);
  canvas.width = n;
  canvas.height = rows;
  const styles = getComputedStyle(document.body);
  const held = parseColor(styles.getPropertyValue("--map-held"));
  const empty = parseColor(styles.getPropertyValue("--map-empty"));
  const gap = parseColor(styles.getPropertyValue("--map-gap"));
  const image = canvas.getContext("2d").createImageData(n, rows);
  const px = image.data;
  for (let i = 0; i < px.length; i += 4) px.set(gap, i);
  heads.forEach((head, index) => {
    const bits = decodeBitmap(head.bitmap);
    const top = index * ROW + head.layer;
    for (let p = 0; p < n; p++) {
      const color = (bits[p >> 3] >> (p & 7)) & 1 ? held : empty;
      for (let r = 0; r < ROW; r++) px.set(color, ((top + r) * n + p) * 4);
    }
  });
  canvas.getContext("2d").putImageData(image, 0, 0);
  canvas.style.height = `${rows}px`; // one CSS pixel per row, however many positions
}

function parseColor(css) {
  const probe = document.createElement("canvas").getContext("2d");
  probe.fillStyle = css.trim() || "#000";
  probe.fillRect(0, 0, 1, 1);
  return probe.getImageData(0, 0, 1, 1).data;
}

function renderTurns(turns) {
  const rows = turns.map((turn, i) => {
    const u = turn.usage;
    const cells = [i + 1, u.prompt_tokens, u.prompt_tokens_details.cached_tokens,
      u.completion_tokens, turn.logical_tokens, turn.stored_tokens, turn.evictions];
    return el("tr", {}, ...cells.map((c) => el("td", { text: fmt(c) })),
      el("td", { text: fmtBytes(turn.bytes) }));
  });
  $("turns").tBodies[0].replaceChildren(...rows);
}

// ------------------------------------------------------------------ views, dialogs

function showView(view) {
  state.view = view;
  for (const [name, tab, panel] of [["chat", "tab-chat", "chat-view"], ["cache", "tab-cache", "cache-view"]]) {
    const on = name === view;
    $(tab).setAttribute("aria-selected", String(on));
    $(tab).tabIndex = on ? 0 : -1;
    $(panel).hidden = !on;
  }
  if (view === "cache") loadCache();
  else $("messages").scrollTop = $("messages").scrollHeight;
}

function tabKeys(event) {
  if (event.key !== "ArrowLeft" && event.key !== "ArrowRight") return;
  const next = state.view === "chat" ? "cache" : "chat";
  showView(next);
  $(`tab-${next}`).focus();
  event.preventDefault();
}

function openKeyDialog() {
  $("key-input").value = state.key;
  $("key-dialog").showModal();
  $("key-input").focus();
}

function saveKey() {
  state.key = $("key-input").value.trim();
  writeStorage(API_KEY, state.key);
  $("notice").hidden = true;
  refreshSessions();
}

function toggleSidebar(open) {
  const on = open ?? !document.body.classList.contains("sidebar-open");
  document.body.classList.toggle("sidebar-open", on);
  $("toggle-sidebar").setAttribute("aria-expanded", String(on));
  if (on) $("new-chat").focus();
}

function closeSidebar() {
  if (document.body.classList.contains("sidebar-open")) toggleSidebar(false);
}

async function loadOptions() {
  try {
    const response = await fetch("/ui/options");
    state.options = await response.json();
  } catch (e) {
    notice(`Could not reach the server: ${e.message}`);
    return;
  }
  const o = state.options;
  $("model-name").replaceChildren(
    ...(o.models.length ? o.models : [o.model]).map((m) => el("option", { value: m, text: m })));
  $("model-name").value = o.model;
  const select = $("set-policy");
  select.replaceChildren(
    el("option", { value: "", text: `server default (${o.default.policy}, max_kv ${o.default.max_kv})` }),
    ...o.policies.map((p) => el("option", { value: p, text: p })));
  $("set-max-kv").placeholder = `server default (${o.default.max_kv})`;
  if (o.api_key_required && !state.key) {
    notice("This server needs an API key.", true);
    openKeyDialog();
  }
}

function wire() {
  $("composer").addEventListener("submit", send);
  $("composer-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
  });
  document.addEventListener("keydown", (e) => {
    if (e.key !== "Escape") return;
    if (state.streaming) { e.preventDefault(); stop(); }
    else if (document.body.classList.contains("sidebar-open")) {
      toggleSidebar(false);
      $("toggle-sidebar").focus();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("delete-chat").addEventListener("click", deleteChat);
  $("tab-chat").addEventListener("click", () => showView("chat"));
  $("tab-cache").addEventListener("click", () => showView("cache"));
  $("tab-chat").addEventListener("keydown", tabKeys);
  $("tab-cache").addEventListener("keydown", tabKeys);
  $("refresh-cache").addEventListener("click", async () => { await refreshSessions(); loadCache(); });
  for (const id of ["set-policy", "set-max-kv", "set-max-tokens", "set-temperature"]) {
    $(id).addEventListener("change", readSettings);
  }
  $("tokens").addEventListener("mouseover", (e) => {
    if (performance.now() - state.keyedAt < 800) return;
    const i = e.target.dataset ? e.target.dataset.i : undefined;
    if (i !== undefined) { state.active = Number(i); describeToken(state.active); }
  });
  $("tokens").addEventListener("keydown", moveActive);
  $("open-key").addEventListener("click", openKeyDialog);
  $("key-form").addEventListener("submit", saveKey);
  $("key-cancel").addEventListener("click", () => $("key-dialog").close());
  $("toggle-sidebar").addEventListener("click", () => toggleSidebar());
}

async function start() {
  wire();
  await loadOptions();
  await refreshSessions();
  const first = conversationIds().find((id) => state.local[id]);
  if (first) select(first); else newChat();
}

start();
