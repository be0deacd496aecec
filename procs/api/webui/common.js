// What both pages share: calls to the server carrying the API key (asked for when a call gets 401, kept
// in this browser's localStorage), and writing text into the page (never markup).

const KEY_STORE = "batchserve.apiKey";

export class Unauthorized extends Error {}

export function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

export function headers(extra = {}) {
  const h = { ...extra };
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// fetch() with the key; a 401 opens the key form (once the key is saved, `retry` runs) and throws Unauthorized.
export async function call(path, options = {}, retry = null) {
  const response = await fetch(path, { ...options, headers: headers(options.headers || {}) });
  if (response.status === 401) {
    const body = await response.json().catch(() => ({}));
    askForKey(body.error ? body.error.message : "This server needs an API key.", retry);
    throw new Unauthorized("401");
  }
  return response;
}

// The key form, made on first use (both pages share it).
function keyForm() {
  let box = document.getElementById("key-form");
  if (box) return box;
  box = el("div", "", "hidden");
  box.id = "key-form";
  const form = el("form");
  const title = el("p");
  title.append(el("strong", "API key"));
  const message = el("p", "", "error");
  message.id = "key-message";
  const input = el("input");
  Object.assign(input, { id: "api-key", type: "password", autocomplete: "off", placeholder: "sk-..." });
  const save = el("button", "Use this key", "primary");
  Object.assign(save, { id: "save-key", type: "submit" });
  form.append(title, message, input, el("p"), save);
  box.append(form);
  document.body.append(box);
  return box;
}

export function askForKey(message, retry) {
  const box = keyForm();
  box.classList.remove("hidden");
  document.getElementById("key-message").textContent = message;
  const form = box.querySelector("form");
  const input = document.getElementById("api-key");
  input.value = apiKey();
  input.focus();
  form.onsubmit = (event) => {
    event.preventDefault();
    localStorage.setItem(KEY_STORE, input.value.trim());
    box.classList.add("hidden");
    if (retry) retry();
  };
}

// An element with text content only (model output and request ids are data, never markup).
export function el(tag, text = "", className = "") {
  const node = document.createElement(tag);
  if (text !== "") node.textContent = text;
  if (className) node.className = className;
  return node;
}

export function fmt(value, digits = 0) {
  if (value === null || value === undefined || value < 0 || Number.isNaN(value)) return "–";
  return Number(value).toFixed(digits);
}
