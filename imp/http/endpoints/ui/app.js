// imp's built-in chat page. No framework and no build step: the server serves
// this file as it is. It speaks the same OpenAI routes any client uses
// (/v1/models, /v1/chat/completions, /v1/requests/{id}/end_thinking) and
// reads /health and /v1/metrics for the live panel.
//
// Safety rule for the whole file: text from the model or the server is put on
// the page with textContent / createTextNode (md.js for replies), never with
// innerHTML.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = { convs: "imp.ui.convs", current: "imp.ui.current", settings: "imp.ui.settings" };
const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "seed", "api-key"];

const state = {
  convs: [], // [{id, title, updated, messages: [{role, content, reasoning?, stats?, stopped?, error?}]}]
  current: null, // id of the conversation on screen
  busy: null, // the reply being streamed: {controller, requestId, reply, view}
  models: [],
};

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function randomId(prefix) {
  // crypto.randomUUID exists only in secure contexts; getRandomValues everywhere
  const b = crypto.getRandomValues(new Uint8Array(12));
  return prefix + Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
}

// ---------------------------------------------------------------- storage

function load(key, fallback) {
  try {
    const v = JSON.parse(localStorage.getItem(key));
    return v ?? fallback;
  } catch {
    return fallback; // unreadable or from another version: start afresh
  }
}

function save() {
  try {
    localStorage.setItem(KEY.convs, JSON.stringify(state.convs));
    localStorage.setItem(KEY.current, JSON.stringify(state.current));
  } catch (e) {
    showError("Could not save the conversation in this browser: " + e.message);
  }
}

function saveSettings() {
  const s = {};
  for (const id of SETTINGS) s[id] = $(id).value;
  s.model = $("model").value || load(KEY.settings, {}).model || "";
  localStorage.setItem(KEY.settings, JSON.stringify(s));
}

function restoreSettings() {
  const s = load(KEY.settings, {});
  for (const id of SETTINGS) if (typeof s[id] === "string") $(id).value = s[id];
}

const currentConv = () => state.convs.find((c) => c.id === state.current) || null;

function newConv() {
  const c = { id: randomId("c"), title: "New chat", updated: Date.now(), messages: [] };
  state.convs.unshift(c);
  state.current = c.id;
  return c;
}

// ---------------------------------------------------------------- HTTP

class HttpError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function apiFetch(path, opts = {}) {
  const headers = new Headers(opts.headers || {});
  const key = $("api-key").value.trim();
  if (key) headers.set("Authorization", "Bearer " + key);
  return fetch(path, { ...opts, headers });
}

async function httpError(res) {
  // the server answers every error with {"error": {"message", "code", ...}}
  let message = res.statusText || "request failed";
  let code = null;
  try {
    const body = await res.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || null;
    }
  } catch {
    /* not JSON: keep the status text */
  }
  return new HttpError(res.status, message, code);
}

async function getJson(path) {
  const res = await apiFetch(path);
  if (!res.ok) throw await httpError(res);
  return res.json();
}

// Yield the JSON of each SSE `data:` line until `[DONE]`. The server writes one
// data line per event; other lines (comments, blank separators) are skipped.
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true });
      const lines = buf.split("\n");
      buf = lines.pop(); // a partial line waits for the next read
      for (const line of lines) {
        if (!line.startsWith("data:")) continue;
        const payload = line.slice(5).trim();
        if (payload === "[DONE]") return;
        yield JSON.parse(payload);
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// ---------------------------------------------------------------- banner

function showError(text) {
  $("banner-text").textContent = text;
  $("banner").hidden = false;
}

function hideError() {
  $("banner").hidden = true;
}

function explain(err) {
  if (err instanceof HttpError) {
    if (err.status === 401) {
      openSettingsForKey();
      return `401: the server needs an API key (${err.message}). Enter it under Settings.`;
    }
    const kind = err.status >= 500 ? "Server error" : "Request refused";
    return `${kind} ${err.status}${err.code ? " (" + err.code + ")" : ""}: ${err.message}`;
  }
  if (err instanceof TypeError) return "Cannot reach the server: " + err.message;
  return err.message || String(err);
}

function openSettingsForKey() {
  $("settings").open = true;
  openSide(true);
  $("api-key").focus();
}

// ---------------------------------------------------------------- models

async function loadModels() {
  const select = $("model");
  try {
    const body = await getJson("/v1/models");
    state.models = body.data || [];
  } catch (e) {
    showError("Could not list models: " + explain(e));
    return;
  }
  const wanted = load(KEY.settings, {}).model;
  select.replaceChildren();
  // the loaded models first; the rest of --models-dir loads when a request names it (models on demand)
  const sorted = [...state.models].sort((a, b) => (b.loaded !== false) - (a.loaded !== false));
  for (const m of sorted) {
    const o = el("option", null, m.id + (m.loaded === false ? " (loads on first use)" : ""));
    o.value = m.id;
    select.append(o);
  }
  const ok = sorted.find((m) => m.id === wanted && m.loaded !== false) || sorted.find((m) => m.loaded !== false);
  if (ok) select.value = ok.id;
}

// ---------------------------------------------------------------- rendering

function renderConvList() {
  const ul = $("convs");
  ul.replaceChildren();
  for (const c of state.convs) {
    const li = el("li", c.id === state.current ? "active" : null);
    const open = li.appendChild(el("button", "conv-title", c.title));
    open.type = "button";
    open.title = c.title;
    if (c.id === state.current) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => switchTo(c.id));
    const del = li.appendChild(el("button", "conv-del icon", "×"));
    del.type = "button";
    del.setAttribute("aria-label", "Delete conversation: " + c.title);
    // two clicks delete: no modal dialog, no accident
    del.addEventListener("click", () => {
      if (del.dataset.armed) return deleteConv(c.id);
      del.dataset.armed = "1";
      del.textContent = "Delete?";
      setTimeout(() => {
        delete del.dataset.armed;
        del.textContent = "×";
      }, 3000);
    });
    ul.append(li);
  }
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  const conv = currentConv();
  if (!conv || conv.messages.length === 0) {
    const empty = box.appendChild(el("div", "empty"));
    empty.append(el("p", null, "Ask anything."), el("p", "hint", "Enter sends · Shift+Enter new line · Esc stops"));
    return;
  }
  for (const m of conv.messages) {
    const view = messageView(m);
    box.append(view.root);
    if (state.busy && state.busy.reply === m) state.busy.view = view;
  }
  box.scrollTop = box.scrollHeight;
}

function messageView(msg) {
  const root = el("article", "msg " + msg.role);
  root.append(el("div", "role", msg.role === "user" ? "You" : "imp"));
  if (msg.role === "user") {
    root.append(el("div", "text", msg.content)); // the user's words, verbatim
    return { root };
  }
  const think = root.appendChild(el("div", "think"));
  const details = think.appendChild(el("details"));
  const summary = details.appendChild(el("summary", null, "Thinking"));
  const thinkBody = details.appendChild(el("div", "think-body"));
  const endBtn = think.appendChild(el("button", "end-think", "End thinking"));
  endBtn.type = "button";
  endBtn.hidden = true;
  endBtn.addEventListener("click", () => endThinking(endBtn));
  const body = root.appendChild(el("div", "md"));
  const stats = root.appendChild(el("div", "stats"));
  const view = { root, think, details, summary, thinkBody, endBtn, body, stats, autoOpened: false, autoClosed: false };
  paintReply(view, msg);
  return view;
}

function paintReply(view, msg) {
  const streaming = state.busy && state.busy.reply === msg;
  const thinking = streaming && msg.reasoning && !msg.content;
  view.think.hidden = !msg.reasoning;
  view.thinkBody.textContent = msg.reasoning || "";
  view.summary.textContent = thinking ? "Thinking…" : "Thoughts";
  view.endBtn.hidden = !thinking;
  if (thinking && !view.autoOpened) view.details.open = view.autoOpened = true; // once: the user may fold it
  // the answer has begun: fold the thoughts away once (the user may reopen them)
  if (!thinking && msg.content && view.details.open && !view.autoClosed) view.details.open = false;
  if (msg.content) view.autoClosed = true;
  view.body.replaceChildren(window.impMarkdown.render(msg.content || ""));
  if (streaming && !msg.content && !msg.reasoning) view.body.append(el("span", "cursor", "…"));
  view.root.classList.toggle("streaming", !!streaming);
  view.stats.textContent = statsLine(msg, streaming);
}

function statsLine(msg, streaming) {
  if (streaming) return "streaming…";
  const s = msg.stats;
  const parts = [];
  if (msg.stopped) parts.push("stopped");
  if (msg.error) parts.push("failed");
  if (s) {
    parts.push(`${s.approx ? "~" : ""}${s.tokens} token${s.tokens === 1 ? "" : "s"}`);
    if (s.tokS != null) parts.push(`${s.tokS.toFixed(1)} tok/s`);
    if (s.ttftMs != null) parts.push(`TTFT ${Math.round(s.ttftMs)} ms`);
    if (s.cached != null) parts.push(`${s.cached} cached of ${s.prompt} prompt tokens`);
    if (s.finish && s.finish !== "stop") parts.push(`finish: ${s.finish}`);
  }
  return parts.join(" · ");
}

let paintQueued = false;
function schedulePaint() {
  // one repaint per frame however many tokens arrived in it
  if (paintQueued) return;
  paintQueued = true;
  requestAnimationFrame(() => {
    paintQueued = false;
    paintBusy();
  });
}

function paintBusy() {
  const b = state.busy;
  if (!b || !b.view) return;
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
  paintReply(b.view, b.reply);
  if (atBottom) box.scrollTop = box.scrollHeight; // follow the reply unless the user scrolled up
}

function setBusy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("messages").setAttribute("aria-busy", on ? "true" : "false");
}

// ---------------------------------------------------------------- chat

function number(id, integer) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined; // blank: the server's default
  const v = Number(raw);
  if (!Number.isFinite(v)) throw new Error(`${id} must be a number`);
  return integer ? Math.trunc(v) : v;
}

function requestBody(conv) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of conv.messages) if (m.content) messages.push({ role: m.role, content: m.content });
  const body = {
    model: $("model").value || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: number("temperature"),
    top_p: number("top_p"),
    max_tokens: number("max_tokens", true),
    seed: number("seed", true),
  };
  return JSON.stringify(body); // undefined fields drop out
}

async function send() {
  const input = $("input");
  const text = input.value;
  if (!text.trim() || state.busy) return;
  hideError();
  const conv = currentConv() || newConv();
  let body;
  conv.messages.push({ role: "user", content: text });
  try {
    body = requestBody(conv);
  } catch (e) {
    conv.messages.pop();
    showError(e.message);
    return;
  }
  if (conv.title === "New chat") conv.title = text.trim().replace(/\s+/g, " ").slice(0, 48);
  const reply = { role: "assistant", content: "", reasoning: "" };
  conv.messages.push(reply);
  conv.updated = Date.now();
  input.value = "";
  autosize();
  const requestId = randomId("ui-");
  state.busy = { controller: new AbortController(), requestId, reply, view: null };
  save();
  renderConvList();
  renderMessages();
  setBusy(true);

  const t0 = performance.now();
  let tFirst = null;
  let tLast = null;
  let chunks = 0;
  let usage = null;
  let finish = null;
  try {
    // our own X-Request-Id names the request for end_thinking before any chunk has come
    const res = await apiFetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", "X-Request-Id": requestId },
      body,
      signal: state.busy.controller.signal,
    });
    if (!res.ok) throw await httpError(res);
    for await (const data of sseData(res.body)) {
      if (data.error) throw new HttpError(500, data.error.message, data.error.code); // a fault mid-stream
      if (data.usage) usage = data.usage;
      for (const ch of data.choices || []) {
        const d = ch.delta || {};
        const r = d.reasoning_content || "";
        const c = d.content || "";
        if (r || c) {
          tLast = performance.now();
          if (tFirst === null) {
            tFirst = tLast;
            refreshLive(); // show the KV this request took now, not at the next tick
          }
          chunks++;
        }
        reply.reasoning += r;
        reply.content += c;
        if (ch.finish_reason) finish = ch.finish_reason;
      }
      schedulePaint();
    }
  } catch (e) {
    if (e.name === "AbortError") {
      reply.stopped = true; // the server saw the disconnect and cancelled: its KV is free
    } else if (!reply.content && !reply.reasoning) {
      // nothing came back: take the turn back and give the text back to edit
      conv.messages.splice(conv.messages.indexOf(reply) - 1, 2);
      if (!conv.messages.length) conv.title = "New chat";
      input.value = text;
      autosize();
      showError(explain(e));
    } else {
      reply.error = explain(e);
      showError(reply.error);
    }
  } finally {
    if (conv.messages.includes(reply)) {
      const tokens = usage ? usage.completion_tokens : chunks;
      reply.stats = {
        tokens,
        approx: !usage, // a stopped stream has no usage chunk: one chunk is about one token
        ttftMs: tFirst === null ? null : tFirst - t0,
        // decode rate after the first token; none when the tokens came in one burst
        tokS: tokens > 1 && tLast - tFirst >= 20 ? (tokens - 1) / ((tLast - tFirst) / 1000) : null,
        cached: usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null,
        prompt: usage ? usage.prompt_tokens : null,
        finish,
      };
    }
    const view = state.busy.view;
    state.busy = null;
    setBusy(false);
    save();
    if (view && conv.messages.includes(reply)) paintReply(view, reply);
    else if (conv.id === state.current) renderMessages();
    renderConvList();
    setTimeout(refreshLive, 300); // after the server has seen the end (a stop frees its KV a step later)
  }
}

function stop() {
  if (state.busy) state.busy.controller.abort();
}

async function endThinking(button) {
  const b = state.busy;
  if (!b) return;
  button.disabled = true;
  try {
    const res = await apiFetch(`/v1/requests/${encodeURIComponent(b.requestId)}/end_thinking`, { method: "POST" });
    if (!res.ok && res.status !== 404) throw await httpError(res); // 404: it finished meanwhile
    button.textContent = "Ending…";
  } catch (e) {
    button.disabled = false;
    showError("End thinking: " + explain(e));
  }
}

// ---------------------------------------------------------------- conversations

function switchTo(id) {
  if (id === state.current) return openSide(false);
  stop(); // the stream belongs to the conversation being left
  state.current = id;
  save();
  renderConvList();
  renderMessages();
  openSide(false);
  $("input").focus();
}

function deleteConv(id) {
  if (state.busy && currentConv() && currentConv().id === id) stop();
  state.convs = state.convs.filter((c) => c.id !== id);
  if (state.current === id) state.current = state.convs.length ? state.convs[0].id : null;
  save();
  renderConvList();
  renderMessages();
}

function startNew() {
  stop();
  const c = currentConv();
  if (!c || c.messages.length) newConv(); // an empty chat is reused, not duplicated
  save();
  renderConvList();
  renderMessages();
  openSide(false);
  $("input").focus();
}

// ---------------------------------------------------------------- live panel

let liveTimer = null;
let livePolling = false;

async function refreshLive() {
  if (livePolling) return; // one poll at a time: callers come from timers and events
  livePolling = true;
  clearTimeout(liveTimer);
  try {
    const [health, metrics] = await Promise.all([
      getJson("/health"),
      getJson("/v1/metrics").catch((e) => (e instanceof HttpError && e.status === 401 ? null : Promise.reject(e))),
    ]);
    const used = health.kv_blocks_used;
    const total = health.kv_blocks_total;
    $("live-dot").className = "dot " + (health.status === "ok" ? "ok" : "bad");
    $("live-kv").textContent = `KV ${used}/${total}` + (total ? ` (${Math.round((100 * used) / total)}%)` : "");
    $("live-queue").textContent = `queue ${health.queue_waiting ?? 0} waiting · ${health.queue_running ?? 0} running`;
    const rates = metrics && metrics.server && metrics.server.rates;
    $("live-rate").textContent = rates ? `decode ${Math.round(rates.decode_tok_s || 0)} tok/s` : "decode – (key needed)";
  } catch {
    $("live-dot").className = "dot bad";
    $("live-kv").textContent = "server unreachable";
    $("live-queue").textContent = "";
    $("live-rate").textContent = "";
  } finally {
    livePolling = false;
  }
  // faster while a reply streams; paused in a hidden tab (visibilitychange restarts it)
  if (!document.hidden) liveTimer = setTimeout(refreshLive, state.busy ? 1000 : 3000);
}

// ---------------------------------------------------------------- layout and keys

function openSide(open) {
  $("side").classList.toggle("open", open);
  $("menu").setAttribute("aria-expanded", open ? "true" : "false");
}

function autosize() {
  const ta = $("input");
  ta.style.height = "auto";
  ta.style.height = Math.min(ta.scrollHeight, window.innerHeight * 0.4) + "px";
}

function wire() {
  // the phone drawer opens below the header, whose height depends on wrapping
  const header = document.querySelector(".top");
  new ResizeObserver(() => document.documentElement.style.setProperty("--header", header.offsetHeight + "px")).observe(header);
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("input").addEventListener("keydown", (e) => {
    // Enter sends, Shift+Enter is a new line; never mid-composition (IME input)
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing && !e.altKey && !e.ctrlKey && !e.metaKey) {
      e.preventDefault();
      send();
    }
  });
  $("input").addEventListener("input", autosize);
  $("settings-form").addEventListener("submit", (e) => e.preventDefault()); // Enter in a field must not reload
  document.addEventListener("keydown", (e) => {
    if (e.key !== "Escape") return;
    if (state.busy) {
      e.preventDefault();
      stop();
    } else if ($("side").classList.contains("open")) {
      openSide(false);
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", startNew);
  $("menu").addEventListener("click", () => openSide(!$("side").classList.contains("open")));
  $("banner-close").addEventListener("click", hideError);
  for (const id of SETTINGS) $(id).addEventListener("input", saveSettings); // kept as typed
  $("model").addEventListener("change", saveSettings);
  $("api-key").addEventListener("change", () => {
    hideError();
    loadModels();
    refreshLive();
  });
  document.addEventListener("visibilitychange", () => !document.hidden && refreshLive());
  // a reload mid-reply keeps what has arrived so far
  window.addEventListener("pagehide", () => {
    if (state.busy) {
      state.busy.reply.stopped = true;
      save();
    }
  });
}

function init() {
  state.convs = load(KEY.convs, []).filter((c) => c && Array.isArray(c.messages));
  state.current = load(KEY.current, null);
  if (!currentConv()) state.current = state.convs.length ? state.convs[0].id : null;
  restoreSettings();
  wire();
  renderConvList();
  renderMessages();
  loadModels();
  refreshLive();
  $("input").focus();
}

init();
