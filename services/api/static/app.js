"use strict";
// The chat box speaks /v1/chat/completions (streamed, speech as PCM16); the Talk button /v1/realtime (OpenAI's
// Realtime protocol over a WebSocket). Plain browser APIs, no build step.

const RATE = 24000; // the mesh's speech, and the Realtime protocol's PCM16, in and out
const INPUT_AUDIO = { wav: "wav", "x-wav": "wav", wave: "wav", mpeg: "mp3", mp3: "mp3", flac: "flac", "x-flac": "flac",
                      ogg: "ogg", webm: "webm", mp4: "m4a", "x-m4a": "m4a", m4a: "m4a" };

// What the page has received and played: shown in the status line and read by its browser test.
const stats = { textDeltas: 0, audioChunks: 0, audioBytes: 0, scheduledSeconds: 0, answers: 0, errors: 0,
                micChunks: 0, realtimeEvents: 0, interruptions: 0 };
window.omni = stats;

const $ = (id) => document.getElementById(id);
const history = []; // the conversation as chat messages; the assistant's turns as their text
window.omniHistory = history;
let model = "", busy = null, realtime = null;

function authHeaders() {
  const key = $("key").value.trim();
  localStorage.setItem("omni-key", key);
  return key ? { authorization: `Bearer ${key}` } : {};
}

function status(text) {
  const s = stats;
  $("status").textContent = `${text}  ·  text deltas ${s.textDeltas}, audio ${s.audioChunks} chunks `
    + `(${(s.audioBytes / 2 / RATE).toFixed(1)} s), answers ${s.answers}, errors ${s.errors}`;
}

function turn(role, text = "") {
  const div = document.createElement("div");
  div.className = `turn ${role}`;
  div.textContent = text;
  $("log").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function fail(message) {
  stats.errors += 1;
  turn("error", message);
  status("error");
}

// -- speech out: PCM16 chunks scheduled back to back on one AudioContext --------------------------------------

class Player {
  constructor() { this.ctx = null; this.next = 0; this.sources = new Set(); this.carry = null; }

  play(b64) {
    this.ctx ??= new AudioContext({ sampleRate: RATE });
    let bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    if (this.carry) { // a sample split between two chunks
      const joined = new Uint8Array(this.carry.length + bytes.length);
      joined.set(this.carry); joined.set(bytes, this.carry.length);
      bytes = joined; this.carry = null;
    }
    if (bytes.length % 2) { this.carry = bytes.slice(-1); bytes = bytes.slice(0, -1); }
    stats.audioChunks += 1;
    stats.audioBytes += bytes.length;
    if (!bytes.length) return;
    const pcm = new Int16Array(bytes.buffer, bytes.byteOffset, bytes.length / 2);
    const buffer = this.ctx.createBuffer(1, pcm.length, RATE);
    const samples = buffer.getChannelData(0);
    for (let i = 0; i < pcm.length; i++) samples[i] = pcm[i] / 32768;
    const source = this.ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(this.ctx.destination);
    this.next = Math.max(this.next, this.ctx.currentTime + 0.02);
    source.start(this.next);
    this.next += buffer.duration;
    stats.scheduledSeconds += buffer.duration;
    this.sources.add(source);
    source.onended = () => this.sources.delete(source);
  }

  stop() { // barge-in: what is queued is not heard
    for (const s of this.sources) s.stop();
    this.sources.clear();
    this.carry = null;
    if (this.ctx) this.next = this.ctx.currentTime;
  }
}
const player = new Player();
window.omniPlayer = player;

// -- the chat box ------------------------------------------------------------------------------------------

function readAs(file, how) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(r.result);
    r.onerror = () => reject(r.error);
    how === "url" ? r.readAsDataURL(file) : r.readAsArrayBuffer(file);
  });
}

async function part(file) {
  const [kind, sub] = (file.type || "").split("/");
  const url = await readAs(file, "url");
  if (kind === "image") return { type: "image_url", image_url: { url } };
  if (kind === "video") return { type: "video_url", video_url: { url } };
  const ext = file.name.split(".").pop().toLowerCase();
  const format = INPUT_AUDIO[sub] ?? INPUT_AUDIO[ext];
  if (kind !== "audio" && !format) throw new Error(`${file.name}: not an image, audio or video file`);
  if (!format) throw new Error(`${file.name}: audio as ${sub || ext} is not taken (wav, mp3, flac, ogg, webm, m4a)`);
  return { type: "input_audio", input_audio: { data: url.slice(url.indexOf(",") + 1), format } };
}

function describe(content) {
  return content.map((p) => p.type === "text" ? p.text : `[${p.type.replace("_url", "").replace("input_", "")}]`).join(" ");
}

async function* events(response) { // Server-Sent Events: one JSON chunk per `data:` line, then [DONE]
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(event) {
  event.preventDefault();
  if (busy) return;
  const text = $("text").value.trim(), files = [...$("files").files];
  if (!text && !files.length) return;
  let content;
  try {
    content = await Promise.all(files.map(part));
  } catch (e) {
    return fail(e.message);
  }
  if (text) content.push({ type: "text", text });
  $("text").value = ""; $("files").value = ""; $("attached").textContent = "";
  turn("user", describe(content));
  history.push({ role: "user", content });
  const body = { model, messages: history, stream: true, stream_options: { include_usage: true } };
  const limit = parseInt($("maxTokens").value, 10);
  if (limit > 0) body.max_completion_tokens = limit;
  if ($("speak").checked) {
    body.modalities = ["text", "audio"];
    body.audio = { voice: $("voice").value, format: "pcm16" };
  }
  busy = new AbortController();
  const out = turn("assistant");
  let said = "", spoken = "";
  status("answering...");
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", signal: busy.signal,
      headers: { "content-type": "application/json", ...authHeaders() }, body: JSON.stringify(body) });
    if (!r.ok) {
      const e = await r.json().catch(() => ({}));
      throw new Error(e.error?.message ?? `HTTP ${r.status}`);
    }
    for await (const chunk of events(r)) {
      const delta = chunk.choices?.[0]?.delta ?? {};
      if (delta.content) { said += delta.content; stats.textDeltas += 1; }
      if (delta.audio?.data) player.play(delta.audio.data);
      if (delta.audio?.transcript) spoken += delta.audio.transcript;
      out.textContent = said || spoken;
      status("answering...");
    }
    stats.answers += 1;
    history.push({ role: "assistant", content: said || spoken });
    status("done");
  } catch (e) {
    history.pop(); // the turn is not kept: sending it again asks the same
    out.remove();
    if (e.name !== "AbortError") fail(e.message); else status("stopped");
  } finally {
    busy = null;
  }
}

// -- talking: /v1/realtime ---------------------------------------------------------------------------------

function b64(bytes) {
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

class Realtime {
  async start() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const key = $("key").value.trim(); // browsers set no headers on a WebSocket: the key rides as a subprotocol
    const protocols = key ? ["realtime", `openai-insecure-api-key.${key}`] : ["realtime"];
    this.ws = new WebSocket(`${scheme}://${location.host}/v1/realtime?model=${encodeURIComponent(model)}`, protocols);
    this.ws.onmessage = (m) => this.on(JSON.parse(m.data));
    this.ws.onclose = () => this.stop();
    await new Promise((resolve, reject) => { this.ws.onopen = resolve; this.ws.onerror = () => reject(new Error("the realtime socket did not open")); });
    this.ws.send(JSON.stringify({ type: "session.update", session: {
      modalities: ["audio", "text"], voice: $("voice").value, input_audio_format: "pcm16",
      output_audio_format: "pcm16", turn_detection: { type: "server_vad" } } }));
    this.stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true } });
    this.ctx = new AudioContext({ sampleRate: RATE });
    await this.ctx.audioWorklet.addModule("capture.js");
    this.node = new AudioWorkletNode(this.ctx, "capture");
    this.node.port.onmessage = (m) => {
      if (this.ws.readyState !== WebSocket.OPEN) return;
      stats.micChunks += 1;
      this.ws.send(JSON.stringify({ type: "input_audio_buffer.append", audio: b64(new Uint8Array(m.data)) }));
    };
    this.ctx.createMediaStreamSource(this.stream).connect(this.node);
    this.out = null;
  }

  on(e) {
    stats.realtimeEvents += 1;
    switch (e.type) {
      case "input_audio_buffer.speech_started":
        if (player.sources.size) stats.interruptions += 1;
        player.stop(); // the server cancels the answer; what is queued here must stop too
        status("listening...");
        break;
      case "input_audio_buffer.committed":
        turn("user", "[speech]");
        break;
      case "response.created":
        this.out = turn("assistant");
        status("answering...");
        break;
      case "response.audio.delta":
      case "response.output_audio.delta":
        player.play(e.delta);
        status("answering...");
        break;
      case "response.audio_transcript.delta":
      case "response.output_audio_transcript.delta":
      case "response.text.delta":
      case "response.output_text.delta":
        if (this.out) this.out.textContent += e.delta;
        stats.textDeltas += 1;
        break;
      case "response.done":
        stats.answers += 1;
        status("listening...");
        break;
      case "error":
        fail(e.error?.message ?? "realtime error");
        break;
    }
  }

  stop() {
    this.stream?.getTracks().forEach((t) => t.stop());
    this.ctx?.close();
    if (this.ws?.readyState === WebSocket.OPEN) this.ws.close();
    this.stream = this.ctx = null;
    realtime = null;
    $("talk").classList.remove("on");
  }
}

async function talk() {
  if (realtime) return realtime.stop();
  realtime = new Realtime();
  $("talk").classList.add("on");
  try {
    await realtime.start();
    status("listening...");
  } catch (e) {
    realtime?.stop();
    fail(e.message);
  }
}

// -- start -------------------------------------------------------------------------------------------------

async function connect() {
  $("key").value = localStorage.getItem("omni-key") ?? "";
  try {
    const r = await fetch("/v1/models", { headers: authHeaders() });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error?.message ?? `HTTP ${r.status}`);
    const card = body.data[0];
    model = card.id;
    $("model").textContent = model;
    for (const v of card.voices ?? []) $("voice").append(new Option(v, v, v === card.default_voice, v === card.default_voice));
    status("ready");
  } catch (e) {
    $("model").textContent = "not connected";
    fail(`the server did not answer /v1/models: ${e.message}`);
  }
}

$("chat").addEventListener("submit", send);
$("text").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) send(e); });
$("files").addEventListener("change", () => { $("attached").textContent = [...$("files").files].map((f) => f.name).join(", "); });
$("talk").addEventListener("click", talk);
$("stop").addEventListener("click", () => { busy?.abort(); player.stop(); });
$("key").addEventListener("change", connect);
connect();
