// The browser page: the microphone and the answer's speech over /v1/realtime (OpenAI's Realtime protocol), PCM16
// at 24 kHz both ways, and a chat box for text, images and audio files.
"use strict";

const RATE = 24000;
const $ = (id) => document.getElementById(id);
// What the page saw, for whoever drives it (the tests read it)
const state = window.omni = { events: [], audioBytes: 0, done: [], interrupted: 0, connected: false };

let ws = null, ctx = null, mic = null, answering = null, answerBytes = 0, playHead = 0, sources = [];

function say(who, text, cls) {
  const li = document.createElement("li");
  li.className = cls || who;
  li.innerHTML = `<span class="who"></span><span class="text"></span>`;
  li.querySelector(".who").textContent = who;
  li.querySelector(".text").textContent = text;
  $("conversation").appendChild(li);
  li.scrollIntoView();
  return li.querySelector(".text");
}

function b64(bytes) {
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

function pcm16(floats) {
  const out = new Int16Array(floats.length);
  for (let i = 0; i < floats.length; i++) out[i] = Math.max(-1, Math.min(1, floats[i])) * 32767;
  return new Uint8Array(out.buffer);
}

function send(event) {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(event));
}

function audioContext() {
  // One context at the protocol's rate: the browser resamples the microphone and the speakers to it
  if (!ctx) ctx = new AudioContext({ sampleRate: RATE });
  return ctx;
}

function play(base64) {
  const bytes = Uint8Array.from(atob(base64), (c) => c.charCodeAt(0));
  state.audioBytes += bytes.length;
  answerBytes += bytes.length;
  const samples = new Int16Array(bytes.buffer, 0, bytes.length >> 1);
  const c = audioContext(), buf = c.createBuffer(1, samples.length, RATE);
  const ch = buf.getChannelData(0);
  for (let i = 0; i < samples.length; i++) ch[i] = samples[i] / 32768;
  const src = c.createBufferSource();
  src.buffer = buf;
  src.connect(c.destination);
  playHead = Math.max(playHead, c.currentTime);
  src.start(playHead);
  playHead += buf.duration;
  sources.push(src);
  src.onended = () => { sources = sources.filter((s) => s !== src); };
}

function silence() {
  for (const s of sources) s.stop();
  sources = [];
  playHead = 0;
}

// More session fields from the address, e.g. ?session={"max_output_tokens":64} (sampling for a demo, or a test)
const extra = JSON.parse(new URLSearchParams(location.search).get("session") || "{}");

function sessionUpdate() {
  send({ type: "session.update", session: { type: "realtime", output_modalities: ["audio"], ...extra,
    audio: { input: { turn_detection: $("vad").checked ? { type: "server_vad" } : null } } } });
  $("commit").disabled = !mic || $("vad").checked;
}

function handle(e) {
  state.events.push(e.type);
  switch (e.type) {
    case "session.created":
      state.connected = true;
      $("status").textContent = `connected to ${e.session.model}`;
      sessionUpdate();
      break;
    case "input_audio_buffer.speech_started":
      silence();  // the user speaks over the answer: the server has stopped it, stop playing it too
      $("status").textContent = "listening";
      break;
    case "input_audio_buffer.committed":
      say("you", "(spoken)", "user");
      break;
    case "response.created":
      answering = say("assistant", "");
      answerBytes = 0;
      $("stop").disabled = false;
      break;
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta":
      if (answering) answering.textContent += e.delta;
      break;
    case "response.output_audio.delta":
      play(e.delta);
      break;
    case "response.done": {
      const content = (e.response.output[0] || { content: [{}] }).content[0] || {};
      if (answering) answering.textContent = content.transcript ?? content.text ?? answering.textContent;
      if (e.response.status !== "completed" && answering) answering.textContent += " (stopped)";
      const reason = (e.response.status_details || {}).reason || null;
      if (reason === "turn_detected") state.interrupted += 1;  // the user spoke over it
      state.done.push({ status: e.response.status, reason, audioBytes: answerBytes,
        transcript: answering ? answering.textContent : "", usage: e.response.usage });
      answering = null;
      $("stop").disabled = true;
      $("status").textContent = `answered (${e.response.usage.input_tokens} tokens in, ${e.response.usage.output_tokens} out)`;
      break;
    }
    case "error":
      say("error", e.error.message, "error");
      break;
  }
}

function connect() {
  return new Promise((resolve) => {
    if (ws) return resolve();
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const key = new URLSearchParams(location.search).get("key");
    // A browser cannot set headers on a WebSocket: the key rides in a subprotocol, as OpenAI's browser clients send it
    ws = new WebSocket(`${scheme}://${location.host}/v1/realtime`, key ? ["realtime", `openai-insecure-api-key.${key}`] : []);
    ws.onmessage = (m) => { handle(JSON.parse(m.data)); if (state.connected) resolve(); };
    ws.onclose = () => { ws = null; state.connected = false; $("status").textContent = "disconnected"; };
  });
}

async function startMic() {
  await connect();
  const c = audioContext();
  await c.resume();
  const stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true } });
  const input = c.createMediaStreamSource(stream);
  // ScriptProcessor needs no module file: the page stays plain static files
  const proc = c.createScriptProcessor(2048, 1, 1);
  proc.onaudioprocess = (ev) => send({ type: "input_audio_buffer.append", audio: b64(pcm16(ev.inputBuffer.getChannelData(0))) });
  input.connect(proc);
  proc.connect(c.destination);
  mic = { stream, proc, input };
  $("talk").textContent = "Stop talking";
  $("commit").disabled = $("vad").checked;
}

function stopMic() {
  mic.stream.getTracks().forEach((t) => t.stop());
  mic.proc.disconnect();
  mic.input.disconnect();
  mic = null;
  $("talk").textContent = "Start talking";
  $("commit").disabled = true;
}

function readAs(file, how) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(r.result);
    r.onerror = () => reject(r.error);
    r[how](file);
  });
}

async function audioFile(file) {
  // Decoded by the browser, resampled to the session's input format
  const decoded = await audioContext().decodeAudioData(await readAs(file, "readAsArrayBuffer"));
  const off = new OfflineAudioContext(1, Math.ceil(decoded.duration * RATE), RATE);
  const src = off.createBufferSource();
  src.buffer = decoded;
  src.connect(off.destination);
  src.start();
  return b64(pcm16((await off.startRendering()).getChannelData(0)));
}

async function sendChat(ev) {
  ev.preventDefault();
  await connect();
  const content = [];
  const text = $("text").value.trim();
  if (text) content.push({ type: "input_text", text });
  for (const f of $("files").files) {
    if (f.type.startsWith("image/")) content.push({ type: "input_image", image_url: await readAs(f, "readAsDataURL") });
    else content.push({ type: "input_audio", audio: await audioFile(f) });
  }
  if (!content.length) return;
  if (answering) send({ type: "response.cancel" });
  silence();
  say("you", [text, ...Array.from($("files").files, (f) => `[${f.name}]`)].filter(Boolean).join(" "), "user");
  send({ type: "conversation.item.create", item: { type: "message", role: "user", content } });
  send({ type: "response.create" });
  $("text").value = "";
  $("files").value = "";
}

$("talk").onclick = () => (mic ? stopMic() : startMic());
$("vad").onchange = sessionUpdate;
$("commit").onclick = () => { send({ type: "input_audio_buffer.commit" }); send({ type: "response.create" }); };
$("stop").onclick = () => { send({ type: "response.cancel" }); silence(); };
$("chat").onsubmit = sendChat;
connect();
