"""The HTTP door's section of a mesh's config (services/runtime/config.py): the OpenAI-compatible api process."""

from dataclasses import dataclass, field

from services.runtime.stage_config import Replica


@dataclass
class ApiConfig:
    replicas: list[Replica] = field(default_factory=list)
    """Where each api process listens for HTTP (`port`) and serves its Prometheus metrics (`metrics_port`)."""
    keys: list[str] = field(default_factory=list)
    """API keys a client must send as `Authorization: Bearer KEY`; empty: no authentication."""
    allow_url_fetch: bool = False
    """Fetch media given as http(s) URLs (bounded by the request size limit); off: such URLs are answered 400."""
    audio_expiry_s: float = 3600.0
    """How long a chat reply's audio can be referred back to by its `audio.id` in a later turn."""
    request_timeout_s: float = 600.0
    """A request not finished after this long is cut and answered 504 (its deadline at the gateway); 0: none."""
