"""The lazy helpers of ``PromptTokenizer``'s piecewise encoding (``infera.kv.prompt``): a plain
chat's parts, each rendered only when its ids are not cached (``_ChatParts``), and the router's
horizon, made only when a piece is missing (``_LazyHorizon``)."""
from __future__ import annotations

from array import array
from typing import Any, Callable, Sequence


class _ChatParts(Sequence[str]):
    """A plain chat's parts (``chat_part_keys`` keyed them), each rendered when it is read: a
    part whose ids are cached is never built."""

    __slots__ = ("_messages", "_affixes")

    def __init__(self, messages: Sequence[Any], affixes: tuple[str, str, str, str]) -> None:
        self._messages = messages
        self._affixes = affixes

    def __len__(self) -> int:
        return len(self._messages) + 1

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        prefix, sep, suffix, generation = self._affixes
        if i == len(self._messages):
            return generation
        m = self._messages[i]
        role, content = (m["role"], m.get("content")) if isinstance(m, dict) else (m.role, m.content)
        return f"{prefix}{role}{sep}{content if content is not None else ''}{suffix}"


class _LazyHorizon:
    """The caller's horizon, made only when a piece is missing (a cached prompt needs none)."""

    __slots__ = ("_make", "_made", "stopped")

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._made: Any = None
        self.stopped = False

    def _get(self) -> Any:
        if self._made is None:
            self._made = self._make()
        return self._made

    def reached(self, ids: array) -> bool:
        return self._get().reached(ids)

    def needed(self, n_ids: int) -> int:
        return self._get().needed(n_ids)

    def stop(self, tokens: int, chars: int, total_chars: int) -> None:
        self.stopped = True
        self._get().stop(tokens, chars, total_chars)
