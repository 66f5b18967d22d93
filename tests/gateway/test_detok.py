"""Incremental detokenisation: deltas never split a character, stop strings are found across deltas."""

import random

import pytest

from services.gateway.detok import Detokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


TEXTS = ["plain ascii", "héllo wörld — ünïcode ✓", "日本語のテキスト", "emoji 🎉🚀 mixed 中文 and ascii", "a\nb\tc"]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_are_whole_characters_and_add_up(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(0)
    d = Detokenizer(tokenizer)
    deltas, i = [], 0
    while i < len(ids):  # feed 1 to 3 tokens at a time: multi-byte characters span tokens in a byte-level vocabulary
        n = rng.randint(1, 3)
        deltas.append(d.add(ids[i:i + n]))
        i += n
    deltas.append(d.flush())
    assert "".join(deltas) == text
    assert not any("\ufffd" in x for x in deltas)


def test_invalid_bytes_come_out_at_the_end_as_a_whole_decode_would(tokenizer):
    ids = tokenizer("ok", add_special_tokens=False)["input_ids"] + tokenizer("é", add_special_tokens=False)["input_ids"][:1]
    d = Detokenizer(tokenizer)
    out = d.add(ids) + d.flush()
    assert out == tokenizer.decode(ids) and out.endswith("\ufffd")


@pytest.mark.parametrize("stop", ["wor", "o w", "d", "héllo"])
def test_stop_strings_across_deltas(tokenizer, stop):
    text = "héllo wörld, hello world"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    d = Detokenizer(tokenizer, stop=[stop])
    out = ""
    for t in ids:
        out += d.add([t])
        if d.stopped:
            break
    out += d.flush()
    assert d.stopped and out == text[:text.find(stop)]


def test_held_text_is_released_when_no_stop_comes(tokenizer):
    d = Detokenizer(tokenizer, stop=["xyz"])
    ids = tokenizer("abcx", add_special_tokens=False)["input_ids"]
    assert d.add(ids) == "abc"  # "x" may begin "xyz"
    assert d.flush() == "x" and not d.stopped
