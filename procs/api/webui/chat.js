// The chat playground: streamed chat completions from the served model (or one of its LoRA adapters),
// conversations kept in this browser's localStorage, and per answer its time to first token, tokens/s
// and cached prompt tokens (from the stream's usage chunk).
import { Unauthorized, askForKey, call, el, fmt } from "./common.js";

const STORE = "batchserve.conversations";
const $ = (id) => document.getElementById(id);

let conversations = load();
let current = conversations.length ? conversations[0].id : null;
let controller = null; // the answer streaming now: its AbortController

function load() {
  try { return JSON.parse(localStorage.getItem(STORE)) || []; } catch { return []; }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversations));
}

function conversation() {
  let found = conversations.find((c) => c.id === current);
  if (!found) {
    found = { id: `c${Date.now()}`, title: "New chat", messages: [] };
    conversations.unshift(found);
    current = found.id;
  }
  return found;
}

function renderList() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of conversations) {
    const item = el("li", "", c.id === current ? "current" : "");
    item.append(el("span", c.title));
    const remove = el("button", "×");
    remove.title = "Delete";
    remove.onclick = (event) => {
      event.stopPropagation();
      conversations = conversations.filter((x) => x.id !== c.id);
      if (current === c.id) current = conversations.length ? conversations[0].id : null;
      save(); render();
    };
    item.append(remove);
    item.onclick = () => { if (!controller) { current = c.id; render(); } };
    list.append(item);
  }
}

function messageNode(message) {
  const node = el("div", "", `message ${message.role}`);
  node.append(el("div", message.role === "user" ? "You" : (message.model || "Assistant"), "role"));
  const details = el("details", "", "reasoning");
  details.append(el("summary", "Reasoning"), el("div", message.reasoning || ""));
  details.classList.toggle("hidden", !message.reasoning);
  node.append(details, el("div", message.content || "", "content"), el("div", message.stats || "", "stats"));
  if (message.state) node.dataset.state = message.state;
  return node;
}

function render() {
  renderList();
  const box = $("messages");
  box.replaceChildren(...(conversations.find((c) => c.id === current)?.messages || []).map(messageNode));
  box.scrollTop = box.scrollHeight;
}

function numberOf(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

function requestBody(history) {
  const system = $("system").value.trim();
  const body = {
    model: $("model").value,
    messages: [...(system ? [{ role: "system", content: system }] : []),
               ...history.map((m) => ({ role: m.role, content: m.content }))],
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberOf("temperature"),
    top_p: numberOf("top-p"),
    max_tokens: numberOf("max-tokens"),
    seed: numberOf("seed"),
  };
  const stop = $("stop").value.split("\n").filter((s) => s !== "");
  if (stop.length) body.stop = stop;
  const schema = $("json-schema").value.trim();
  if (schema) {
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(schema) } };
  }
  return body;
}

// Server-sent events of a streamed answer, one parsed `data:` payload at a time.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffered += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      const event = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function statsText(answer, timing, usage) {
  const parts = [`TTFT ${fmt(timing.ttft_ms)} ms`];
  if (usage) {
    const decoding_s = (timing.end - timing.first) / 1000;
    const rate = usage.completion_tokens > 1 && decoding_s > 0 ? (usage.completion_tokens - 1) / decoding_s : -1;
    parts.push(`${usage.completion_tokens} tokens`, `${fmt(rate, 1)} tok/s`,
               `${usage.prompt_tokens_details?.cached_tokens ?? 0} of ${usage.prompt_tokens} prompt tokens cached`);
  }
  return parts.join(" · ");
}

async function stream(answer, node, body) {
  const timing = { start: performance.now(), first: 0, end: 0, ttft_ms: -1 };
  let usage = null;
  controller = new AbortController();
  const response = await call("/v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    signal: controller.signal,
  }, () => send(true));
  if (!response.ok) {
    const error = await response.json().catch(() => ({}));
    throw new Error(error.error ? error.error.message : `HTTP ${response.status}`);
  }
  for await (const chunk of events(response)) {
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) usage = chunk.usage;
    const delta = chunk.choices?.[0]?.delta;
    if (!delta) continue;
    if ((delta.content || delta.reasoning_content) && !timing.first) {
      timing.first = performance.now();
      timing.ttft_ms = timing.first - timing.start;
    }
    if (delta.reasoning_content) {
      answer.reasoning = (answer.reasoning || "") + delta.reasoning_content;
      node.querySelector("details.reasoning").classList.remove("hidden");
      node.querySelector("details.reasoning div").textContent = answer.reasoning;
    }
    if (delta.content) {
      answer.content += delta.content;
      node.querySelector(".content").textContent = answer.content;
    }
    $("messages").scrollTop = $("messages").scrollHeight;
  }
  timing.end = performance.now();
  answer.stats = statsText(answer, timing, usage);
}

async function send(retrying = false) {
  const text = $("prompt").value;
  if (controller || (!text.trim() && !retrying)) return;
  const chat = conversation();
  if (!retrying) {
    chat.messages.push({ role: "user", content: text });
    if (chat.title === "New chat") chat.title = text.slice(0, 40);
    $("prompt").value = "";
  } else if (chat.messages.at(-1)?.role === "assistant") {
    chat.messages.pop(); // the answer a missing key refused
  }
  let body;
  try { body = requestBody(chat.messages); } catch (error) { alert(`JSON schema: ${error.message}`); return; }
  const answer = { role: "assistant", content: "", model: body.model, state: "streaming" };
  chat.messages.push(answer);
  render();
  const node = $("messages").lastElementChild;
  node.dataset.state = "streaming";
  $("send").disabled = true;
  $("stop-button").disabled = false;
  try {
    await stream(answer, node, body);
    answer.state = "done";
  } catch (error) {
    if (error.name === "AbortError") {
      answer.state = "stopped";
      answer.stats = answer.stats || "";
    } else if (error instanceof Unauthorized) {
      answer.state = "error";
      answer.content = "This server needs an API key.";
    } else {
      answer.state = "error";
      answer.content = answer.content || String(error.message);
    }
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop-button").disabled = true;
    save();
    render();
  }
}

async function loadModels() {
  try {
    const response = await call("/v1/models", {}, loadModels);
    const models = (await response.json()).data || [];
    const select = $("model");
    select.replaceChildren(...models.map((m) => {
      const option = el("option", m.parent ? `${m.id} (adapter of ${m.parent})` : m.id);
      option.value = m.id;
      return option;
    }));
    $("server-model").textContent = models.length ? `serving ${models.find((m) => !m.parent)?.id || models[0].id}` : "";
  } catch (error) {
    if (!(error instanceof Unauthorized)) $("server-model").textContent = `server unreachable: ${error.message}`;
  }
}

$("send").onclick = () => send();
$("stop-button").onclick = () => { if (controller) controller.abort(); };
$("new-chat").onclick = () => { if (!controller) { current = null; conversation(); save(); render(); } };
$("change-key").onclick = () => askForKey("Enter an API key for this server.", loadModels);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); send(); }
});
render();
loadModels();
