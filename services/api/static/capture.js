"use strict";
// The microphone as PCM16 at the context's rate (24 kHz), posted every 100 ms: the Realtime protocol's appends.

class Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.chunk = new Int16Array(Math.round(sampleRate / 10));
    this.filled = 0;
  }

  process(inputs) {
    const samples = inputs[0]?.[0];
    if (!samples) return true;
    for (let i = 0; i < samples.length; i++) {
      this.chunk[this.filled++] = Math.max(-1, Math.min(1, samples[i])) * 32767;
      if (this.filled === this.chunk.length) {
        this.port.postMessage(this.chunk.buffer, [this.chunk.buffer]);
        this.chunk = new Int16Array(this.chunk.length);
        this.filled = 0;
      }
    }
    return true;
  }
}

registerProcessor("capture", Capture);
