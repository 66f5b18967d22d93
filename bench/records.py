"""What one request measured, and the figures of a cell computed from its requests."""

from dataclasses import asdict, dataclass, field

import numpy as np

PCM16_RATE = 24000


@dataclass
class RequestRecord:
    index: int
    start: float  # perf_counter seconds, client clock
    end: float = 0.0
    ttft: float | None = None  # to the first text delta carrying tokens
    ttfa: float | None = None  # to the first audio chunk
    text_tokens: int = 0  # token ids counted in the text deltas
    text_deltas: int = 0
    itl: list[float] = field(default_factory=list)  # gap to each later delta / its tokens: seconds per token
    audio_samples: int = 0  # 24 kHz samples received
    audio_chunks: int = 0
    audio_frames: int = 0  # usage.audio_frames of the final message
    usage_tokens: int = 0  # usage.completion_tokens of the final message
    prompt_tokens: int = 0
    # The gateway's own view (usage of the final message): client minus server is the client's and the wire's share.
    server_ttft: float | None = None
    server_ttfa: float | None = None
    stage_seconds: dict[str, float] = field(default_factory=dict)  # usage.timings: preprocess, encode, thinker_*, talker, ...
    finished: bool = False
    error: str = ""  # gRPC status code name, or an exception's class
    detail: str = ""

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def audio_seconds(self) -> float:
        return self.audio_samples / PCM16_RATE

    @property
    def ok(self) -> bool:
        return self.finished and not self.error

    def as_dict(self) -> dict:
        d = asdict(self)
        d["itl"] = [round(x, 6) for x in self.itl]
        return d


def percentile(values, q: float) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[RequestRecord], duration: float) -> dict:
    """Per-cell figures over the measured requests; throughput counts successful requests only."""
    ok = [r for r in records if r.ok]
    failures: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = r.error or "UNFINISHED"
            failures[key] = failures.get(key, 0) + 1
    tokens = sum(r.text_tokens for r in ok)
    audio = sum(r.audio_seconds for r in ok)
    speech = [r for r in ok if r.audio_samples]
    itl = [x for r in ok for x in r.itl]
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    return {
        "requests": len(records),
        "failures": len(records) - len(ok),
        "failure_codes": failures,
        "first_error": next((f"{r.error}: {r.detail}" for r in records if r.error), ""),
        "duration_s": duration,
        "output_tok_per_s": per_s(tokens),
        "req_per_s": per_s(len(ok)),
        "audio_s_per_s": per_s(audio),
        "text_tokens": tokens,
        "audio_s": audio,
        "ttft_p50": percentile([r.ttft for r in ok], 50),
        "ttft_p99": percentile([r.ttft for r in ok], 99),
        "ttfa_p50": percentile([r.ttfa for r in speech], 50),
        "ttfa_p99": percentile([r.ttfa for r in speech], 99),
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
        "e2e_p50": percentile([r.latency for r in ok], 50),
        "e2e_p99": percentile([r.latency for r in ok], 99),
        "rtf_p50": percentile([r.latency / r.audio_seconds for r in speech], 50),
        "prompt_tokens_p50": percentile([r.prompt_tokens for r in ok if r.prompt_tokens], 50),
        "server_ttft_p50": percentile([r.server_ttft for r in ok], 50),
        "server_ttfa_p50": percentile([r.server_ttfa for r in speech], 50),
        "stage_seconds_p50": {stage: percentile([r.stage_seconds.get(stage) for r in ok], 50)
                              for stage in dict.fromkeys(k for r in ok for k in r.stage_seconds)},
    }
