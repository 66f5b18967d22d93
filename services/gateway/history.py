"""A Converse session's conversation: user messages and the answer to them, by exchange, each with the tokens it
takes in a prompt (measured from a turn's usage, estimated where its prompt was never laid out); past a budget the
oldest exchanges leave first. Every user message and answer is an item with an id, which the client may delete, and
an answer's transcript may be cut to the audio the user heard."""

from dataclasses import dataclass, field

from omni.v1 import omni_pb2
from services.gateway.vad import RATE
from services.model.spec import audio_tokens

MESSAGE_TOKENS = 4  # a chat message's own tokens: <|im_start|>, its role, a newline, <|im_end|>


@dataclass
class Exchange:
    id: str
    users: list[omni_pb2.Message] = field(default_factory=list)
    user_ids: list[str] = field(default_factory=list)  # the item id of each of `users`
    answer_id: str = ""  # the answer's item id, from the moment it starts
    answer: str = ""
    answer_tokens: list[int] = field(default_factory=list)  # the token ids of `answer`
    audio_frames: int = 0  # of the answer's speech that reached the client
    audio_samples: int = 0
    answered: bool = False
    tokens: int = 0


class History:
    def __init__(self, session_id: str, budget: int, max_media: int, tokenizer, n_window: int):
        self.session_id, self.budget, self.max_media = session_id, budget, max_media
        self.tokenizer, self.n_window = tokenizer, n_window
        self.exchanges: list[Exchange] = []
        self.count = self.items = 0

    @property
    def open(self) -> Exchange | None:
        """The exchange whose user messages await an answer."""
        return self.exchanges[-1] if self.exchanges and not self.exchanges[-1].answered else None

    def new_item_id(self) -> str:
        while True:  # a client may have taken a name like ours
            self.items += 1
            item_id = f"item_{self.session_id[:8]}_{self.items}"
            if self.find(item_id) is None:
                return item_id

    def find(self, item_id: str) -> Exchange | None:
        return next((e for e in self.exchanges if item_id in e.user_ids or item_id == e.answer_id), None)

    def add_user(self, parts: list[omni_pb2.Part], item_id: str) -> Exchange:
        ex = self.open
        if ex is None:
            self.count += 1
            ex = Exchange(f"{self.session_id[:8]}-{self.count}")
            self.exchanges.append(ex)
        ex.users.append(omni_pb2.Message(role=omni_pb2.ROLE_USER, parts=parts))
        ex.user_ids.append(item_id)
        return ex

    def messages(self, instructions: str) -> list[omni_pb2.Message]:
        msgs = [omni_pb2.Message(role=omni_pb2.ROLE_SYSTEM, parts=[omni_pb2.Part(text=instructions)])] if instructions else []
        for ex in self.exchanges:
            msgs += ex.users
            if ex.answer:
                msgs.append(omni_pb2.Message(role=omni_pb2.ROLE_ASSISTANT, parts=[omni_pb2.Part(text=ex.answer)]))
        return msgs

    def answered(self, ex: Exchange, answer: str, token_ids: list[int], prompt_tokens: int | None, frames: int = 0,
                 samples: int = 0) -> None:
        """`prompt_tokens`: the turn's, which held every exchange kept and this one's user messages."""
        ex.answer, ex.answer_tokens, ex.answered = answer, token_ids, True
        ex.audio_frames, ex.audio_samples = frames, samples
        if prompt_tokens is None:
            ex.tokens = self._estimate(ex, len(token_ids))
        else:
            earlier = sum(e.tokens for e in self.exchanges if e is not ex)
            ex.tokens = max(0, prompt_tokens + len(token_ids) + MESSAGE_TOKENS - earlier)

    def delete(self, item_id: str) -> None:
        """Removes the item (a user message or an answer); an exchange left with neither leaves the conversation."""
        ex = self.find(item_id)
        if item_id == ex.answer_id:
            ex.tokens = max(0, ex.tokens - len(ex.answer_tokens) - MESSAGE_TOKENS)
            ex.answer_id, ex.answer, ex.answer_tokens = "", "", []
        else:
            i = ex.user_ids.index(item_id)
            ex.tokens = max(0, ex.tokens - self._message_tokens(ex.users[i]))
            del ex.users[i], ex.user_ids[i]
        if not ex.users and not ex.answer_id:
            self.exchanges.remove(ex)

    def cut(self, ex: Exchange, share: float, spoken_tokens) -> str:
        """The answer as far as the user heard it, `share` of its audio: its transcript now."""
        frames = int(ex.audio_frames * share)  # every frame is as many samples of speech, but for a short tail
        ids = ex.answer_tokens[:spoken_tokens(frames)]
        ex.tokens = max(0, ex.tokens - len(ex.answer_tokens) + len(ids))
        ex.answer = self.tokenizer.decode(ids, skip_special_tokens=True).strip()
        ex.answer_tokens, ex.audio_frames, ex.audio_samples = ids, frames, round(ex.audio_samples * share)
        return ex.answer

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
        return answer_tokens + MESSAGE_TOKENS + sum(self._message_tokens(m) for m in ex.users)

    def _message_tokens(self, m: omni_pb2.Message) -> int:
        """Its text and raw audio counted as the prompt would count them (other media not)."""
        n = MESSAGE_TOKENS
        for p in m.parts:
            if p.HasField("text"):
                n += len(self.tokenizer.encode(p.text, add_special_tokens=False))
            elif p.HasField("audio") and p.audio.HasField("pcm"):
                n += audio_tokens(len(p.audio.pcm.data) // 2 // (RATE // 100), self.n_window) + 2  # and its start, end
        return n
