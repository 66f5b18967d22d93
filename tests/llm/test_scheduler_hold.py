"""A held sequence (its reader fell behind) gets no rows and keeps its KV blocks; let go, it decodes again."""

from services.llm.kv_cache import BlockAllocator
from services.llm.scheduler import Scheduler, SeqState


def test_a_held_sequence_is_skipped_and_keeps_its_blocks():
    s = Scheduler(BlockAllocator(16), block_size=4, max_tokens=64, max_seqs=4)
    a, b = SeqState([1, 2, 3], owner="a"), SeqState([4, 5, 6], owner="b")
    s.add(a)
    s.add(b)
    s.advance(s.schedule())  # both prompts in
    for seq in (a, b):
        seq.tokens.append(7)
    s.hold("a", True)
    work = s.schedule()
    assert [w.seq.owner for w in work] == ["b"] and a.blocks and a.computed == 3
    s.advance(work)
    s.hold("a", False)
    b.tokens.append(8)
    assert sorted(w.seq.owner for w in s.schedule()) == ["a", "b"]
