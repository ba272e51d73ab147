"""Tokenization, chat templating and output-token text for the simulated engine.

Two modes, picked by ``load_tokenizer(model)``:

* ``model`` is a directory with ``tokenizer.json``: a real HuggingFace ``tokenizers`` tokenizer and
  (if present) the model's Jinja chat template from ``tokenizer_config.json``/``chat_template.jinja``.
* anything else: a built-in deterministic tokenizer (GPT-2-like pre-tokenization, id = hash of the
  piece) and a ChatML chat format. No files needed, same ids in every process.

Generated text comes from a fixed list of common English words, each emitted as ``" " + word``.
Output token ids are chosen so that re-tokenizing generated text (e.g. the assistant turn of a
follow-up chat request) yields the same ids where the tokenizer allows, keeping multi-turn prefix
caching realistic.
"""
from __future__ import annotations

import abc
import json
import os
import re
from collections import Counter
from typing import Any, Iterable, Iterator

import xxhash

from infera.kv.native import native

# Ids below this are reserved for special tokens in the built-in tokenizer.
NUM_RESERVED_IDS = 100
BUILTIN_VOCAB_SIZE = 50_000 + NUM_RESERVED_IDS

BUILTIN_SPECIAL_TOKENS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in BUILTIN_SPECIAL_TOKENS) + ")")

# GPT-2 style pieces: contractions, letters, single digits, punctuation runs and underscores
# (each optionally with one leading space), then whitespace runs. Covers every character.
_PIECE_RE = re.compile(r"'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d| ?[^\s\w]+| ?_+|\s+(?!\S)|\s+")
# The same pieces over ASCII bytes, ~2x faster (no per-piece str.encode, a bytes scan): the classes
# agree on ASCII except \x1c-\x1f, which str's \s counts as whitespace and bytes' does not, so
# text holding one of those takes the str pattern (``BuiltinTokenizer.iter_encode``).
_PIECE_RE_ASCII = re.compile(rb"'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]| ?[^\s\w]+| ?_+|\s+(?!\S)|\s+")
_STR_ONLY_SPACE = re.compile("[\x1c-\x1f]")

# Text that non-text content parts contribute to the prompt.
IMAGE_MARKER = "<image>"
AUDIO_MARKER = "<audio>"
VIDEO_MARKER = "<video>"
_PART_MARKERS = {
    "image_url": IMAGE_MARKER,
    "image": IMAGE_MARKER,
    "image_pil": IMAGE_MARKER,
    "image_embeds": IMAGE_MARKER,
    "input_image": IMAGE_MARKER,
    "input_audio": AUDIO_MARKER,
    "audio_url": AUDIO_MARKER,
    "video_url": VIDEO_MARKER,
}

OUTPUT_WORDS: tuple[str, ...] = tuple(
    """the of and to in is you that it he was for on are as with his they at be this have from or one
    had by word but not what all were we when your can said there use an each which she do how their if
    will up other about out many then them these so some her would make like him into time has look two
    more write go see number no way could people my than first water been call who oil its now find long
    down day did get come made may part over new sound take only little work know place year live me back
    give most very after thing our just name good sentence man think say great where help through much
    before line right too mean old any same tell boy follow came want show also around form three small
    set put end does another well large must big even such because turn here why ask went men read need
    land different home us move try kind hand picture again change off play spell air away animal house
    point page letter mother answer found study still learn should world high every near add food between
    own below country plant last school father keep tree never start city earth eye light thought head
    under story saw left few while along might close something seem next hard open example begin life
    always those both paper together got group often run""".split()
)


def _piece_hash_id(piece: str) -> int:
    return xxhash.xxh3_64_intdigest(piece.encode("utf-8")) % 50_000 + NUM_RESERVED_IDS


# No memo of piece ids: hashing a piece (~60 ns) is cheaper than looking it up in a table big enough
# to help. A 64k-entry LRU memo made encoding 1.6x slower on prompts with a 30k-word vocabulary
# (bench/kv_path.py, "tokenize"): its misses evict, and its hits miss the CPU caches.


def split_pieces(text: str) -> list[str]:
    return _PIECE_RE.findall(text)


# -- cutting a long text where its tokenization is not disturbed -----------------------------------
# A letter or digit followed by whitespace is a pre-tokenization boundary for the GPT-2, Llama-3
# and Qwen style regex pre-tokenizers, SentencePiece's Metaspace and the built-in tokenizer: the
# whitespace starts the next piece, and no piece runs from a letter or digit on across a space.
# (Punctuation is avoided: Llama-3's ``?[^\s\p{L}\p{N}]+[\r\n]*`` takes the newlines after it.)
_CUT_SPACE = " \t\n\r"
_CUT_RE = re.compile(r"[^\W_](?=[ \t\n\r])")
_CUT_NEAR_CHARS = 256  # scanned char by char first: ordinary text has a boundary within a word
_CUT_WINDOW_CHARS = 65536  # then regex windows, going back
_ENCODE_SLICE_CHARS = 8192  # the built-in tokenizer's scan: ~1 ms per slice


def _last_cut(text: str, lo: int, hi: int) -> int | None:
    """The last word boundary n in (lo, hi] (``text[n]`` whitespace, ``text[n-1]`` a letter or
    digit; needs hi < len(text)), or None."""
    i = hi
    stop = max(lo, hi - _CUT_NEAR_CHARS)
    while i > stop:
        if text[i] in _CUT_SPACE and text[i - 1].isalnum():
            return i
        i -= 1
    while stop > lo:  # regex windows over (start, stop], going back
        start = max(lo, stop - _CUT_WINDOW_CHARS)
        last = None
        for last in _CUT_RE.finditer(text, start, stop + 1):  # endpos stop+1: the lookahead sees text[stop]
            pass
        if last is not None:
            return last.end()
        stop = start
    return None


def prefix_cut(text: str, limit: int, separators: Iterable[str] | None = None) -> int:
    """Where to cut ``text`` to at most ``limit`` chars so that ``text[:n]`` tokenizes as a prefix
    of ``text``'s tokens (up to the last few, which callers drop: a post-processor may append a
    token, and an exotic pre-tokenizer may look further ahead). ``len(text)`` when it fits; 0
    when no safe cut exists (no word boundary and no special token before ``limit``).

    ``separators``: the tokenizer's ``segment_separators()`` — special tokens it splits at before
    anything else, so a cut before or after one is safe too."""
    if len(text) <= limit:
        return len(text)
    best = 0
    for sep in separators or ():
        at = text.rfind(sep, 0, limit)  # wholly before limit
        if at >= 0:
            best = max(best, at + len(sep))
    cut = _last_cut(text, best, limit)
    return best if cut is None else cut


class ChatTemplateError(ValueError):
    """Messages that cannot be rendered (bad shape, template raised)."""


def content_to_text(content: Any) -> str:
    """A message's ``content`` (string, list of parts, or None) as the text the model sees.

    Text parts are joined with newlines (as vLLM does for string-format templates); media parts
    contribute a fixed marker.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatTemplateError("message content must be a string or a list of content parts")
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise ChatTemplateError("content parts must be objects")
        part_type = part.get("type")
        if part_type in ("text", "input_text", "refusal"):
            text = part.get(part_type if part_type == "refusal" else "text")
            if not isinstance(text, str):
                raise ChatTemplateError(f"content part of type {part_type!r} needs a string field")
            texts.append(text)
        elif part_type in _PART_MARKERS:
            texts.append(_PART_MARKERS[part_type])
        else:
            raise ChatTemplateError(f"Unknown part type: {part_type}")
    return "\n".join(texts)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate chat messages and flatten their content to strings (other keys are kept)."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string")
        flat = dict(message)
        flat["content"] = content_to_text(message.get("content"))
        out.append(flat)
    return out


#: ChatML: message m is PREFIX + role + SEP + content + SUFFIX, and the prompt ends with GENERATION.
CHATML_AFFIXES = ("<|im_start|>", "\n", "<|im_end|>\n", "<|im_start|>assistant\n")


def chatml_parts(messages: list[dict[str, Any]]) -> list[str]:
    """The built-in chat format (ChatML) a message at a time, then the assistant generation prompt."""
    prefix, sep, suffix, generation = CHATML_AFFIXES
    parts = [f"{prefix}{m['role']}{sep}{m['content']}{suffix}" for m in messages]
    parts.append(generation)
    return parts


def chatml_format(messages: list[dict[str, Any]]) -> str:
    """The built-in chat format (ChatML), ending with the assistant generation prompt."""
    return "".join(chatml_parts(messages))


class SimTokenizer(abc.ABC):
    """Common interface: encode text, render chat, map output token ids to text."""

    #: ``"builtin"`` or ``"hf"``.
    kind = "builtin"

    def __init__(self) -> None:
        self.output_token_ids, self._output_text = self._build_output_vocab()

    #: True when ``encode_many`` runs without the GIL (HF ``tokenizers``' batch encode), so a
    #: worker thread running it leaves the event loop free; the built-in one is pure Python.
    releases_gil = False

    # --- to implement
    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``."""

    def encode_many(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """``[encode(t) for t in texts]``, in one call (one GIL release for HF tokenizers)."""
        return [self.encode(t, add_special_tokens) for t in texts]

    def iter_encode(self, text: str, add_special_tokens: bool = False) -> Iterator[list[int]]:
        """``encode(text)`` in consecutive parts, so a caller on the event loop can yield between
        them (one part unless the tokenizer can split its work exactly)."""
        yield self.encode(text, add_special_tokens)

    def segment_separators(self) -> list[str] | None:
        """Special tokens at which encoding splits the text into independent pieces (so each piece
        may be encoded and cached alone), or None when that is not guaranteed."""
        return None

    @property
    def exact_segments(self) -> bool:
        """True when encoding piece by piece between ``segment_separators()`` is equal to encoding
        the whole text by construction, so callers need not verify it on samples."""
        return False

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """Messages (already normalized) -> prompt text, with the generation prompt appended."""
        return chatml_format(messages)

    def render_chat_parts(self, messages: list[dict[str, Any]]) -> list[str] | None:
        """``render_chat`` as consecutive parts, one per message (then the generation prompt),
        when the template renders each message on its own, with a special token at every part's
        start; None when it may not (a template of the model's own: Jinja can look across
        messages). With ``exact_segments``, the prompt's ids are then the parts' ids end to end."""
        if type(self).render_chat is not SimTokenizer.render_chat:
            return None
        return chatml_parts(messages)

    def chatml_affixes(self) -> tuple[str, str, str, str] | None:
        """``CHATML_AFFIXES`` when ``render_chat_parts`` renders each message as prefix + role +
        sep + content + suffix and ends with the generation prompt (the built-in ChatML), so a
        message's part can be keyed without rendering it; None for a template of the model's own."""
        cls = type(self)
        if cls.render_chat is not SimTokenizer.render_chat or cls.render_chat_parts is not SimTokenizer.render_chat_parts:
            return None
        return CHATML_AFFIXES

    # --- shared
    def encode_chat(self, messages: Any) -> list[int]:
        """Validate, render with the chat template and encode (template supplies special tokens)."""
        return self.encode(self.render_chat(normalize_messages(messages)), add_special_tokens=False)

    def output_text(self, token_id: int) -> str:
        """Text of one generated token (always from the output word list)."""
        text = self._output_text.get(token_id)
        if text is None:
            # Not produced by us (e.g. tests feeding arbitrary ids): still deterministic.
            return " " + OUTPUT_WORDS[token_id % len(OUTPUT_WORDS)]
        return text

    def decode_output(self, token_ids: Iterable[int]) -> str:
        return "".join(self.output_text(t) for t in token_ids)

    def _single_token_id(self, text: str) -> int | None:
        ids = self.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def _build_output_vocab(self) -> tuple[list[int], dict[int, str]]:
        """One distinct id per output word: the tokenizer's own id for ``" word"`` when that is a
        single token no other word shares (``[UNK]`` is shared), else a synthetic hash id."""
        candidates = {word: self._single_token_id(" " + word) for word in OUTPUT_WORDS}
        shared = Counter(c for c in candidates.values() if c is not None)
        text_by_id: dict[int, str] = {}
        for word in OUTPUT_WORDS:
            text = " " + word
            token_id = candidates[word]
            salt = 0
            while token_id is None or shared[token_id] > 1 or token_id in text_by_id:
                token_id = xxhash.xxh3_64_intdigest(text.encode("utf-8"), seed=salt) % 50_000 + NUM_RESERVED_IDS
                salt += 1
            text_by_id[token_id] = text
        return list(text_by_id), text_by_id


class BuiltinTokenizer(SimTokenizer):
    """Deterministic file-free tokenizer: piece id = xxh3_64(piece) % 50000 + 100."""

    kind = "builtin"
    vocab_size = BUILTIN_VOCAB_SIZE

    def segment_separators(self) -> list[str] | None:
        return list(BUILTIN_SPECIAL_TOKENS)  # encode() splits at exactly these first

    @property
    def exact_segments(self) -> bool:
        # iter_encode splits at exactly the separators first, then encodes each chunk alone: the
        # pieces are the whole. Not so for a subclass that changes the encoding.
        cls = type(self)
        return cls.encode is BuiltinTokenizer.encode and cls.iter_encode is BuiltinTokenizer.iter_encode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if native is not None:
            ids = native.encode_builtin(text, True)  # special tokens split out in C too
            if ids is not None:
                return ids
        ids = []
        for part in self.iter_encode(text, add_special_tokens):
            ids.extend(part)
        return ids

    def iter_encode(self, text: str, add_special_tokens: bool = False) -> Iterator[list[int]]:
        # No BOS in this vocabulary, so add_special_tokens changes nothing; literal special-token
        # strings (the ChatML markers) always map to their reserved ids.
        xxh, findall, ascii_findall = xxhash.xxh3_64_intdigest, _PIECE_RE.findall, _PIECE_RE_ASCII.findall
        for chunk in _SPECIAL_SPLIT.split(text):
            if not chunk:
                continue
            special = BUILTIN_SPECIAL_TOKENS.get(chunk)
            if special is not None:
                yield [special]
                continue
            # Slices of ~1 ms each (a long prompt is tens of ms of work, which must not run on
            # the event loop in one go, and findall() would hold the GIL for its whole scan), cut
            # at word boundaries, where no piece of _PIECE_RE spans the cut: the same pieces.
            start, n = 0, len(chunk)
            while start < n:
                end = start + _ENCODE_SLICE_CHARS
                if end >= n:
                    end = n
                else:
                    cut = _last_cut(chunk, start, end)
                    if cut is None:
                        found = _CUT_RE.search(chunk, end)
                        cut = found.end() if found else n
                    end = cut
                part = chunk[start:end] if start or end < n else chunk
                ids = native.encode_builtin(part) if native is not None else None
                if ids is not None:  # ASCII without \x1c-\x1f: the C scan of _PIECE_RE_ASCII's pieces
                    yield ids
                elif part.isascii() and not _STR_ONLY_SPACE.search(part):
                    yield [xxh(p) % 50_000 + NUM_RESERVED_IDS for p in ascii_findall(part.encode("ascii"))]
                else:
                    # _piece_hash_id, inlined (a call per token is a third of the cost)
                    yield [xxh(p.encode("utf-8")) % 50_000 + NUM_RESERVED_IDS for p in findall(part)]
                start = end


def _token_content(value: Any) -> str | None:
    """``bos_token``/``eos_token`` in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_chat_template(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None


class HFTokenizer(SimTokenizer):
    """A real ``tokenizers`` tokenizer plus the model's Jinja chat template."""

    kind = "hf"

    def __init__(self, model_dir: str) -> None:
        from tokenizers import Tokenizer  # only needed in this mode

        self.model_dir = model_dir
        self._tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.vocab_size = self._tok.get_vocab_size()
        config: dict[str, Any] = {}
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        template_text = _pick_chat_template(config.get("chat_template"))
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if template_text is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template_text = f.read()
        # No template at all: fall back to ChatML rather than refusing chat (a sim convenience).
        self._template = _compile_chat_template(template_text) if template_text else None
        super().__init__()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    # ``Tokenizer.encode`` holds the GIL for the whole call; the batch encoders release it
    # (tokenizers 0.23: a 1 MiB prompt in a thread left the loop thread's 1 ms sleeps at p50 1.1 ms,
    # against one 800 ms stall with ``encode``). ``encode_batch_fast`` (no offsets) also spares the
    # GIL-held free of the offsets when the result is dropped: 25 ms for 380k tokens, 0.4 ms
    # without; it encodes 2× faster too. What still holds the GIL is turning ``.ids`` into a
    # list (~20 ns a token).
    releases_gil = True

    def encode_many(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        batch = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch  # fast: tokenizers >= 0.20
        return [e.ids for e in batch(texts, add_special_tokens=add_special_tokens)]

    def segment_separators(self) -> list[str] | None:
        # ``tokenizers`` splits the input at added tokens before normalizing and pre-tokenizing each
        # piece on its own — unless a token strips neighbouring whitespace or is normalized.
        added = list(self._tok.get_added_tokens_decoder().values())
        if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added if t.special):
            return None
        return [t.content for t in added if t.special]

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if self._template is None:
            return chatml_format(messages)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except ChatTemplateError:
            raise
        except Exception as e:  # template bugs or raise_exception() -> a client-visible 400
            raise ChatTemplateError(f"chat template error: {e}") from e


def _compile_chat_template(source: str):
    """Compile like transformers does: sandboxed, trim/lstrip blocks, raise_exception + tojson."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def load_tokenizer(model: str) -> SimTokenizer:
    """HF tokenizer if ``model`` is a directory with ``tokenizer.json``, else the built-in one."""
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "tokenizer.json")):
        return HFTokenizer(model)
    return BuiltinTokenizer()
