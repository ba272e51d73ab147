"""Preparing a request for the kv-aware pick: its prompt's token ids (tokenized once per request,
cached across requests, off the event loop when big) and the hashes of its blocks per block size
in use. A prompt is tokenized only as far as it can matter to the pick (:class:`Horizon`: past the
first block no target holds, nothing can), and one of ``HASH_AHEAD_TOKENS`` or more is hashed here a
slice at a time rather than inside the pick. :class:`KvPrepare` is a base of
:class:`~infera.router.kv_aware.KvAwarePolicy` holding its ``prepare_cached``/``prepare`` hooks and
the lookup of a request's hashes (``_hashes``) the pick uses.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from infera.api.cache_hints import parse_cache_hints
from infera.kv.hashing import ROUTER_SEED, block_hash_array, chain_root
from infera.kv.prompt import PromptTokenizer
from infera.router.kv_hash_cache import BlockHashCache, hash_stepwise
from infera.router.lora import LORA_BASE, LORA_NAME
from infera.router.policy import RoutedRequest

# Prompts of at least this many tokens are hashed before the pick, a slice at a time (see
# prepare() and kv_hash_cache.hash_stepwise), for at most this many distinct block sizes (a fleet
# has one or two).
HASH_AHEAD_TOKENS = 16384
MAX_BLOCK_SIZES_AHEAD = 4


def _tokenizer_model(request: RoutedRequest) -> Any:
    """The model whose tokenizer renders the prompt: a LoRA adapter's base (``router/lora.py``)."""
    return request.state.get(LORA_BASE) or getattr(request.parsed, "model", None)


def _root(state: dict) -> int:
    """The chain's first parent: under the request's cache_salt (the server's: the salt the engine
    is sent) and its LoRA adapter, as the engine hashes it."""
    return chain_root(state.get("cache_salt"), state.get(LORA_NAME))


class HorizonPolicy(Protocol):
    """What a :class:`Horizon` reads of its policy (the kv-aware policy)."""

    hash_cache: BlockHashCache
    _first_unheld: Any  # the index's first_unheld (set whenever the horizon is on)

    def _held_anywhere(self, block: int) -> bool: ...


class Horizon:
    """How far a prompt's tokens can matter to its pick, for ``PromptTokenizer.token_ids``.

    Every target's hit is the longest prefix of the prompt's blocks it holds (in its view, or
    extended by blocks in flight or served there: ``pick``). So once a block is held by no target
    at all, for every block size in use, no hit can reach past it: the blocks after it cannot
    change which target wins, only add the same cost to every target. The tokenizer checks after
    each cached piece and after the first words of each new piece, and stops there: a long new
    turn, a document no worker has seen, costs a block's worth of tokenizing and hashing.

    ``chains``: per block size, the hashes of the full blocks checked (the pick's, when the ids
    stop at the last check); ``cut``: (tokens, characters encoded, characters in all), where the
    tokenizer stopped. The charge, the blocks in flight and the metrics then count the rest of
    the prompt by an estimate (``more_tokens``)."""

    __slots__ = ("_policy", "_open", "_root", "chains", "cut")

    def __init__(self, policy: HorizonPolicy, sizes: tuple[int, ...], root: int = ROUTER_SEED) -> None:
        self._policy = policy
        self._open = set(sizes)  # block sizes whose horizon is not reached yet
        self._root = root  # the chain's first parent: a salted prompt's salt_root
        self.chains: dict[int, list[int]] = {}
        self.cut: tuple[int, int, int] | None = None

    def needed(self, n_ids: int) -> int:
        """Tokens after the first ``n_ids`` that complete the next block of every open size."""
        return max((bs - n_ids % bs for bs in self._open), default=0)

    def reached(self, ids: Sequence[int]) -> bool:
        held = self._policy._held_anywhere
        first_unheld = self._policy._first_unheld
        for bs in tuple(self._open):
            n = len(ids) // bs
            chain = self.chains.get(bs)
            if chain is None:
                chain = self.chains[bs] = self._policy.hash_cache.hashes(ids, bs, self._root)
                start = 0
            elif n > len(chain):
                start = len(chain)
                chain += block_hash_array(ids[start * bs:n * bs], bs, chain[-1] if chain else self._root)
            else:
                continue
            i = first_unheld(chain, start)  # most blocks are in some view: one dict lookup each
            while i < len(chain):
                if not held(chain[i]):
                    self._open.discard(bs)
                    break
                i = first_unheld(chain, i + 1)
        return not self._open

    def stop(self, tokens: int, chars: int, total_chars: int) -> None:
        self.cut = (tokens, chars, total_chars)


class KvPrepare:
    """Tokenizing and hashing a request's prompt before the pick (a base of the kv-aware policy,
    which sets the attributes below)."""

    prompts: Any
    _prompts_for: Callable[[Any], Any] | None
    _tokenize: Callable[..., Any]
    _block_sizes: set[int]
    _first_unheld: Callable[..., int] | None
    horizon: bool
    hash_cache: BlockHashCache

    def prepare_cached(self, request: RoutedRequest) -> bool:
        """``prepare`` done synchronously when the prompt's token ids are cached (a repeated prompt:
        the common case), so the caller awaits no coroutine for it; False: ``prepare`` must run."""
        parsed = request.parsed
        prompts = self._prompts_for(_tokenizer_model(request)) if self._prompts_for is not None else self.prompts
        if type(prompts) is PromptTokenizer:
            tokens, keyed = prompts.lookup(request.route, parsed)
        else:
            lookup = getattr(prompts, "lookup", None)
            if lookup is None:
                return False
            tokens, keyed = lookup(request.route, parsed)
        st = request.state
        if tokens is None:
            st["prompt_keyed"] = (prompts, keyed)  # prepare() tokenizes without keying the prompt again
            return False
        st["tokens"] = tokens
        st["hints"] = parse_cache_hints(parsed)
        return len(tokens) < HASH_AHEAD_TOKENS or not self._block_sizes  # else prepare() hashes ahead

    async def prepare(self, request: RoutedRequest) -> None:
        """Tokenize once per request (cached across requests), before any pick: at most the
        prompt's routing prefix, off the event loop when it is big (``PromptTokenizer``), and
        only as far as it can matter (``Horizon``)."""
        st = request.state
        parsed = request.parsed
        prompts = self._prompts_for(_tokenizer_model(request)) if self._prompts_for is not None else self.prompts
        handed = st.pop("prompt_keyed", None)
        keyed = handed[1] if handed is not None and handed[0] is prompts else None
        if "tokens" in st:  # prepare_cached() found them
            tokens = st["tokens"]
        elif prompts is None:  # its tokenizer is loading: routed by load for that moment
            tokens: Sequence[int] = ()
        elif self.horizon and self._block_sizes and isinstance(prompts, PromptTokenizer):
            made: list[Horizon] = []
            sizes = tuple(self._block_sizes)

            def horizon() -> Horizon:
                made.append(Horizon(self, sizes, _root(st)))
                return made[-1]

            tokens = await prompts.token_ids(request.route, parsed, horizon=horizon, keyed=keyed)
            if made:
                st["chains"] = made[0].chains  # hashes of a prefix of the ids: the pick goes on from them
                if made[0].cut is not None:
                    n, chars, total_chars = made[0].cut
                    # The prompt goes on: its blocks count as missed and in flight as before, by an
                    # estimate from the characters not encoded.
                    st["more_tokens"] = int(n * (total_chars - chars) / chars) if chars else 0
        elif keyed is not None:
            tokens = await prompts.token_ids(request.route, parsed, keyed=keyed)
        elif prompts is self.prompts:
            tokens = await self._tokenize(request.route, parsed)
        else:
            tokens = await prompts.token_ids(request.route, parsed)
        st["tokens"] = tokens
        st["hints"] = parse_cache_hints(parsed)
        if len(tokens) >= HASH_AHEAD_TOKENS and self._block_sizes:
            # Hashing 100k+ tokens is tens of ms of Python: done here a slice at a time, yielding
            # to the loop between slices, rather than in one go inside pick().
            root = _root(st)
            request.state["hashes"] = {bs: await hash_stepwise(tokens, bs, root) for bs in tuple(self._block_sizes)}

    def _hashes(self, request: RoutedRequest, block_size: int) -> Sequence[int]:
        st = request.state
        by_size = st.get("hashes")
        if by_size is None:
            by_size = st["hashes"] = {}
        hashes = by_size.get(block_size)
        if hashes is None:
            tokens = st.get("tokens") or ()
            chain = st["chains"].get(block_size) if "chains" in st else None
            if chain:  # the Horizon's, of a prefix of these tokens (or a little more: see _cut_ids)
                n = len(tokens) // block_size
                hashes = chain[:n] if len(chain) >= n else chain + block_hash_array(
                    tokens[len(chain) * block_size:n * block_size], block_size, chain[-1])
            elif len(tokens) >= block_size:
                hashes = self.hash_cache.hashes(tokens, block_size, _root(st))
            else:
                hashes = []
            by_size[block_size] = hashes
        return hashes
