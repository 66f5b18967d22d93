"""A Converse session's conversation: user messages and the answer to them, by exchange, each with the tokens it
takes in a prompt (measured from a finished turn's usage, estimated for a stopped one); past a budget the oldest
exchanges leave first."""

from dataclasses import dataclass, field

from omni.v1 import omni_pb2
from services.gateway.vad import RATE
from services.model.spec import audio_tokens

MESSAGE_TOKENS = 4  # a chat message's own tokens: <|im_start|>, its role, a newline, <|im_end|>


@dataclass
class Exchange:
    id: str
    users: list[omni_pb2.Message] = field(default_factory=list)
    answer: str = ""
    answered: bool = False
    tokens: int = 0


class History:
    def __init__(self, session_id: str, budget: int, max_media: int, tokenizer, n_window: int):
        self.session_id, self.budget, self.max_media = session_id, budget, max_media
        self.tokenizer, self.n_window = tokenizer, n_window
        self.exchanges: list[Exchange] = []
        self.count = 0

    @property
    def open(self) -> Exchange | None:
        """The exchange whose user messages await an answer."""
        return self.exchanges[-1] if self.exchanges and not self.exchanges[-1].answered else None

    def add_user(self, parts: list[omni_pb2.Part]) -> Exchange:
        ex = self.open
        if ex is None:
            self.count += 1
            ex = Exchange(f"{self.session_id[:8]}-{self.count}")
            self.exchanges.append(ex)
        ex.users.append(omni_pb2.Message(role=omni_pb2.ROLE_USER, parts=parts))
        return ex

    def messages(self, instructions: str) -> list[omni_pb2.Message]:
        msgs = [omni_pb2.Message(role=omni_pb2.ROLE_SYSTEM, parts=[omni_pb2.Part(text=instructions)])] if instructions else []
        for ex in self.exchanges:
            msgs += ex.users
            if ex.answer:
                msgs.append(omni_pb2.Message(role=omni_pb2.ROLE_ASSISTANT, parts=[omni_pb2.Part(text=ex.answer)]))
        return msgs

    def answered(self, ex: Exchange, answer: str, answer_tokens: int, prompt_tokens: int | None) -> None:
        """`prompt_tokens`: the finished turn's, which held every exchange kept and this one's user messages."""
        ex.answer, ex.answered = answer, True
        if prompt_tokens is None:
            ex.tokens = self._estimate(ex, answer_tokens)
        else:
            earlier = sum(e.tokens for e in self.exchanges if e is not ex)
            ex.tokens = max(0, prompt_tokens + answer_tokens + MESSAGE_TOKENS - earlier)

    def forget(self, ex: Exchange) -> None:
        self.exchanges.remove(ex)

    def clear(self) -> None:
        self.exchanges.clear()

    def media(self) -> int:
        return sum(1 for e in self.exchanges for m in e.users for p in m.parts if not p.HasField("text"))

    def truncate(self) -> omni_pb2.HistoryTruncated | None:
        """Drops the oldest answered exchanges while those kept are over the token budget, or hold more media items
        (each turn's audio is one) than a request may."""
        dropped, tokens = 0, 0
        while self.exchanges and self.exchanges[0].answered and (
                sum(e.tokens for e in self.exchanges) > self.budget or self.media() > self.max_media):
            tokens += self.exchanges.pop(0).tokens
            dropped += 1
        return omni_pb2.HistoryTruncated(turns_dropped=dropped, tokens_dropped=tokens,
                                         turns_kept=len(self.exchanges)) if dropped else None

    def _estimate(self, ex: Exchange, answer_tokens: int) -> int:
        """A stopped turn's tokens: its text and raw audio counted as the prompt would count them (other media not)."""
        n = answer_tokens + MESSAGE_TOKENS
        for m in ex.users:
            n += MESSAGE_TOKENS
            for p in m.parts:
                if p.HasField("text"):
                    n += len(self.tokenizer.encode(p.text, add_special_tokens=False))
                elif p.HasField("audio") and p.audio.HasField("pcm"):
                    n += audio_tokens(len(p.audio.pcm.data) // 2 // (RATE // 100), self.n_window) + 2  # and its start, end
        return n
