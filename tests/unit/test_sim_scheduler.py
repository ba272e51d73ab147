"""Continuous batching, preemption, determinism and the timing model of the simulated engine."""
from __future__ import annotations

import asyncio

import pytest

from infera.engine.sim.cache import KVCache
from infera.engine.sim.scheduler import (
    DEFAULT_OUTPUT_VOCAB,
    MAX_NATURAL_LENGTH,
    MIN_NATURAL_LENGTH,
    Context,
    Scheduler,
    Sequence,
    context_digest,
    decode_time_ms,
    greedy_output,
    prefill_time_ms,
    step_time_ms,
)

FAST = 1e5  # speedup: a step takes well under a millisecond


@pytest.mark.parametrize("tokens,expected", [
    (0, 0.0),
    (1, 4.21e-7 + 0.0152 + 16.5),
    (1000, 0.421 + 15.2 + 16.5),
    (8192, 4.21e-7 * 8192**2 + 0.0152 * 8192 + 16.5),
])
def test_prefill_time(tokens, expected):
    assert prefill_time_ms(tokens) == pytest.approx(expected)


@pytest.mark.parametrize("usage,expected", [
    (0.0, 5.74),
    (0.5, -25.74 * 0.25 + 54.01 * 0.5 + 5.74),
    (1.0, -25.74 + 54.01 + 5.74),
])
def test_decode_time(usage, expected):
    assert decode_time_ms(usage) == pytest.approx(expected)


@pytest.mark.parametrize("prefill,decode,usage,speedup,expected", [
    (0, False, 0.3, 1.0, 0.0),
    (0, True, 0.0, 1.0, 5.74),
    (1000, False, 0.0, 1.0, 32.121),
    (1000, True, 0.0, 2.0, (32.121 + 5.74) / 2),
])
def test_step_time(prefill, decode, usage, speedup, expected):
    assert step_time_ms(prefill, decode, usage, speedup) == pytest.approx(expected)


def test_natural_length_range_and_determinism():
    # Prompts that end in a non-output token (5), as a chat template's generation prompt does.
    lengths = [len(greedy_output(0, [i + 100, 5], DEFAULT_OUTPUT_VOCAB, 1000)[0]) for i in range(500)]
    assert all(MIN_NATURAL_LENGTH <= n <= MAX_NATURAL_LENGTH for n in lengths)
    assert len(set(lengths)) > 50  # actually spread out
    assert 100 < sum(lengths) / len(lengths) < 165  # uniform in [8, 256]: mean 132
    assert lengths == [len(greedy_output(0, [i + 100, 5], DEFAULT_OUTPUT_VOCAB, 1000)[0]) for i in range(500)]


def test_a_prompt_ending_in_output_words_counts_them_toward_the_stop():
    """The stop depends on the context's prose run (trailing output words), not on where the
    request began: a prompt already ending in 5 output words stops after 3..251 more tokens, one
    that ends in 256 of them after exactly one."""
    vocab = DEFAULT_OUTPUT_VOCAB
    lengths = [len(greedy_output(0, [5] + list(range(1000 + i, 1005 + i)), vocab, 1000)[0]) for i in range(300)]
    assert min(lengths) >= MIN_NATURAL_LENGTH - 5 and max(lengths) <= MAX_NATURAL_LENGTH - 5
    assert min(lengths) < MIN_NATURAL_LENGTH  # some do stop sooner than a chat answer could
    long_prose = list(range(1000, 1000 + MAX_NATURAL_LENGTH))
    out, reason = greedy_output(0, long_prose, vocab, 1000)
    assert (len(out), reason) == (1, "stop")


def test_context_digest_is_the_same_however_the_tokens_came():
    for prompt in ([1] + list(range(100, 139)), [1] + list(range(100, 1099))):  # xxh3's short and long inputs
        whole = Context(7, prompt, DEFAULT_OUTPUT_VOCAB)
        fed = Context(7, prompt[:3], DEFAULT_OUTPUT_VOCAB)
        for t in prompt[3:]:
            fed.append(t)
        assert whole.digest == fed.digest == context_digest(7, prompt) != context_digest(8, prompt)
        assert whole.prose == fed.prose == min(len(prompt) - 1, MAX_NATURAL_LENGTH)
    fed.append(5)  # not an output word: the prose run starts over
    assert fed.prose == 0 and fed.digest == context_digest(7, prompt + [5])


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_continuing_from_prompt_plus_generated_ids_gives_the_unbroken_output(ignore_eos):
    """What request migration relies on: generation from prompt + the first k generated ids yields
    exactly the unbroken run's remaining tokens, and stops where it did, for every k."""
    prompt = [3, 1, 4, 1, 5]
    for seed in range(20):
        full, reason = greedy_output(seed, prompt, DEFAULT_OUTPUT_VOCAB, 300, ignore_eos=ignore_eos)
        assert reason == ("length" if ignore_eos else "stop")
        for k in range(1, len(full)):
            assert greedy_output(seed, prompt + full[:k], DEFAULT_OUTPUT_VOCAB, 300 - k,
                                 ignore_eos=ignore_eos) == (full[k:], reason), (seed, k)


def test_a_continuation_that_repeats_or_drops_a_token_diverges():
    """The comparison has teeth: a continuation whose context repeats or drops a token at the seam
    emits as many tokens as the unbroken run but not the same ones (the output is a function of the
    whole context), so a count-only check would pass it and the content check does not."""
    prompt = [3, 1, 4, 1, 5]
    n = 200
    full, _ = greedy_output(0, prompt, DEFAULT_OUTPUT_VOCAB, n, ignore_eos=True)
    for k in (1, 2, 30, 199):
        exact = greedy_output(0, prompt + full[:k], DEFAULT_OUTPUT_VOCAB, n - k, ignore_eos=True)[0]
        repeated = greedy_output(0, prompt + full[:k] + full[k - 1:k], DEFAULT_OUTPUT_VOCAB, n - k, ignore_eos=True)[0]
        dropped = greedy_output(0, prompt + full[:k - 1], DEFAULT_OUTPUT_VOCAB, n - k, ignore_eos=True)[0]
        assert full[:k] + exact == full
        for bad in (repeated, dropped):
            assert len(full[:k] + bad) == n and full[:k] + bad != full, k


async def test_the_scheduler_generates_the_reference_output():
    prompt = list(range(10, 30))
    for ignore_eos in (False, True):
        sched = make(seed=5)
        assert await run_one(sched, prompt, 300, ignore_eos=ignore_eos) == \
            greedy_output(5, prompt, DEFAULT_OUTPUT_VOCAB, 300, ignore_eos=ignore_eos)


async def collect(seq: Sequence) -> tuple[list[int], str]:
    tokens: list[int] = []
    reason = None
    async for token_id, reason in seq.stream():
        if token_id is not None:
            tokens.append(token_id)
    return tokens, reason


def make(block_size=16, num_blocks=1024, **kw) -> Scheduler:
    kw.setdefault("speedup", FAST)
    return Scheduler(KVCache(block_size, num_blocks), **kw)


async def run_one(sched: Scheduler, prompt, max_tokens, ignore_eos=True):
    sched.start()
    try:
        return await collect(sched.submit(prompt, max_tokens, ignore_eos=ignore_eos))
    finally:
        await sched.stop()


async def test_output_is_deterministic_per_seed_and_prompt():
    prompt = list(range(100, 150))
    a = await run_one(make(seed=1), prompt, 30)
    b = await run_one(make(seed=1), prompt, 30)
    c = await run_one(make(seed=2), prompt, 30)
    d = await run_one(make(seed=1), prompt[:-1], 30)
    assert a == b and a[1] == "length" and len(a[0]) == 30
    assert a[0] != c[0] and a[0] != d[0]


async def test_output_vocab_is_used():
    tokens, _ = await run_one(make(output_vocab=[7, 8, 9]), [1, 2, 3], 20)
    assert set(tokens) <= {7, 8, 9}


async def test_natural_stop_without_ignore_eos():
    prompt = [5, 6, 7]
    sched = make(seed=3)
    tokens, reason = await run_one(sched, prompt, 1000, ignore_eos=False)
    assert reason == "stop"
    assert (tokens, reason) == greedy_output(3, prompt, DEFAULT_OUTPUT_VOCAB, 1000)
    assert MIN_NATURAL_LENGTH <= len(tokens) <= MAX_NATURAL_LENGTH
    assert sched.stats.request_success["stop"] == 1
    # max_tokens below the natural length: "length" wins.
    tokens, reason = await run_one(make(seed=3), prompt, 4, ignore_eos=False)
    assert (len(tokens), reason) == (4, "length")


async def test_batching_respects_max_num_seqs():
    sched = make(max_num_seqs=2)
    sched.start()
    try:
        seqs = [sched.submit([i + 1] * 20, 10, ignore_eos=True) for i in range(6)]
        consumers = [asyncio.ensure_future(collect(s)) for s in seqs]
        max_running = 0
        saw_waiting = False
        while not all(c.done() for c in consumers):
            max_running = max(max_running, sched.num_running)
            saw_waiting = saw_waiting or sched.num_waiting > 0
            await asyncio.sleep(0)
        assert max_running == 2 and saw_waiting
        results = [c.result() for c in consumers]
        assert all(reason == "length" and len(tokens) == 10 for tokens, reason in results)
        assert (sched.num_running, sched.num_waiting, sched.cache.usage) == (0, 0, 0)
        assert sched.stats.prompt_tokens == 120 and sched.stats.generation_tokens == 60
    finally:
        await sched.stop()


def test_prefill_budget_counts_only_uncached_tokens():
    # Drive the admission step directly (no loop): it is synchronous and deterministic.
    sched = make(block_size=4, max_num_batched_tokens=10)
    a = sched.submit(list(range(1, 9)), 5)
    b = sched.submit(list(range(11, 19)), 5)
    prefill, decode, tokens = sched._schedule()
    assert prefill == [a] and decode == [] and tokens == 8  # b would exceed the budget
    prefill, decode, tokens = sched._schedule()
    assert prefill == [b] and decode == [a] and tokens == 8
    # c shares a's 8-token prefix: 13 tokens but only 5 uncached, so d (4) fits in the same step.
    c = sched.submit(list(range(1, 9)) + [50, 51, 52, 53, 54], 5)
    d = sched.submit([60, 61, 62, 63], 5)
    prefill, _, tokens = sched._schedule()
    assert prefill == [c, d] and c.num_cached_tokens == 8 and tokens == 5 + 4


def test_prompt_larger_than_budget_is_admitted_alone():
    sched = make(max_num_batched_tokens=8)
    big = sched.submit(list(range(1, 31)), 5)
    small = sched.submit([99, 98], 5)
    prefill, _, tokens = sched._schedule()
    assert prefill == [big] and tokens == 30
    assert sched._schedule()[0] == [small]


async def test_abort_frees_blocks_immediately():
    sched = make(speedup=1000)  # slow enough to abort mid-generation
    sched.start()
    try:
        seq = sched.submit(list(range(1, 100)), 5000, ignore_eos=True)
        queued = sched.submit(list(range(1, 5)), 5)
        stream = seq.stream()
        await stream.__anext__()  # first token produced -> running with blocks
        assert sched.cache.usage > 0
        sched.abort(seq)
        sched.abort(seq)  # idempotent
        sched.abort(queued)
        assert sched.num_running == 0 and sched.cache.usage == 0
        assert seq.finish_reason == "abort"
        async for _token, reason in stream:
            pass
        assert reason == "abort"
        assert sched.stats.request_success["abort"] == 2
    finally:
        await sched.stop()


async def test_abort_while_waiting():
    sched = make()  # not started: stays waiting
    seq = sched.submit([1, 2, 3], 5)
    assert sched.num_waiting == 1
    sched.abort(seq)
    assert sched.num_waiting == 0
    assert await collect(seq) == ([], "abort")


async def test_preemption_under_tiny_cache_recomputes_same_output():
    prompts = [list(range(1, 9)), list(range(21, 29))]
    # Each needs 8 + 12 = 20 tokens = 5 blocks of 4; two of them don't fit in 8 blocks together.
    sched = make(block_size=4, num_blocks=8)
    sched.start()
    try:
        results = await asyncio.gather(*(collect(sched.submit(p, 12, ignore_eos=True)) for p in prompts))
    finally:
        await sched.stop()
    assert sched.stats.num_preemptions >= 1
    assert sched.cache.usage == 0
    roomy = [await run_one(make(), p, 12) for p in prompts]
    assert results == roomy
    assert all(r == "length" and len(t) == 12 for t, r in results)


def test_submit_rejects_what_can_never_fit():
    sched = make(block_size=4, num_blocks=2)
    with pytest.raises(ValueError):
        sched.submit([1, 2, 3, 4, 5], 4)  # 9 tokens > 8 slots
    with pytest.raises(ValueError):
        sched.submit([1], 0)
    with pytest.raises(ValueError):
        sched.submit([], 3)


async def test_idle_loop_does_not_spin():
    sched = make()
    await run_one(sched, [1, 2, 3], 3)
    sched.start()
    try:
        await collect(sched.submit([4, 5], 2))
        steps = sched.num_steps
        await asyncio.sleep(0.05)
        assert sched.num_steps == steps
    finally:
        await sched.stop()


async def test_stop_aborts_outstanding():
    sched = make(speedup=1)
    sched.start()
    seq = sched.submit([1, 2, 3], 100, ignore_eos=True)
    await asyncio.sleep(0)
    await sched.stop()
    tokens, reason = await collect(seq)
    assert reason == "abort" and sched.cache.usage == 0


async def test_wall_time_follows_the_timing_model():
    speedup = 4.0
    sched = make(speedup=speedup)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    tokens, _ = await run_one(sched, list(range(1, 101)), 10)
    elapsed = loop.time() - t0
    # One prefill step (yields token 1) + 9 decode steps; usage stays ~0 in a 1024-block cache.
    expected = (prefill_time_ms(100) + 9 * decode_time_ms(0.0)) / speedup / 1000
    assert len(tokens) == 10 and sched.num_steps == 10
    assert expected * 0.95 <= elapsed < expected * 3 + 0.1
