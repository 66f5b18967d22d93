"""Batched sampling against the per-request reference and against the distribution it must draw from."""

import pytest
import torch

from services.llm.sampling import SamplingParams, sample_batch, sample_next


def test_greedy_rows_match_the_reference_with_penalties_and_minimum_lengths():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.3), SamplingParams(min_tokens=3, stop_token_ids=(7,)),
              SamplingParams(repetition_penalty=0.7, min_tokens=1, stop_token_ids=(int(logits[3].argmax()),)),
              SamplingParams(), SamplingParams(repetition_penalty=2.0)]
    seen = [None, torch.tensor([int(logits[1].argmax()), 3]), None, torch.tensor([1, 2]), None, logits[5].topk(5).indices]
    generated = [0, 0, 1, 0, 5, 0]
    out = sample_batch(logits, params, seen, generated)
    ref = [sample_next(logits[i], params[i], generated[i], seen[i]) for i in range(6)]
    assert out.tolist() == ref


def test_samples_follow_temperature_top_k_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 20000
    cases = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=3), SamplingParams(temperature=1.0, top_p=0.7)]
    for p in cases:
        draws = sample_batch(logits.expand(n, -1), [p] * n)
        freq = torch.bincount(draws, minlength=6).float() / n
        z = logits[0] / p.temperature
        if p.top_k:
            z = z.masked_fill(z < z.topk(p.top_k).values[-1], float("-inf"))
        probs = z.softmax(-1)
        if p.top_p < 1:
            keep = probs.cumsum(-1) - probs <= p.top_p  # logits here are sorted already
            probs = torch.where(keep, probs, 0.0)
            probs = probs / probs.sum()
        assert (freq - probs).abs().max() < 0.015, (p, freq, probs)
        assert freq[probs == 0].sum() == 0


def test_seeded_rows_repeat_and_do_not_depend_on_their_neighbours():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    logits[2] = logits[0]
    p = SamplingParams(temperature=1.0, seed=5)

    def run(neighbour_seed):
        neighbour = SamplingParams(temperature=1.0, seed=neighbour_seed)
        return sample_batch(logits, [p, neighbour, p, SamplingParams()], counters=[4, 4, 4, 0])

    a, b = run(5), run(6)
    assert a[0] == b[0] and a[0] == a[2] and a[3] == logits[3].argmax()


def test_hashed_noise_rows_repeat_by_seed_and_counter_and_follow_the_distribution():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    logits[2] = logits[0]
    p = SamplingParams(temperature=1.0, seed=9)

    def run(neighbour_seed, counter=3):
        params = [p, SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=neighbour_seed), p]
        return sample_batch(logits, params, counters=[counter, 0, counter, counter + 1])

    a, b = run(9), run(10)
    assert a[0] == b[0] and a[0] == a[2]  # same seed and counter, same token, whoever the neighbours are
    draws = {int(run(9, c)[0]) for c in range(40)}
    assert len(draws) > 3  # the counter moves the draw on
    # Over many counters, the draws follow the softmax.
    small = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 20000
    draws = sample_batch(small.expand(n, -1), [SamplingParams(temperature=1.0, seed=77)] * n, counters=list(range(n)))
    freq = torch.bincount(draws, minlength=6).float() / n
    assert (freq - small[0].softmax(-1)).abs().max() < 0.015


def test_batched_penalties_and_suppression_equal_the_per_row_reference():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 40, generator=g) * 3
    top = logits.argsort(-1, descending=True)
    shared, other = torch.tensor([int(top[0, 0]), 5, 6]), torch.tensor([int(top[4, 0])])
    params = [SamplingParams(repetition_penalty=1.5)] * 3 + [SamplingParams(repetition_penalty=0.8, min_tokens=2, stop_token_ids=(int(top[3, 0]),)),
                                                            SamplingParams(), SamplingParams(repetition_penalty=1.2), SamplingParams(repetition_penalty=3.0)]
    seen = [top[0, :3].tolist() + [int(top[0, 0])] * 2,  # duplicates
            [int(top[1, 0])], [], top[3, :6].tolist(), None, top[5, :2], top[6, :1].tolist()]  # a tensor among lists
    suppress = [shared, None, shared, None, other, shared, None]
    generated = [0, 0, 0, 1, 0, 0, 0]
    out = sample_batch(logits, params, seen, generated, suppress)
    ref = [sample_next(logits[i], params[i], generated[i], None if seen[i] is None else torch.as_tensor(seen[i], dtype=torch.long),
                       suppress[i]) for i in range(7)]
    assert out.tolist() == ref
    assert out[0] != top[0, 0] and out[4] != top[4, 0]  # the suppressed best token is never chosen


def test_tensor_settings_draw_what_sample_batch_draws():
    """sample_tensors (every setting a tensor, for graphs) against sample_batch, row for row."""
    from services.llm.sampling import sample_tensors

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(4)) * 2
    params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.8, seed=3), SamplingParams(),
              SamplingParams(temperature=1.0, top_k=50, top_p=1.0, seed=11), SamplingParams(temperature=0.5, top_k=10, seed=2),
              SamplingParams(temperature=1.3, top_k=50, top_p=0.5, seed=8), SamplingParams()]
    counters = [5, 0, 9, 1, 44, 0]
    for step in range(20):
        c = [x + 16 * step for x in counters]
        expected = sample_batch(logits, params, counters=c)
        args = (logits, torch.tensor([p.temperature for p in params]), torch.tensor([p.top_k for p in params]),
                torch.tensor([p.top_p for p in params]), torch.tensor([p.seed for p in params]), torch.tensor(c), 50)
        assert sample_tensors(*args).tolist() == expected.tolist()


@pytest.mark.parametrize("vocab", [4096, 8192])  # candidates by one sort of the row, and by a top-k
def test_tied_logits_draw_the_same_token_whatever_the_candidate_count_or_batch(vocab):
    """bf16 logits tie often, and topk orders ties as its kernel happens to (it differs with k and the batch):
    a row draws the same token from sample_batch beside rows with other top-ks, from sample_tensors over the
    graph's CANDIDATES, and from either alone (the case a decode graph's own draw met on the H200)."""
    from services.llm.sampling import CANDIDATES, SORTED_VOCAB, sample_tensors

    assert (vocab <= SORTED_VOCAB) == (vocab == 4096)
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(16, vocab, generator=gen) * 3).to(torch.bfloat16)
    logits[:, torch.randperm(vocab, generator=gen)[:40]] = logits.max(-1, keepdim=True).values  # 40-way ties at the top
    row = [SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=i + 1) for i in range(16)]
    wide = [SamplingParams(temperature=0.7, top_p=0.8, top_k=50, seed=99)]
    for counter in range(6):
        c = [counter] * 16
        alone = sample_batch(logits, row, counters=c).tolist()
        assert sample_batch(torch.cat([logits, logits[:1]]), row + wide, counters=c + [0])[:16].tolist() == alone
        assert [sample_batch(logits[i:i + 1], row[i:i + 1], counters=[counter]).item() for i in range(16)] == alone
        t = lambda values, dtype=None: torch.tensor(values, dtype=dtype)
        drawn = sample_tensors(logits, t([0.7] * 16), t([20] * 16), t([0.8] * 16), t(list(range(1, 17))), t(c), CANDIDATES)
        assert drawn.tolist() == alone
        assert len(set(alone)) > 1 and all(logits[i, tok] == logits[i].max() for i, tok in enumerate(alone))


def test_candidates_by_sorting_the_row_are_the_top_ks(monkeypatch):
    """Short rows find their candidates with one stable sort (sampling.SORTED_VOCAB), long ones with a top-k:
    the same candidates in the same order, their probabilities the same, ties inside the best k included."""
    from services.llm import sampling

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(8, 2048, generator=gen) * 3).to(torch.bfloat16).float()  # bf16 values: many ties
    logits[:, :6] = logits.max(-1, keepdim=True).values  # a run of equal logits inside the best k, by id
    temps, top_k, top_p = torch.full((8,), 0.7), torch.tensor([64, 20, 5, 64, 50, 1, 64, 30]), torch.full((8,), 0.9)
    probs, order = sampling._candidates(logits, temps, top_k, top_p, 64)
    monkeypatch.setattr(sampling, "SORTED_VOCAB", 0)
    top_probs, top_order = sampling._candidates(logits, temps, top_k, top_p, 64)
    kth = logits.topk(64).values[:, -1:]
    inside = (logits > kth).sum(-1)  # candidates above the 64th logit: the same set either way, in the same order
    for r in range(8):
        n = int(inside[r])
        assert torch.equal(order[r, :n], top_order[r, :n]) and torch.equal(probs[r, :n], top_probs[r, :n]), r
    assert order[:, :6].sort(-1).values.tolist() == [list(range(6))] * 8 and torch.equal(order[:, :6], top_order[:, :6])


def test_compiled_tensor_settings_draw_what_eager_draws():
    """sample_tensors as `compile: true` runs it in the code predictor (layers.fuse compiles it, shapes dynamic):
    the same tokens as eager for greedy and seeded rows, at two batch sizes."""
    from services.llm.sampling import sample_tensors

    compiled = torch.compile(sample_tensors, dynamic=True)
    logits = (torch.randn(24, 512, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    temps, top_k, top_p = torch.tensor([0.0, 1.0, 0.7] * 8), torch.tensor([50, 50, 20] * 8), torch.tensor([1.0, 0.8, 0.95] * 8)
    seeds, counters = torch.arange(1, 25) * 7919, torch.arange(24) * 15
    for b in (24, 8):
        args = (logits[:b], temps[:b], top_k[:b], top_p[:b], seeds[:b], counters[:b], 50)
        assert torch.equal(compiled(*args), sample_tensors(*args))


def test_argmax_in_chunks_is_argmax():
    """sampling.argmax_rows: a vocabulary that splits into 256 chunks is reduced chunk by chunk, then across them;
    the first of equal maxima wins, as with argmax, whether they share a chunk or not; eager and compiled."""
    from services.llm.sampling import argmax_rows

    v = 152064  # the thinker's vocabulary: 256 chunks of 594
    x = torch.randn(6, v, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).float()
    x[1, [5, 600, 151000]] = 9.0  # ties in three chunks
    x[2, [700, 701]] = 9.0  # ties in one chunk
    x[3] = 0.0  # every logit equal
    x[4, v - 1] = 9.0  # in the last place
    x[5, :594] = -9.0  # the first chunk all low
    want = x.argmax(-1)
    assert want[:5].tolist() == [want[0].item(), 5, 700, 0, v - 1]
    assert torch.equal(argmax_rows(x), want)
    assert torch.equal(torch.compile(argmax_rows, dynamic=True)(x), want)
    small = torch.randn(3, 3072)  # the talker's codes: one reduction, as before
    assert torch.equal(argmax_rows(small), small.argmax(-1))
