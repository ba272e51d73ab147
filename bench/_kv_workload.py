"""Shared-prefix multi-turn chat workload and its closed-loop client, for ``bench/kv_routing.py``.

Workload (deterministic from the seed):

* ``groups`` prefix groups: each a system prompt of about ``prefix_tokens`` tokens made of
  pseudo-words drawn from a seeded vocabulary (so every group tokenizes to distinct ids, with the
  built-in simulator tokenizer and with a trained BPE alike);
* conversations: each picks a group (``uniform``, or ``zipf`` with exponent ``zipf_s``: group 0
  hottest) and has ``turns`` user turns of about ``user_tokens`` tokens. Turn 1 is
  ``[system, user1]``; turn k appends the assistant's actual reply to turn k-1 and ``user_k``.

Client: ``concurrency`` users in a closed loop; each takes the next conversation from the shared
list and plays its turns one after another (streamed chat completions with
``stream_options.include_usage``, ``ignore_eos``, ``temperature`` 0), until ``max_requests`` have
been issued. Per request it records TTFT (first SSE ``data:`` event), latency, and the usage
(``prompt_tokens``, ``prompt_tokens_details.cached_tokens``, ``completion_tokens``).

This module never starts processes; it imports only the stdlib, aiohttp and (for token counts)
``infera.kv.tokenizer``.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"
_HEADERS = {"Content-Type": "application/json"}
REQUEST_ID_HEADER = "X-Infera-Request-Id"  # infera.server.app.REQUEST_ID_HEADER
MAX_ERROR_SAMPLES = 5


# ------------------------------------------------------------------------------------ workload
def pseudo_vocabulary(seed: int, size: int = 30000) -> list[str]:
    """``size`` distinct lower-case pseudo-words of 2–4 consonant-vowel syllables."""
    rng = random.Random(f"vocab-{seed}")
    words: set[str] = set()
    out: list[str] = []
    while len(out) < size:
        w = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) + (rng.choice("nrslt") if rng.random() < 0.3 else "")
                    for _ in range(rng.randint(2, 4)))
        if w not in words:
            words.add(w)
            out.append(w)
    return out


def _sentences(rng: random.Random, vocab: list[str], n_words: int) -> str:
    """``n_words`` words as sentences of 6–18 words (capitalised, ending in a full stop)."""
    parts: list[str] = []
    left = n_words
    while left > 0:
        k = min(left, rng.randint(6, 18))
        words = [rng.choice(vocab) for _ in range(k)]
        words[0] = words[0].capitalize()
        parts.append(" ".join(words) + ".")
        left -= k
    return " ".join(parts)


@dataclass
class Conversation:
    cid: int
    group: int
    user_turns: list[str]


@dataclass
class Workload:
    seed: int
    popularity: str
    zipf_s: float
    prefixes: list[str]                    # system prompt per group
    conversations: list[Conversation]
    group_probs: list[float]
    # Filled by measure(): exact token counts with the engines' tokenizer and chat template.
    prefix_tokens: list[int] = field(default_factory=list)  # tokens of each group's shared chat prefix
    turn1_tokens: list[int] = field(default_factory=list)   # prompt tokens of a few first turns (sample)

    def messages(self, conv: Conversation, turn: int, replies: list[str]) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.prefixes[conv.group]}]
        for t in range(turn + 1):
            msgs.append({"role": "user", "content": conv.user_turns[t]})
            if t < turn:
                msgs.append({"role": "assistant", "content": replies[t]})
        return msgs

    def shared_prefix_blocks(self, block_size: int) -> list[int]:
        """Full KV blocks of each group's shared prefix (what every conversation of it can reuse)."""
        return [n // block_size for n in self.prefix_tokens]


def group_probabilities(groups: int, popularity: str, zipf_s: float) -> list[float]:
    if popularity == "uniform":
        return [1.0 / groups] * groups
    w = [1.0 / (rank ** zipf_s) for rank in range(1, groups + 1)]
    total = sum(w)
    return [x / total for x in w]


def tokens_per_word(count_tokens: Callable[[str], int], vocab: list[str]) -> float:
    """Mean tokens per pseudo-word of ``vocab`` in sentences, from one fixed 400-word sample."""
    return count_tokens(_sentences(random.Random(0), vocab, 400)) / 400.0


def _words_for_tokens(count_tokens: Callable[[str], int], rng: random.Random, vocab: list[str],
                      target: int) -> str:
    """Sentences of pseudo-words whose token count is within a few tokens of ``target``."""
    per_word = tokens_per_word(count_tokens, vocab)
    n = max(1, round(target / per_word))
    state = rng.getstate()
    for _ in range(4):
        rng.setstate(state)
        text = _sentences(rng, vocab, n)
        got = count_tokens(text)
        if abs(got - target) <= max(2, target // 200):
            break
        n = max(1, n + round((target - got) / per_word))
    return text


def build_workload(*, seed: int, groups: int, prefix_tokens: int, turns: int, user_tokens: int, popularity: str,
                   zipf_s: float, conversations: int, count_tokens: Callable[[str], int]) -> Workload:
    """Everything the clients will send, before any reply is known (replies are appended live)."""
    vocab = pseudo_vocabulary(seed)
    prefixes = []
    for g in range(groups):
        rng = random.Random(f"prefix-{seed}-{g}")
        body = _words_for_tokens(count_tokens, rng, vocab, prefix_tokens)
        prefixes.append(f"Reference document {g}. Answer using only this document.\n\n{body}")
    probs = group_probabilities(groups, popularity, zipf_s)
    pick = random.Random(f"groups-{seed}-{popularity}-{zipf_s}")
    # One sample text per target length, then cheap variations: tokenizing thousands of user turns
    # would dominate start-up, and lengths only need to be about right.
    n_user_words = max(3, round(user_tokens / tokens_per_word(count_tokens, vocab)))
    convs = []
    for cid in range(conversations):
        group = pick.choices(range(groups), weights=probs)[0]
        rng = random.Random(f"conv-{seed}-{cid}")
        users = [f"Question {cid}.{t + 1}: " + _sentences(rng, vocab, n_user_words) for t in range(turns)]
        convs.append(Conversation(cid, group, users))
    return Workload(seed, popularity, zipf_s, prefixes, convs, probs)


def distinct_prompts(*, seed: int, tag: str, count: int, target_tokens: int,
                     count_tokens: Callable[[str], int]) -> list[str]:
    """``count`` texts of about ``target_tokens`` tokens, none sharing more than a word or two of
    prefix with another (nor with another ``tag``'s): random pseudo-word sentences from the first
    word, so a prefix cache finds no block to reuse. Lengths are calibrated once (words x mean tokens per word), not per
    text, because tokenizing hundreds of long prompts would dominate start-up."""
    vocab = pseudo_vocabulary(seed)
    n_words = max(1, round(target_tokens / tokens_per_word(count_tokens, vocab)))
    return [_sentences(random.Random(f"prompt-{seed}-{tag}-{i}"), vocab, n_words) for i in range(count)]


def measure(workload: Workload, encode_chat: Callable[[list[dict]], list[int]]) -> None:
    """Exact token counts of each group's shared prefix: the common prefix of two chats that differ
    only in the user turn, under the engines' chat template."""
    workload.prefix_tokens = []
    for g, text in enumerate(workload.prefixes):
        a = encode_chat([{"role": "system", "content": text}, {"role": "user", "content": "Alpha beta."}])
        b = encode_chat([{"role": "system", "content": text}, {"role": "user", "content": "Zulu yankee."}])
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        workload.prefix_tokens.append(n)
    workload.turn1_tokens = [len(encode_chat(workload.messages(c, 0, []))) for c in workload.conversations[:8]]


# -------------------------------------------------------------------------------------- client
def percentile(sorted_values: list[float], q: float) -> float | None:
    n = len(sorted_values)
    if n == 0:
        return None
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


async def one_chat(session: aiohttp.ClientSession, url: str, body: bytes,
                   headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One streamed chat completion. Returns a record (``error`` set on failure)."""
    clock = time.perf_counter
    start = clock()
    rec: dict[str, Any] = {"t_start": start, "error": None}
    try:
        async with session.post(url, data=body, headers=headers or _HEADERS) as resp:
            if resp.status != 200:
                text = (await resp.read())[:300].decode("utf-8", "replace")
                rec["error"] = f"HTTP {resp.status}: {text}"
                return rec
            first = None
            done = False
            usage = None
            pieces: list[str] = []
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                if first is None:
                    first = clock()
                obj = json.loads(payload)
                if "error" in obj:
                    rec["error"] = f"SSE error event: {str(obj['error'])[:300]}"
                    return rec
                for ch in obj.get("choices") or ():
                    delta = ch.get("delta") or {}
                    if delta.get("content"):
                        pieces.append(delta["content"])
                if obj.get("usage"):
                    usage = obj["usage"]
            end = clock()
            if not done or first is None:
                rec["error"] = "stream ended without data: [DONE]"
                return rec
            if not usage:
                rec["error"] = "no usage in the stream (stream_options.include_usage ignored?)"
                return rec
            details = usage.get("prompt_tokens_details") or {}
            rec.update(ttft=first - start, latency=end - start, t_end=end, reply="".join(pieces),
                       prompt_tokens=int(usage.get("prompt_tokens") or 0),
                       cached_tokens=int(details.get("cached_tokens") or 0),
                       completion_tokens=int(usage.get("completion_tokens") or 0),
                       has_cached_field="cached_tokens" in details)
            return rec
    except Exception as exc:  # transport errors, timeouts, bad JSON: all count as errors
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        return rec


async def run_load(workload: Workload, url_for: Callable[[Conversation], str], *, model: str, concurrency: int,
                   max_requests: int, max_tokens: int, request_timeout: float = 120.0,
                   on_progress: Callable[[int], None] | None = None, rate: float | None = None,
                   seed: int = 0) -> dict[str, Any]:
    """Closed loop: ``concurrency`` users play conversations until ``max_requests`` are issued.
    Open loop (``rate`` requests/s): conversations arrive as a Poisson process of rate / turns per
    second (seeded), each one played by its own user, turn after turn, until ``max_requests`` are
    issued; concurrency is whatever the fleet's latency makes it. Routers compared at one rate
    then make the load generator and the engines do the same work per second, which a closed
    loop does not (a faster router raises the request rate, and with it every process's load)."""
    state = {"next_conv": 0, "issued": 0}
    records: list[dict[str, Any]] = []
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    convs = workload.conversations

    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     skip_auto_headers=("User-Agent",)) as session:
        t0 = time.perf_counter()

        async def user(one: bool = False) -> None:
            while state["issued"] < max_requests:
                i = state["next_conv"]
                state["next_conv"] = i + 1
                conv = convs[i % len(convs)]
                await play(conv)
                if one:
                    return

        async def play(conv: Conversation) -> None:
            replies: list[str] = []
            for turn in range(len(conv.user_turns)):
                if state["issued"] >= max_requests:
                    return
                state["issued"] += 1
                body = json.dumps({"model": model, "messages": workload.messages(conv, turn, replies),
                                   "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                                   "stream": True, "stream_options": {"include_usage": True}},
                                  separators=(",", ":")).encode()
                # Our router logs picks under this id (debug level): a pick traces to its conversation.
                rec = await one_chat(session, url_for(conv), body,
                                     {**_HEADERS, REQUEST_ID_HEADER: f"c{conv.cid}-t{turn + 1}-g{conv.group}"})
                rec.update(cid=conv.cid, group=conv.group, turn=turn + 1)
                records.append(rec)
                if on_progress is not None:
                    on_progress(len(records))
                if rec["error"] is not None:
                    await asyncio.sleep(0.01)
                    break  # the conversation cannot go on without the reply
                replies.append(rec.pop("reply"))

        if rate is None:
            await asyncio.gather(*(user() for _ in range(concurrency)))
        else:
            rng = random.Random(seed)
            turns = max(1, sum(len(c.user_turns) for c in convs) / max(1, len(convs)))
            tasks: list[asyncio.Task] = []
            next_at = time.perf_counter()
            while state["issued"] < max_requests:
                tasks.append(asyncio.ensure_future(user(one=True)))
                next_at += rng.expovariate(rate / turns)
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            await asyncio.gather(*tasks)
    return {"t0": t0, "records": records, "conversations_started": state["next_conv"]}


def summarize(load: dict[str, Any]) -> dict[str, Any]:
    recs = load["records"]
    ok = [r for r in recs if r["error"] is None]
    errs = [r for r in recs if r["error"] is not None]
    ttft = sorted(r["ttft"] for r in ok)
    lat = sorted(r["latency"] for r in ok)
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    out_tok = sum(r["completion_tokens"] for r in ok)
    elapsed = (max(r["t_end"] for r in ok) - load["t0"]) if ok else 0.0
    ms = lambda v: None if v is None else round(v * 1000.0, 3)  # noqa: E731

    def hit(rs: list[dict]) -> float | None:
        p = sum(r["prompt_tokens"] for r in rs)
        return round(sum(r["cached_tokens"] for r in rs) / p, 4) if p else None

    warm = sorted(r["ttft"] for r in ok if r["prompt_tokens"] and r["cached_tokens"] >= r["prompt_tokens"] / 2)
    cold = sorted(r["ttft"] for r in ok if not (r["prompt_tokens"] and r["cached_tokens"] >= r["prompt_tokens"] / 2))
    return {
        "issued": len(recs), "completed": len(ok), "errors": len(errs),
        "error_samples": [r["error"] for r in errs[:MAX_ERROR_SAMPLES]],
        "conversations_started": load["conversations_started"],
        "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": out_tok,
        "hit_rate": hit(ok),
        "hit_rate_turn1": hit([r for r in ok if r["turn"] == 1]),
        "hit_rate_later_turns": hit([r for r in ok if r["turn"] > 1]),
        "cached_field_missing": sum(1 for r in ok if not r.get("has_cached_field")),
        "elapsed_s": round(elapsed, 3),
        "rps": round(len(ok) / elapsed, 3) if elapsed > 0 else 0.0,
        "out_tok_s": round(out_tok / elapsed, 2) if elapsed > 0 else 0.0,
        "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p90_ms": ms(percentile(ttft, 90)),
        "ttft_p99_ms": ms(percentile(ttft, 99)), "ttft_mean_ms": ms(sum(ttft) / len(ttft)) if ttft else None,
        # TTFT of requests that found at least half of their prompt cached, and of the others.
        "warm_requests": len(warm), "ttft_p50_warm_ms": ms(percentile(warm, 50)),
        "ttft_p50_cold_ms": ms(percentile(cold, 50)),
        "lat_p50_ms": ms(percentile(lat, 50)), "lat_p90_ms": ms(percentile(lat, 90)),
    }
