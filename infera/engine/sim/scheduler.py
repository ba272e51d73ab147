"""Continuous-batching scheduler and step-timing model for the simulated engine.

One asyncio task runs engine "steps" like vLLM's engine core loop:

1. admit waiting sequences (FIFO) while there is a free slot (``max_num_seqs``), prefill budget
   (``max_num_batched_tokens``, counting only prompt tokens NOT served by the prefix cache) and
   KV-cache room. Whole prompts are prefilled in one step; a prompt larger than the budget is
   admitted when it is the step's only prefill, so nothing starves.
2. sleep for the modelled step time (prefill cost + decode cost, divided by ``speedup``).
3. every scheduled sequence emits one token (the prefill step yields the first token). A sequence
   that needs a new KV block when none is free preempts the most recently admitted other running
   sequence, which goes back to the front of the queue and recomputes later.

Output is greedy and, like a language model's, a pure function of the context (prompt + what was
generated so far): the next token is drawn from a digest of (seed, every previous token id), and so is
the decision to stop after it. The stop depends on the context's *prose run*, how many tokens at its
end are output words: never below 8, surely at 256, uniform in between -- so a chat answer (its prompt
ends in template tokens) stops after 8..256 tokens, and a completions prompt that already ends in
output words counts them. The digest is one streamed xxh3 per sequence, so each token costs O(1), and
a request continued elsewhere from prompt + generated ids (request migration) generates exactly the
tokens, and stops exactly where, the unbroken run would have. Per-request ``temperature``/``seed``
are accepted and ignored: every request is greedy.

Prefill/decode disaggregation hooks (driven by ``pd.py``): a sequence with ``kv_hold`` gets it
called at a normal finish while it still holds its blocks (a PD prefill pins its prompt's KV for
the decode to pull); a sequence with ``kv_import`` has KV that arrived by transfer held for it
until admission, where the prompt tokens it hits are counted as externally computed.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence as SequenceT

import xxhash

from infera.runtime import cancel_and_wait
from infera.kv.hashing import tokens_le_bytes

from .cache import KVCache

log = logging.getLogger(__name__)

MIN_NATURAL_LENGTH = 8
MAX_NATURAL_LENGTH = 256

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT)

# Used when no output vocabulary is given: any id in the built-in tokenizer's non-reserved range.
DEFAULT_OUTPUT_VOCAB: SequenceT[int] = range(100, 50_100)


# ------------------------------------------------------------------ timing model


PREFILL_FIXED_MS = 16.5  # a prefill step's cost beyond its tokens


def prefill_time_ms(num_tokens: int) -> float:
    """Cost of prefilling ``num_tokens`` uncached tokens in one step (0 when none)."""
    if num_tokens <= 0:
        return 0.0
    return 4.21e-7 * num_tokens * num_tokens + 0.0152 * num_tokens + PREFILL_FIXED_MS


def decode_time_ms(kv_usage: float) -> float:
    """Cost of one decode step for the running batch, as a function of KV usage (0..1)."""
    return max(1.0, -25.74 * kv_usage * kv_usage + 54.01 * kv_usage + 5.74)


#: Loading a block back from the host tier costs this fraction of prefilling its tokens (PCIe-speed
#: copies against attention + MLP compute), unless --kv-offload-load-ms-per-block says otherwise.
HOST_LOAD_FRACTION = 0.05


def default_load_ms_per_block(block_size: int) -> float:
    """Modelled time to load one block of ``block_size`` tokens from the host tier, in ms."""
    return HOST_LOAD_FRACTION * (prefill_time_ms(block_size) - PREFILL_FIXED_MS)  # the tokens' share only


def step_time_ms(prefill_tokens: int, has_decode: bool, kv_usage: float, speedup: float = 1.0) -> float:
    """Simulated wall time of one engine step, in milliseconds."""
    total = prefill_time_ms(prefill_tokens) + (decode_time_ms(kv_usage) if has_decode else 0.0)
    return total / speedup


# ------------------------------------------------------------- deterministic output


_SEED_MASK = 0xFFFFFFFFFFFFFFFF


def context_digest(seed: int, token_ids: SequenceT[int]) -> int:
    """Digest of (seed, a whole context): what ``Context.digest`` is after those tokens, however they
    were fed (one shot here; token by token while generating)."""
    return xxhash.xxh3_64_intdigest(tokens_le_bytes(token_ids), seed=seed & _SEED_MASK)


def next_token_id(digest: int, vocab: SequenceT[int]) -> int:
    """The greedy next token of the context with ``digest`` (its low 32 bits pick the word)."""
    return vocab[(digest & 0xFFFFFFFF) % len(vocab)]


def stops_after(digest: int, prose: int) -> bool:
    """Whether the "model" ends its answer at a context with ``digest`` whose last ``prose`` tokens
    are output words: never below MIN_NATURAL_LENGTH, always at MAX_NATURAL_LENGTH, with the hazard
    of a uniform length in between (the high 32 bits draw it, independent of the word)."""
    if prose < MIN_NATURAL_LENGTH:
        return False
    if prose >= MAX_NATURAL_LENGTH:
        return True
    return (digest >> 32) % (MAX_NATURAL_LENGTH - prose + 1) == 0


def prose_run(token_ids: SequenceT[int], vocab: "frozenset[int] | range") -> int:
    """How many tokens at the end of ``token_ids`` are in ``vocab``, counted up to MAX_NATURAL_LENGTH."""
    n = 0
    for t in reversed(token_ids):
        if n >= MAX_NATURAL_LENGTH or t not in vocab:
            break
        n += 1
    return n


class Context:
    """The sim "model"'s state of one token sequence: its running digest and prose run. Both depend on
    the token ids only, so a context built from prompt + k generated ids equals the one that fed
    those k tokens one by one (what makes a migrated continuation exact)."""

    __slots__ = ("_hash", "digest", "prose", "_vocab")

    def __init__(self, seed: int, token_ids: SequenceT[int], vocab: "frozenset[int] | range") -> None:
        self._hash = xxhash.xxh3_64(tokens_le_bytes(token_ids), seed=seed & _SEED_MASK)
        self.digest = self._hash.intdigest()
        self.prose = prose_run(token_ids, vocab)
        self._vocab = vocab

    def append(self, token_id: int) -> None:
        """The context with ``token_id`` at its end: O(1) (xxh3's streaming state, not a rehash)."""
        self._hash.update(token_id.to_bytes(4, "little"))
        self.digest = self._hash.intdigest()
        self.prose = min(self.prose + 1, MAX_NATURAL_LENGTH) if token_id in self._vocab else 0


def vocab_set(vocab: SequenceT[int]) -> "frozenset[int] | range":
    """``vocab`` for membership tests (a range already is one)."""
    return vocab if isinstance(vocab, range) else frozenset(vocab)


def greedy_output(seed: int, prompt_token_ids: SequenceT[int], vocab: SequenceT[int], max_tokens: int, *,
                  ignore_eos: bool = False) -> tuple[list[int], str]:
    """What the scheduler generates for a prompt, without the scheduler: (token ids, finish reason).
    The reference the tests compare the engine's (and a migrated stream's) output with."""
    ctx = Context(seed, prompt_token_ids, vocab_set(vocab))
    out: list[int] = []
    while True:
        token_id = next_token_id(ctx.digest, vocab)
        out.append(token_id)
        ctx.append(token_id)
        if not ignore_eos and stops_after(ctx.digest, ctx.prose):
            return out, FINISH_STOP
        if len(out) >= max_tokens:
            return out, FINISH_LENGTH


# ---------------------------------------------------------------------- sequences

WAITING = "waiting"
RUNNING = "running"
FINISHED = "finished"

#: What a sequence's stream yields: (token id or None, finish reason or None). The last event
#: carries the finish reason; its token is None when the sequence ended without a new token.
TokenEvent = tuple["int | None", "str | None"]

# Where a prompt's tokens came from, as vLLM's vllm:prompt_tokens_by_source labels them.
SOURCE_LOCAL_COMPUTE = "local_compute"
SOURCE_LOCAL_CACHE_HIT = "local_cache_hit"
SOURCE_EXTERNAL_KV_TRANSFER = "external_kv_transfer"
PROMPT_TOKEN_SOURCES = (SOURCE_LOCAL_COMPUTE, SOURCE_LOCAL_CACHE_HIT, SOURCE_EXTERNAL_KV_TRANSFER)


@dataclass(frozen=True)
class ImportedKv:
    """KV blocks a transfer filled, held in the cache under ``hold_id`` until the sequence is admitted."""

    hold_id: object
    block_ids: frozenset[int]


@dataclass(eq=False)
class Sequence:
    """One request inside the engine."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    # True: only max_tokens ends it (the model's own stop is ignored).
    ignore_eos: bool = False
    # The model's state of prompt + output so far (set by Scheduler.submit).
    context: Context | None = field(default=None, repr=False)
    output_token_ids: list[int] = field(default_factory=list)
    state: str = WAITING
    finish_reason: str | None = None
    # Prompt tokens served by the prefix cache at first admission (-1 until admitted), of which
    # ``num_external_tokens`` came by KV transfer (vLLM reports both as cached).
    num_cached_tokens: int = -1
    num_external_tokens: int = 0
    num_preemptions: int = 0
    # PD prefill: called at a stop/length finish, before the blocks are freed, to pin what a decode pulls.
    kv_hold: "Callable[[Sequence], None] | None" = field(default=None, repr=False)
    # PD decode: KV a transfer brought for this prompt, released once admission has referenced it.
    kv_import: ImportedKv | None = None
    # The request's cache_salt (vLLM's): its blocks are cached apart (infera/engine/sim/cache.py).
    cache_salt: str | None = None
    _events: asyncio.Queue = field(default_factory=asyncio.Queue, repr=False)

    @property
    def finished(self) -> bool:
        return self.state == FINISHED

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    async def stream(self) -> AsyncIterator[TokenEvent]:
        """Yield every produced token as it is produced; the last event has the finish reason."""
        while True:
            token_id, finish_reason = await self._events.get()
            yield token_id, finish_reason
            if finish_reason is not None:
                return


@dataclass
class SchedulerStats:
    """Monotonic counters exported as Prometheus counters."""

    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    request_success: Counter = field(default_factory=Counter)  # finish reason -> count
    prompt_tokens_by_source: Counter = field(default_factory=Counter)  # PROMPT_TOKEN_SOURCES -> tokens
    # Tokens asked of / served by a KV connector (only counted when the engine has one, as in vLLM).
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0


class Scheduler:
    """Continuous batching over a ``KVCache``. Create, ``start()`` inside a running loop, ``submit()``."""

    def __init__(
        self,
        cache: KVCache,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        speedup: float = 1.0,
        seed: int = 0,
        output_vocab: SequenceT[int] | None = None,
        kv_connector: bool = False,
        load_ms_per_block: float = 0.0,
    ) -> None:
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0 or speedup <= 0:
            raise ValueError("max_num_seqs, max_num_batched_tokens and speedup must be > 0")
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.speedup = speedup
        self.seed = seed
        self.output_vocab: SequenceT[int] = output_vocab if output_vocab else DEFAULT_OUTPUT_VOCAB
        self._vocab_set = vocab_set(self.output_vocab)
        # vLLM queries a configured KV connector for every request, transfer or not.
        self.kv_connector = kv_connector
        # Time to load one block from the cache's host tier (before ``speedup``).
        self.load_ms_per_block = load_ms_per_block
        self._loaded_blocks_in_step = 0  # host-tier blocks the step being scheduled loads
        self.stats = SchedulerStats()
        self.num_steps = 0

        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # admission order; the last one is preempted first
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._ids = itertools.count()

    # ------------------------------------------------------------------ public

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        return self.cache.usage

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="sim-scheduler")

    async def stop(self) -> None:
        """Stop stepping and end every outstanding sequence with finish reason "abort"."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        for seq in list(self._running) + list(self._waiting):
            self.abort(seq)

    def submit(self, prompt_token_ids: SequenceT[int], max_tokens: int, *, ignore_eos: bool = False,
               request_id: str = "", kv_hold: "Callable[[Sequence], None] | None" = None,
               kv_import: ImportedKv | None = None, cache_salt: str | None = None) -> Sequence:
        """Queue a request. Raises ValueError if it could never fit in the KV cache (the caller
        still owns ``kv_import`` then)."""
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        needed = self.cache.blocks_needed(len(prompt_token_ids) + max_tokens)
        if needed > self.cache.num_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks but the cache only has {self.cache.num_blocks}")
        prompt = list(prompt_token_ids)
        seq = Sequence(
            seq_id=next(self._ids),
            request_id=request_id,
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            context=Context(self.seed, prompt, self._vocab_set),
            kv_hold=kv_hold,
            kv_import=kv_import,
            cache_salt=cache_salt or None,
        )
        self._waiting.append(seq)
        self._wakeup.set()
        return seq

    def abort(self, seq: Sequence) -> None:
        """Client went away: drop the sequence now and free its blocks. Idempotent."""
        self.finish(seq, FINISH_ABORT)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence early (e.g. a stop string matched upstream). No-op if already finished."""
        if seq.state == FINISHED:
            return
        if seq.state == WAITING:
            try:
                self._waiting.remove(seq)
            except ValueError:
                pass
            self._release_import(seq)
        else:
            self._running.remove(seq)
            self._free_blocks(seq, reason)
        self._mark_finished(seq, reason, token_id=None)

    # -------------------------------------------------------------------- loop

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        # Modelled end of the previous step while busy, None after idling. Steps are timed against
        # it so Python overhead and timer rounding (uvloop: 1 ms) don't accumulate into drift.
        last_step_end: float | None = None
        while True:
            try:
                prefill, decode, prefill_tokens = self._schedule()
                if not prefill and not decode:
                    # Idle (or nothing admissible): sleep until a submit/abort changes things.
                    last_step_end = None
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                delay = step_time_ms(prefill_tokens, bool(decode), self.cache.usage, self.speedup) / 1000.0
                if self._loaded_blocks_in_step:
                    delay += self._loaded_blocks_in_step * self.load_ms_per_block / self.speedup / 1000.0
                now = loop.time()
                # Absorb at most one step of lag: when CPU-bound, run back to back without bursts.
                start = now if last_step_end is None else max(last_step_end, now - delay)
                last_step_end = start + delay
                await asyncio.sleep(max(last_step_end - now, 0.0))
                self._complete_step(decode + prefill)
                self.num_steps += 1
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not leave every client hanging forever
                log.exception("sim scheduler step failed; aborting outstanding sequences")
                for seq in list(self._running) + list(self._waiting):
                    self.abort(seq)

    def _schedule(self) -> tuple[list[Sequence], list[Sequence], int]:
        """Admit what fits. Returns (newly admitted, already running, uncached prefill tokens)."""
        decode = list(self._running)
        prefill: list[Sequence] = []
        prefill_tokens = 0
        loaded_blocks = 0
        while self._waiting and len(self._running) < self.max_num_seqs:
            seq = self._waiting[0]
            tokens = seq.all_token_ids()  # includes tokens generated before a preemption
            uncached = len(tokens) - self.cache.match_prefix(tokens, seq.cache_salt)
            if prefill and prefill_tokens + uncached > self.max_num_batched_tokens:
                break
            cached = self.cache.allocate(seq.seq_id, tokens, seq.cache_salt)
            if cached is None:
                break  # FIFO: don't let later requests jump a head that doesn't fit
            self._waiting.popleft()
            loaded = self.cache.loaded_tokens(seq.seq_id)  # from the host tier: loaded, not computed
            loaded_blocks += loaded // self.cache.block_size
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = cached
                seq.num_external_tokens = self._imported_hits(seq, cached - loaded) + loaded
                self._count_prompt(seq)
            self._release_import(seq)  # the sequence references those blocks itself now
            seq.state = RUNNING
            self._running.append(seq)
            prefill.append(seq)
            prefill_tokens += len(tokens) - cached
        self._loaded_blocks_in_step = loaded_blocks
        return prefill, decode, prefill_tokens

    def _complete_step(self, scheduled: list[Sequence]) -> None:
        """Each scheduled sequence still running emits one token."""
        for seq in scheduled:
            if seq.state != RUNNING:  # aborted or preempted while the step ran
                continue
            ctx = seq.context
            token_id = next_token_id(ctx.digest, self.output_vocab)
            seq.output_token_ids.append(token_id)
            ctx.append(token_id)
            self.stats.generation_tokens += 1
            n = len(seq.output_token_ids)
            # EOS is checked before length, as in vLLM's stop checker.
            if not seq.ignore_eos and stops_after(ctx.digest, ctx.prose):
                reason = FINISH_STOP
            elif n >= seq.max_tokens:
                reason = FINISH_LENGTH
            else:
                reason = None
            if reason is not None:
                self._running.remove(seq)
                self._free_blocks(seq, reason)
                self._mark_finished(seq, reason, token_id)
                continue
            seq._events.put_nowait((token_id, None))
            while not self.cache.append_token(seq.seq_id, token_id):
                victim = next((s for s in reversed(self._running) if s is not seq), None)
                self._preempt(victim or seq)
                if victim is None:
                    break

    def _imported_hits(self, seq: Sequence, cached: int) -> int:
        """Of ``cached`` prompt tokens just hit, those in blocks a KV transfer filled."""
        if seq.kv_import is None or not cached:
            return 0
        hit_blocks = self.cache.seq_block_ids(seq.seq_id)[: cached // self.cache.block_size]
        return sum(1 for b in hit_blocks if b in seq.kv_import.block_ids) * self.cache.block_size

    def _count_prompt(self, seq: Sequence) -> None:
        self.stats.prompt_tokens += seq.prompt_len
        by_source = self.stats.prompt_tokens_by_source
        by_source[SOURCE_LOCAL_COMPUTE] += seq.prompt_len - seq.num_cached_tokens
        by_source[SOURCE_LOCAL_CACHE_HIT] += seq.num_cached_tokens - seq.num_external_tokens
        by_source[SOURCE_EXTERNAL_KV_TRANSFER] += seq.num_external_tokens
        if self.kv_connector:
            self.stats.external_prefix_cache_queries += seq.prompt_len
            self.stats.external_prefix_cache_hits += seq.num_external_tokens

    def _release_import(self, seq: Sequence) -> None:
        if seq.kv_import is not None:
            self.cache.free(seq.kv_import.hold_id)
            seq.kv_import = None

    def _free_blocks(self, seq: Sequence, reason: str) -> None:
        if seq.kv_hold is not None and reason != FINISH_ABORT:
            seq.kv_hold(seq)  # still holding its blocks: the hook pins what it needs
        self.cache.free(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self._running.remove(seq)
        self.cache.free(seq.seq_id)
        seq.state = WAITING
        seq.num_preemptions += 1
        self._waiting.appendleft(seq)
        self.stats.num_preemptions += 1

    def _mark_finished(self, seq: Sequence, reason: str, token_id: int | None) -> None:
        seq.state = FINISHED
        seq.finish_reason = reason
        self.stats.request_success[reason] += 1
        seq._events.put_nowait((token_id, reason))
        # A freed slot/blocks may let waiting sequences in.
        self._wakeup.set()
