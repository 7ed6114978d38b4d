// The playground: one streamed request at a time to this server's own OpenAI endpoints, each
// generated token coloured by its entropy, with the signal drawn under the text.
"use strict";

const $ = (id) => document.getElementById(id);
const MAX_SHOWN_ENTROPY = 6; // nats: the colour scale's red end
const LAYERS = ["sampling", "pruning", "scheduling", "switching", "speculative",
  "sparse_prefill", "kv_compression"];

const state = { model: null, tokens: [], target: null, abort: null, entropicTime: null };

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

// The server's own words: OpenAI's {"error": {"message", "param"}} where it sends one.
async function errorOf(response) {
  try {
    const body = await response.json();
    if (body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (_) { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

async function loadServerInfo() {
  const response = await fetch("v1/models", { headers: headers() });
  if (!response.ok) {
    $("server-info").textContent = `The server refused /v1/models: ${await errorOf(response)}`;
    return;
  }
  const model = (await response.json()).data[0];
  state.model = model.id;
  $("server-info").textContent = `Model ${model.id}, context ${model.max_model_len} tokens.`;
  const control = (model.etinfer && model.etinfer.control) || {};
  $("layers").replaceChildren(...LAYERS.map((name) => {
    const item = document.createElement("li");
    const value = control[name];
    item.className = value ? "on" : "";
    item.textContent = `${name.replace("_", " ")}: ${value ? (value === true ? "on" : value) : "off"}`;
    return item;
  }));
  if (control.entropy_target) state.serverTarget = control.entropy_target;
}

function requestBody() {
  const chat = document.querySelector("input[name=mode]:checked").value === "chat";
  const text = $("prompt").value;
  const body = {
    model: state.model || "default",
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: Number($("max-tokens").value),
    temperature: Number($("temperature").value),
  };
  const target = $("entropy-target").value;
  if (target !== "") {
    body.entropy_target = Number(target);
    body.entropy_control = $("entropy-control").value;
  }
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  // A grammar: tokens it forces are outlined (the colour stays the model's own entropy).
  if ($("output-format").value === "json") body.structured_outputs = { json_object: true };
  if (chat) {
    body.messages = [{ role: "user", content: text }];
    body.logprobs = true;
    body.top_logprobs = 5;
  } else {
    body.prompt = text;
    body.logprobs = 5;
  }
  return body;
}

// One entry per token of a chunk's choice: its text and log-probabilities, whichever endpoint.
function tokensOf(choice) {
  const lp = choice.logprobs;
  if (!lp) return [];
  if (lp.content) {
    return lp.content.map((t) => ({
      text: t.token, logprob: t.logprob,
      top: (t.top_logprobs || []).map((a) => [a.token, a.logprob]),
    }));
  }
  return (lp.tokens || []).map((text, i) => ({
    text, logprob: lp.token_logprobs[i],
    top: Object.entries((lp.top_logprobs || [])[i] || {}),
  }));
}

function colour(entropy) {
  if (entropy === null || entropy === undefined) return "#e4e7eb";
  const x = Math.min(entropy / MAX_SHOWN_ENTROPY, 1);
  return `hsl(${210 - 210 * x}, 80%, ${88 - 6 * x}%)`;
}

function addTokens(choice) {
  const signal = choice.etinfer || {};
  const fresh = tokensOf(choice);
  const output = $("output");
  fresh.forEach((token, i) => {
    token.entropy = (signal.entropies || [])[i];
    token.tempered = (signal.tempered_entropies || [])[i];
    token.temperature = (signal.temperatures || [])[i];
    token.blocks = (signal.blocks_kept || [])[i];
    token.model = (signal.token_models || [])[i];
    token.forced = (signal.forced || [])[i];
    token.masked = (signal.masked_entropies || [])[i];
    token.index = state.tokens.length;
    state.tokens.push(token);
    const span = document.createElement("span");
    span.className = token.forced ? "tok forced" : "tok";
    span.tabIndex = 0;
    span.dataset.index = token.index;
    span.style.background = colour(token.entropy);
    span.textContent = token.text;
    output.appendChild(span);
  });
  if (signal.entropic_time !== undefined) state.entropicTime = signal.entropic_time;
  scheduleDraw();
}

const fmt = (v, digits = 3) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits));

function showDetail(span) {
  const token = state.tokens[Number(span.dataset.index)];
  const rows = [
    ["token", JSON.stringify(token.text)],
    ["entropy", `${fmt(token.entropy)} nats`],
    ["tempered entropy", `${fmt(token.tempered)} nats`],
    ["temperature", fmt(token.temperature)],
    ["logprob", fmt(token.logprob)],
  ];
  if (token.blocks !== undefined) rows.push(["blocks kept", `${fmt(100 * token.blocks, 0)} %`]);
  if (token.model !== undefined) rows.push(["written by", token.model]);
  if (token.forced !== undefined) {
    rows.push(["forced by the grammar", token.forced ? "yes" : "no"]);
    rows.push(["masked entropy", `${fmt(token.masked)} nats`]);
  }
  const table = document.createElement("table");
  for (const [name, value] of rows) {
    const tr = table.insertRow();
    const th = document.createElement("th");
    th.textContent = name;
    tr.appendChild(th);
    tr.insertCell().textContent = value;
  }
  const detail = $("token-detail");
  detail.replaceChildren(table);
  if (token.top.length) {
    const alternatives = document.createElement("p");
    alternatives.textContent = "alternatives: " + token.top
      .map(([text, logprob]) => `${JSON.stringify(text)} ${fmt(Math.exp(logprob), 2)}`).join(", ");
    detail.appendChild(alternatives);
  }
  const box = span.getBoundingClientRect();
  detail.style.left = `${window.scrollX + Math.max(4, Math.min(box.left, window.innerWidth - 300))}px`;
  detail.style.top = `${window.scrollY + box.bottom + 6}px`;
  detail.hidden = false;
}

function hideDetail() { $("token-detail").hidden = true; }

// -- charts: redrawn at most once a frame, however fast the stream ------------------------
let drawPending = false;
function scheduleDraw() {
  if (drawPending) return;
  drawPending = true;
  requestAnimationFrame(() => { drawPending = false; drawCharts(); });
}

function prepare(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = Number(canvas.getAttribute("height"));
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  canvas.style.height = `${height}px`;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  ctx.clearRect(0, 0, width, height);
  return { ctx, width, height };
}

function line(ctx, values, x, y, colourName, dashed = false) {
  ctx.strokeStyle = colourName;
  ctx.lineWidth = 2;
  ctx.setLineDash(dashed ? [4, 3] : []);
  ctx.beginPath();
  let started = false;
  values.forEach((v, i) => {
    if (v === null || v === undefined) { started = false; return; }
    if (started) ctx.lineTo(x(i), y(v)); else ctx.moveTo(x(i), y(v));
    started = true;
  });
  ctx.stroke();
}

function axes(ctx, width, height, pad, top, label, rightTop, rightLabel) {
  ctx.fillStyle = "#4a5360";
  ctx.font = "12px system-ui, sans-serif";
  ctx.strokeStyle = "#c9ced6";
  ctx.setLineDash([]);
  ctx.strokeRect(pad, 8, width - 2 * pad, height - pad - 8);
  ctx.fillText(`${top.toFixed(1)} ${label}`, 4, 18);
  ctx.fillText("0", pad - 12, height - pad);
  if (rightTop !== undefined) ctx.fillText(`${rightTop.toFixed(1)} ${rightLabel}`, width - pad + 2, 18);
  ctx.fillText(`${state.tokens.length} tokens`, width / 2 - 20, height - 6);
}

function drawCharts() {
  const pad = 40;
  const tokens = state.tokens;
  const n = Math.max(tokens.length, 2);
  {
    const { ctx, width, height } = prepare($("signal-chart"));
    const entropies = tokens.map((t) => t.entropy);
    const top = Math.max(MAX_SHOWN_ENTROPY, ...entropies.filter((v) => v != null), state.target || 0);
    const tempTop = Math.max(2, ...tokens.map((t) => t.temperature || 0));
    const x = (i) => pad + (i / (n - 1)) * (width - 2 * pad);
    const y = (v) => height - pad - (v / top) * (height - pad - 8);
    const yT = (v) => height - pad - (v / tempTop) * (height - pad - 8);
    axes(ctx, width, height, pad, top, "nats", tempTop, "T");
    line(ctx, entropies, x, y, "#1f5fbf");
    line(ctx, tokens.map((t) => t.tempered), x, y, "#7a9cd6");
    ctx.save();
    line(ctx, tokens.map((t) => t.temperature), x, yT, "#c2410c");
    ctx.restore();
    if (state.target !== null) line(ctx, [state.target, state.target], (i) => (i ? width - pad : pad), y, "#14171c", true);
  }
  {
    const { ctx, width, height } = prepare($("time-chart"));
    let tau = 0;
    const times = tokens.map((t, i) => {
      const before = i ? tokens[i - 1].entropy : null;
      if (before != null && t.entropy != null) tau += Math.max(0, before - t.entropy);
      return tau;
    });
    const top = Math.max(1, tau);
    const x = (i) => pad + (i / (n - 1)) * (width - 2 * pad);
    const y = (v) => height - pad - (v / top) * (height - pad - 8);
    axes(ctx, width, height, pad, top, "nats");
    line(ctx, times, x, y, "#2f7d32");
  }
}

// -- one request ---------------------------------------------------------------------------
async function send(event) {
  event.preventDefault();
  showError("");
  hideDetail();
  state.tokens = [];
  state.entropicTime = null;
  const body = requestBody();
  state.target = body.entropy_target ?? null;
  $("output").replaceChildren();
  $("summary").textContent = "";
  $("send").disabled = true;
  $("stop").disabled = false;
  state.abort = new AbortController();
  const path = body.messages ? "v1/chat/completions" : "v1/completions";
  let usage = null;
  try {
    const response = await fetch(path, {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.abort.signal,
    });
    if (!response.ok) { showError(await errorOf(response)); return; }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end).trim();
        buffer = buffer.slice(end + 2);
        if (!event.startsWith("data:")) continue;
        const data = event.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) { showError(chunk.error.message); continue; }
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) addTokens(choice);
      }
    }
  } catch (error) {
    if (error.name !== "AbortError") showError(`The request failed: ${error.message}`);
  } finally {
    $("send").disabled = false;
    $("stop").disabled = true;
    state.abort = null;
    const parts = [`${state.tokens.length} tokens`];
    if (usage) parts.push(`${usage.prompt_tokens} prompt tokens`);
    if (state.entropicTime != null) parts.push(`entropic time ${fmt(state.entropicTime, 2)} nats`);
    $("summary").textContent = parts.join(", ");
    scheduleDraw();
  }
}

$("request-form").addEventListener("submit", send);
$("stop").addEventListener("click", () => state.abort && state.abort.abort());
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("request-form").requestSubmit();
});
$("api-key").addEventListener("change", loadServerInfo);
const output = $("output");
for (const kind of ["mouseover", "focusin"]) {
  output.addEventListener(kind, (e) => { if (e.target.classList.contains("tok")) showDetail(e.target); });
}
output.addEventListener("mouseout", hideDetail);
output.addEventListener("focusout", hideDetail);
document.addEventListener("keydown", (e) => { if (e.key === "Escape") hideDetail(); });
window.addEventListener("resize", scheduleDraw);
loadServerInfo();
scheduleDraw();
