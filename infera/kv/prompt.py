"""Prompt → token ids the way the engine computes them, cached so a repeated prompt is free.

Chat: the model's chat template is rendered (``add_generation_prompt=True``) and the text is
encoded without special tokens, as vLLM does for chat. Completions: a string prompt is encoded
with the tokenizer's special-token handling; a token-id prompt is used as is.

Routing only needs the prefix that could match a cache, so only the first ``prefix_chars``
characters of the rendered prompt are tokenized (a token-id prompt: its first ``prefix_chars``
ids). Block hashes are chained, so the hashes of a prefix are a prefix of the hashes: picks for
prompts under the cap are unchanged, and a huge prompt costs a bounded tokenization. The cut is
made at a word boundary (``prefix_cut``) and the last few tokens are dropped, so every block
hashed is one the whole prompt's tokenization has too.

Big prompts never hold the event loop. Measured on 2 cores (tokenizers 0.23, 1 MiB prompts;
numbers in bench/README.md, ``loop_stall.py``):

* HF ``Tokenizer.encode`` holds the GIL for the whole call, so a thread alone does not help (the
  loop thread got 2 wake-ups in a 575 ms encode), but the batch encoders release it (its 1 ms
  sleeps stayed at p50 1.1 ms). So a HF tokenizer runs in this object's own threads through
  ``SimTokenizer.encode_many`` (``encode_batch_fast``);
* the built-in tokenizer is pure Python. In a thread it takes the GIL back every 5 ms (the switch
  interval), and the loop waited up to 5 ms at each of its steps: ``/health`` p99 ~40 ms under
  1 MiB prompts. So it runs on the loop instead, a ~1 ms slice at a time with a yield between
  slices (``iter_encode``): p99 ~13 ms, and no thread.

Caches (whole prompts, and chat segments between special tokens) share one LRU bounded in bytes
(token ids stored as 4-byte arrays), so memory stays flat whatever the prompts' sizes. Piecewise
encoding is checked against whole-prompt encoding on a sample, except for a tokenizer that is exact
by construction (the built-in one: ``exact_segments``).

With a ``horizon`` (the kv-aware router's, ``token_ids``), a chat prompt is tokenized only as far
as its blocks could match some worker's cache: pieces in order, a new piece's first words first,
stopping at the first block no worker holds. A new document then costs a block's worth of tokens,
not its length (bench/kv_path.py, "rag"). A chat turn with fewer new characters than
``_HORIZON_MIN_CHARS`` is encoded whole: the horizon's checks would cost more than the encoding.
With the built-in tokenizer, a chat's messages are its pieces (``_message_parts``).

Beside it: the lazy helpers of the piecewise encoding (``prompt_parts.py``) and where a router
tokenizer comes from (``tokenizer_path.py``), both importable from here too.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import threading
import time
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Generator, Sequence, TypeVar

import msgspec
import xxhash

from infera.kv.native import native
from infera.kv.prompt_parts import _ChatParts, _LazyHorizon
from infera.kv.tokenizer import SimTokenizer, load_tokenizer, normalize_messages, prefix_cut
from infera.kv.tokenizer_path import resolve_tokenizer_path  # (re-exported: it lived here)

log = logging.getLogger(__name__)

# Above this many characters (of the request's messages as JSON, or of a text prompt) tokenization
# moves off the loop (threads) or is sliced (on the loop); below it that costs more than it saves.
_THREAD_THRESHOLD_CHARS = 4096
# With less than this many characters left to encode, a chat prompt is encoded whole, without the
# horizon: each of its checks walks the prompt's blocks through every view, with the CPU caches
# cold in the server (~40 us a check there, 3 a request: bench/kv_routing.py --attribute), which
# costs more than encoding a chat turn's new message (a few hundred characters). A new document
# (thousands of characters) is where stopping early pays (bench/kv_path.py, "rag").
_HORIZON_MIN_CHARS = 2048
# A plain chat (``chat_parts``) is cached whole too when it is this short: a repeated short prompt
# is then one lookup. A long one is not (its parts are): a conversation's every turn is a new prompt,
# and whole copies of a long history would fill the cache for prompts rarely asked again.
_WHOLE_CHARS = 4096
# Pieces remembered as probed (see _pieces_steps): 16-byte keys, ~1.6 MB at most.
_PROBED_CAP = 8192
# On the loop, steps run back to back for up to this long before the loop gets a turn.
_LOOP_TURN_S = 0.001
# The longest rendered-prompt prefix tokenized for routing (``--router-prefix-chars``): 512 KiB is
# ~128k tokens of ordinary text, the context of most long-context models, so no prompt an engine
# accepts loses routing precision in practice, while a multi-MB prompt costs at most this.
DEFAULT_PREFIX_CHARS = 512 * 1024
# Token-id cache budget (``--router-tokenizer-cache-bytes``): whole prompts and chat segments.
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
# Tokens dropped after a cut: a post-processor may append tokens (EOS) and a pre-tokenizer may look
# a little ahead; a few tokens of a prompt of 100k+ cost at most one block of matching.
_CUT_TAIL_TOKENS = 8
_encode_json = msgspec.json.Encoder().encode
_U32 = "I" if array("I").itemsize == 4 else "L"
T = TypeVar("T")
# A computation run a step at a time: on the event loop with yields between steps, or at once.
Steps = Generator[None, None, T]


def _ids_array(ids: Sequence[int]) -> array:
    return array(_U32, ids)


class ByteLRU:
    """bytes → array of token ids, least recently used first out, bounded by accounted bytes.

    An entry is accounted as its key and array objects (``sys.getsizeof``, buffers included) plus
    ``ENTRY_OVERHEAD`` for its slot in the table; an entry larger than the whole budget is not
    kept. Shared by the event loop and the tokenizer threads, hence the lock around the changes
    (never held while encoding; lookups need none)."""

    # OrderedDict hash-table slot + linked-list node + the (value, cost) tuple, CPython 3.11 64-bit: 130
    # to 200 bytes an entry, the most just after the table doubled (tests/unit/test_prompt_bounds.py)
    ENTRY_OVERHEAD = 200

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._table: OrderedDict[bytes, tuple[array, int]] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def cost(cls, key: bytes, value: array) -> int:
        return sys.getsizeof(key) + sys.getsizeof(value) + cls.ENTRY_OVERHEAD

    def get(self, key: bytes) -> array | None:
        # No lock: each OrderedDict call is atomic under the GIL, and a put()/eviction in a
        # tokenizer thread between the two can only remove the entry (then it stays a hit).
        table = self._table
        entry = table.get(key)
        if entry is None:
            return None
        try:
            table.move_to_end(key)
        except KeyError:
            pass
        return entry[0]

    def put(self, key: bytes, value: Any, extra: int = 0) -> None:
        """``extra``: bytes the value holds that ``sys.getsizeof`` does not see (the items of a tuple)."""
        cost = self.cost(key, value) + extra
        with self._lock:
            old = self._table.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if cost > self.max_bytes:
                return
            self._table[key] = (value, cost)
            self.bytes += cost
            self._evict()

    def resize(self, max_bytes: int) -> None:
        with self._lock:
            self.max_bytes = max_bytes
            self._evict()

    def clear(self) -> None:
        with self._lock:
            self._table.clear()
            self.bytes = 0

    def _evict(self) -> None:
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self._table.popitem(last=False)
            self.bytes -= dropped

    def __len__(self) -> int:
        return len(self._table)


# Segment-wise encoding is checked against whole-text encoding on the first prompts, then on a
# sample; any difference turns it off for good.
_VERIFY_FIRST = 16
_VERIFY_EVERY = 64


class PromptTokenizer:
    """Whole prompts are cached by content; chat prompts are also encoded piece by piece between
    special tokens, with each piece cached, so a shared system prompt or an earlier turn is not
    re-tokenized when a conversation grows (every turn is a new prompt).

    ``prefix_chars``: the longest prefix of the rendered prompt tokenized (see the module doc);
    ``cache_bytes``: the budget of both caches together; ``threads``: tokenizer threads, for a
    tokenizer that releases the GIL (others run on the loop, a slice at a time)."""

    def __init__(self, tokenizer: SimTokenizer, *, prefix_chars: int = DEFAULT_PREFIX_CHARS,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, threads: int = 2) -> None:
        if prefix_chars <= 0 or cache_bytes < 0:
            raise ValueError("prefix_chars must be > 0 and cache_bytes >= 0")
        self.tokenizer = tokenizer
        self.prefix_chars = prefix_chars
        self.cache = ByteLRU(cache_bytes)
        self.hits = 0
        self.misses = 0
        self.truncated = 0  # prompts cut to prefix_chars
        self._separators = tokenizer.segment_separators()
        separators = self._separators
        self._splitter = re.compile("(" + "|".join(re.escape(t) for t in sorted(separators, key=len, reverse=True))
                                    + ")") if separators else None
        # (prefix, sep, suffix, generation) of a template that renders each message on its own:
        # with the C accelerator a chat is keyed a message at a time without rendering it
        self._chatml = (tokenizer.chatml_affixes() if native is not None and self._splitter is not None
                        and tokenizer.exact_segments else None)
        self.segment_hits = 0
        self._chat_prompts = 0
        self.horizon_cuts = 0  # chat prompts whose encoding stopped at the horizon (see token_ids)
        self.horizon_chars_skipped = 0  # characters of those prompts never encoded
        self._chars_per_token = 4.0
        self._probed: OrderedDict[bytes, None] = OrderedDict()  # pieces whose first words were probed
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None
        if tokenizer.releases_gil:
            # Our threads give the concurrency; HF tokenizers' own rayon pool on top took every core
            # from the event loop: bench/loop_stall.py with a HF tokenizer, 1 MiB prompts, /health
            # p99 165 ms with it, 21 ms with TOKENIZERS_PARALLELISM=false. (Read on every batch
            # call; an operator's own setting wins.)
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    @classmethod
    def from_path(cls, path: str | None, **kwargs: Any) -> "PromptTokenizer":
        """``None``: the built-in tokenizer (matches simulated engines serving a model *name*)."""
        return cls(load_tokenizer(resolve_tokenizer_path(path)) if path else load_tokenizer(""), **kwargs)

    def configure(self, *, prefix_chars: int | None = None, cache_bytes: int | None = None) -> None:
        """Change the prefix cap or the cache budget (the server applies its flags here)."""
        if prefix_chars is not None:
            if prefix_chars <= 0:
                raise ValueError("prefix_chars must be > 0")
            if prefix_chars != self.prefix_chars:
                self.prefix_chars = prefix_chars
                self.cache.clear()  # cached ids were cut at the old cap
        if cache_bytes is not None:
            self.cache.resize(cache_bytes)

    def close(self) -> None:
        """Stop the tokenizer threads (a tokenization under way finishes; its result is dropped)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _key_and_work(self, route: str, parsed: Any) -> tuple[bytes | None, Any, int]:
        """(cache key, work for ``_compute``, size in chars that decides inline vs thread)."""
        if route == "/v1/chat/completions":
            return self._chat_parts_keyed(parsed.messages) or self._chat_keyed(parsed.messages)
        prompt = parsed.prompt
        if isinstance(prompt, list):
            if prompt and all(isinstance(t, int) for t in prompt):
                return None, ("ids", prompt), 0
            if len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            else:
                return None, ("none", None), 0  # batched prompts: not routed by prefix
        return xxhash.xxh3_128_digest(prompt.encode("utf-8", "surrogatepass")) + b"p", ("text", prompt), len(prompt)

    def _chat_parts_keyed(self, messages: Any) -> tuple[bytes, Any, int] | None:
        """A ChatML chat of plain messages, keyed a message at a time in C without rendering it
        (its whole key is made of its parts' keys); a part is rendered only where its ids are not
        cached (bench/kv_path.py, "shared"). None: not such a chat (or no ChatML template)."""
        if self._chatml is None:
            return None
        parts = native.chat_part_keys(messages, *self._chatml, b"m", b"k")
        if parts is None:
            return None
        whole, keys, lengths = parts
        chars = sum(lengths)
        if chars > self.prefix_chars:
            return None
        return whole, ("chat_parts", (messages, keys, lengths)), chars

    def _chat_keyed(self, messages: Any) -> tuple[bytes, Any, int]:
        """Any other chat: keyed by its messages' JSON, rendered by the template when computed."""
        raw = _encode_json(messages)
        return xxhash.xxh3_128_digest(raw) + b"c", ("chat", messages), len(raw)

    def _encode_steps(self, texts: list[str], add_special_tokens: bool, stepwise: bool) -> Steps[list[array]]:
        """Each text's ids: in one call (one GIL release for HF tokenizers), or when ``stepwise``
        part by part, a step between parts."""
        tok = self.tokenizer
        if not stepwise:
            return [_ids_array(ids) for ids in tok.encode_many(texts, add_special_tokens=add_special_tokens)]
        out = []
        for text in texts:
            ids = array(_U32)
            for part in tok.iter_encode(text, add_special_tokens):
                ids.extend(part)
                yield
            out.append(ids)
        return out

    def _pieces_steps(self, text: str, stepwise: bool, horizon: Any = None, parts: Sequence[str] | None = None,
                      keys: list[bytes] | None = None, lengths: list[int] | None = None) -> Steps[array]:
        """``text`` encoded piece by piece between special tokens, each piece cached. With a
        ``horizon`` (see ``token_ids``), the pieces are taken in order and encoding stops where it
        says nothing further can matter. ``parts``: the text already cut into pieces that encode
        alone (a chat's messages, ``_message_parts``), taken as they are; with their cache ``keys``
        and ``lengths`` (``_ChatParts``: the C accelerator keyed them, a part is rendered only
        when it must be encoded)."""
        if parts is not None:
            pieces, tag = parts, b"m"
        else:
            assert self._splitter is not None
            pieces, tag = [p for p in self._splitter.split(text) if p], b"s"
        if keys is None:
            keys = [xxhash.xxh3_128_digest(p.encode("utf-8", "surrogatepass")) + tag for p in pieces]
        if lengths is None:
            lengths = [len(p) for p in pieces]
        get = self.cache.get
        found = [get(k) for k in keys]
        missing = [i for i, ids in enumerate(found) if ids is None]
        self.segment_hits += len(found) - len(missing)
        out = array(_U32)
        if missing and horizon is not None and sum(lengths[i] for i in missing) >= _HORIZON_MIN_CHARS:
            total_chars = len(text) if parts is None else sum(lengths)
            done = chars = 0  # pieces appended to out, and their characters
            for i in missing:
                for j in range(done, i):
                    out.extend(found[j])
                    chars += lengths[j]
                done = i
                if horizon.reached(out):
                    return self._stopped(horizon, out, chars, total_chars)
                probe = None
                if keys[i] not in self._probed:
                    probe = yield from self._probe_steps(pieces[i], len(out), horizon, stepwise)
                if probe is not None:
                    ids, probe_chars = probe
                    if horizon.reached(out + ids):
                        # Probed once: a conversation's new turn ends here now, and next turn it is
                        # history that some worker holds, encoded whole without a second probe.
                        self._probed[keys[i]] = None
                        if len(self._probed) > _PROBED_CAP:
                            self._probed.popitem(last=False)
                        return self._stopped(horizon, out + ids, chars + probe_chars, total_chars)
                arr = (yield from self._encode_steps([pieces[i]], False, stepwise))[0]
                self._learn(lengths[i], len(arr))
                found[i] = arr
                self.cache.put(keys[i], arr)
            for j in range(done, len(found)):
                out.extend(found[j])
        else:
            if missing:
                encoded = yield from self._encode_steps([pieces[i] for i in missing], False, stepwise)
                for i, arr in zip(missing, encoded):
                    found[i] = arr
                    self.cache.put(keys[i], arr)
            for ids in found:
                out.extend(ids)
        self._chat_prompts += 1
        if parts is None and not self.tokenizer.exact_segments and (
                self._chat_prompts <= _VERIFY_FIRST or self._chat_prompts % _VERIFY_EVERY == 0):
            whole = (yield from self._encode_steps([text], False, stepwise))[0]
            if whole != out:
                log.info("piecewise tokenization differs from whole-prompt tokenization for this tokenizer; "
                         "encoding whole prompts from now on")
                self._splitter = None
                return whole
        return out

    def _message_parts(self, messages: list[dict[str, Any]]) -> list[str] | None:
        """The rendered chat a message at a time, when each message's ids can be cached alone: a
        tokenizer whose pieces between special tokens are exact by construction, a template that
        renders each message on its own, and a prompt under the prefix cap (a capped one is cut
        as text). A conversation's earlier turns are then one cache lookup each, with no render,
        split and keying of the whole history on every turn (bench/kv_path.py, "shared")."""
        if self._splitter is None or not self.tokenizer.exact_segments:
            return None
        parts = self.tokenizer.render_chat_parts(messages)
        if parts is None or sum(map(len, parts)) > self.prefix_chars:
            return None
        return parts

    def _probe_steps(self, piece: str, n_ids: int, horizon: Any, stepwise: bool) -> Steps[tuple[array, int] | None]:
        """The ids of a prefix of ``piece`` long enough to complete the next block after ``n_ids``
        tokens, and the characters they cover; None when the piece is short enough to encode whole.
        Cut at a word boundary and minus the last few ids, so they are the whole piece's first ids."""
        need = horizon.needed(n_ids) + _CUT_TAIL_TOKENS + 2
        limit = int(need * self._chars_per_token * 1.25) + 8
        if 3 * limit >= len(piece):  # the probe would cost a third of the piece: encode it whole
            return None
        cut = prefix_cut(piece, limit, self._separators)
        if cut == 0:
            return None
        ids = (yield from self._encode_steps([piece[:cut]], False, stepwise))[0]
        return ids[:max(0, len(ids) - _CUT_TAIL_TOKENS)], cut

    def _learn(self, chars: int, tokens: int) -> None:
        """Characters per token, as encoded lately (sizes the horizon's probes)."""
        if tokens:
            self._chars_per_token += 0.1 * (chars / tokens - self._chars_per_token)

    def _stopped(self, horizon: Any, ids: array, chars: int, total_chars: int) -> array:
        self.horizon_cuts += 1
        self.horizon_chars_skipped += max(0, total_chars - chars)
        horizon.stop(len(ids), chars, total_chars)
        return ids

    def _text_steps(self, text: str, add_special_tokens: bool, piecewise: bool, stepwise: bool,
                    horizon: Any = None) -> Steps[array]:
        """Token ids of ``text``, or of its first ``prefix_chars`` chars cut at a safe boundary
        (then minus the last few ids, and an odd count: see ``_cut_ids``)."""
        cut = prefix_cut(text, self.prefix_chars, self._separators)
        capped = cut < len(text)
        if capped:
            self.truncated += 1
            text = text[:cut]
        if piecewise and self._splitter is not None:
            ids = yield from self._pieces_steps(text, stepwise, horizon)
        else:
            ids = (yield from self._encode_steps([text], add_special_tokens, stepwise))[0]
        return _cut_ids(ids) if capped else ids

    def _compute_steps(self, work: Any, stepwise: bool = False, horizon: Any = None) -> Steps[array]:
        kind, value = work
        if kind == "chat_parts":
            messages, keys, lengths = value
            parts = _ChatParts(messages, self._chatml)
            return (yield from self._pieces_steps("", stepwise, horizon, parts, keys, lengths))
        if kind == "chat":
            messages = normalize_messages(
                [{"role": m.role, "content": m.content if m.content is not None else ""} for m in value])
            parts = self._message_parts(messages)
            if parts is not None:
                return (yield from self._pieces_steps("", stepwise, horizon, parts))
            text = self.tokenizer.render_chat(messages)
            return (yield from self._text_steps(text, False, True, stepwise, horizon))
        if kind == "text":
            return (yield from self._text_steps(value, True, False, stepwise))
        if kind == "ids":
            return _ids_array(value[: self.prefix_chars])  # exact: no boundary to worry about
        return array(_U32)

    def _compute(self, work: Any, horizon: Any = None) -> array:
        """All steps at once (inline for a small prompt, or in a tokenizer thread)."""
        steps = self._compute_steps(work, False, horizon)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    async def _compute_on_loop(self, work: Any, horizon: Any = None) -> array:
        """A step at a time (~1 ms each at most), letting the loop run once a turn's worth of time
        has gone: a chat whose pieces are mostly cached costs no loop turn at all."""
        steps = self._compute_steps(work, True, horizon)
        clock = time.perf_counter
        turn_ends = clock() + _LOOP_TURN_S
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value
            if clock() >= turn_ends:
                await asyncio.sleep(0)
                turn_ends = clock() + _LOOP_TURN_S

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="infera-tokenize")
        return self._executor

    def lookup(self, route: str, parsed: Any) -> tuple[array | None, tuple]:
        """(the prompt's whole ids if cached, else None; its key and work), without a coroutine:
        a repeated prompt answered synchronously, and so is a plain chat whose new messages are
        short (``_parts_now``: its earlier messages are cache lookups). On a miss, pass the second
        value to ``token_ids(keyed=...)`` for the same request, so the prompt is not keyed twice (a
        10 KB conversation is JSON-encoded and hashed for its key)."""
        if route == "/v1/chat/completions":  # (_key_and_work's case, one call fewer: every chat request)
            keyed = self._chat_parts_keyed(parsed.messages) or self._chat_keyed(parsed.messages)
        else:
            keyed = self._key_and_work(route, parsed)
        key, work, chars = keyed
        if work[0] == "chat_parts":
            cached = self.cache.get(key) if chars <= _WHOLE_CHARS else None
            if cached is not None:
                self.hits += 1
                return cached, keyed
            ids = self._parts_now(work[1])
            if ids is not None and chars <= _WHOLE_CHARS:
                self.cache.put(key, ids)
            return ids, keyed
        if key is None:
            return None, keyed
        cached = self.cache.get(key)
        if cached is not None:
            self.hits += 1
        return cached, keyed

    def _parts_now(self, value: tuple) -> array | None:
        """A plain chat's ids (``chat_parts`` work) assembled from its parts' cached ids, the
        missing parts encoded here when they are short (under ``_HORIZON_MIN_CHARS`` in all: the
        horizon is not used below that, and encoding them costs less than a loop turn); None when
        they are not (``token_ids`` then encodes them, a step at a time, up to its horizon)."""
        messages, keys, lengths = value
        get = self.cache.get
        found = [get(k) for k in keys]
        missing = [i for i, ids in enumerate(found) if ids is None]
        if missing:
            if sum(lengths[i] for i in missing) >= _HORIZON_MIN_CHARS:
                return None
            parts = _ChatParts(messages, self._chatml)
            put = self.cache.put
            for i, ids in zip(missing, self.tokenizer.encode_many([parts[i] for i in missing])):
                arr = found[i] = array(_U32, ids)
                put(keys[i], arr)
        self.misses += 1
        self.segment_hits += len(found) - len(missing)
        self._chat_prompts += 1
        out = array(_U32)
        for ids in found:
            out.extend(ids)
        return out

    async def token_ids(self, route: str, parsed: Any, horizon: Callable[[], Any] | None = None,
                        keyed: tuple | None = None) -> array:
        """Token ids of the request's prompt (its routing prefix) as an array, shared with the
        cache: do not modify it. Empty when it cannot be tokenized (routing then degrades to
        load only, never an error). ``keyed``: what ``lookup`` returned for this request.

        ``horizon``: for a chat prompt with pieces not cached yet, called once for an object that
        says where further tokens cannot matter (the router's ``Horizon``): ``reached(ids)``, True
        when every block that could match any worker's cache lies within ``ids``; ``needed(n)``,
        the tokens after ``n`` that complete the next block; ``stop(tokens, chars, total_chars)``,
        told where the encoding stopped. Pieces are then encoded in order, a new piece's first
        words first, and the ids end where it is reached: a prefix of the prompt's ids, not cached
        as the whole prompt's."""
        if keyed is None:
            cached, keyed = self.lookup(route, parsed)
            if cached is not None:
                return cached
        key, work, size = keyed
        self.misses += 1
        lazy = _LazyHorizon(horizon) if horizon is not None and work[0] in ("chat", "chat_parts") else None
        try:
            if size <= _THREAD_THRESHOLD_CHARS:
                ids = self._compute(work, lazy)
            elif self.tokenizer.releases_gil:
                ids = await asyncio.get_running_loop().run_in_executor(self._pool(), self._compute, work, lazy)
            else:
                ids = await self._compute_on_loop(work, lazy)
        except Exception as exc:  # template errors, odd content: route by load, let the engine answer
            log.debug("router tokenization failed: %s", exc)
            ids = array(_U32)
        whole = work[0] != "chat_parts" or size <= _WHOLE_CHARS  # (a long plain chat: its parts are cached)
        if key is not None and whole and (lazy is None or not lazy.stopped):
            self.cache.put(key, ids)
        return ids

    async def tokens(self, route: str, parsed: Any) -> list[int]:
        """``token_ids`` as a list."""
        return (await self.token_ids(route, parsed)).tolist()


def _cut_ids(ids: array) -> array:
    """The ids of a cut prompt that are certainly the whole prompt's: all but the last
    ``_CUT_TAIL_TOKENS``, and an odd count. Odd because the self-check's prediction
    (``predicted_cached_tokens``) assumes the prompt ends here and takes one block back when its
    length is a multiple of the block size; an odd length never is (block sizes are even), so a
    cut prompt whose every block hits is predicted as such."""
    n = max(0, len(ids) - _CUT_TAIL_TOKENS)
    if n and n % 2 == 0:
        n -= 1
    return ids[:n]
