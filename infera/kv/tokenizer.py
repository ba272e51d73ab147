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
from functools import lru_cache
from typing import Any, Iterable

import xxhash

# Ids below this are reserved for special tokens in the built-in tokenizer.
NUM_RESERVED_IDS = 100
BUILTIN_VOCAB_SIZE = 50_000 + NUM_RESERVED_IDS

BUILTIN_SPECIAL_TOKENS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in BUILTIN_SPECIAL_TOKENS) + ")")

# GPT-2 style pieces: contractions, letters, single digits, punctuation runs and underscores
# (each optionally with one leading space), then whitespace runs. Covers every character.
_PIECE_RE = re.compile(r"'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d| ?[^\s\w]+| ?_+|\s+(?!\S)|\s+")

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


@lru_cache(maxsize=1 << 16)
def _builtin_piece_id(piece: str) -> int:
    """Pure memo of piece -> id; most prompts reuse a small set of pieces."""
    return xxhash.xxh3_64_intdigest(piece.encode("utf-8")) % 50_000 + NUM_RESERVED_IDS


def split_pieces(text: str) -> list[str]:
    return _PIECE_RE.findall(text)


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


def chatml_format(messages: list[dict[str, Any]]) -> str:
    """The built-in chat format (ChatML), ending with the assistant generation prompt."""
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


class SimTokenizer(abc.ABC):
    """Common interface: encode text, render chat, map output token ids to text."""

    #: ``"builtin"`` or ``"hf"``.
    kind = "builtin"

    def __init__(self) -> None:
        self.output_token_ids, self._output_text = self._build_output_vocab()

    # --- to implement
    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``."""

    def segment_separators(self) -> list[str] | None:
        """Special tokens at which encoding splits the text into independent pieces (so each piece
        may be encoded and cached alone), or None when that is not guaranteed."""
        return None

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """Messages (already normalized) -> prompt text, with the generation prompt appended."""
        return chatml_format(messages)

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

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # No BOS in this vocabulary, so add_special_tokens changes nothing; literal special-token
        # strings (the ChatML markers) always map to their reserved ids.
        ids: list[int] = []
        for chunk in _SPECIAL_SPLIT.split(text):
            if not chunk:
                continue
            special = BUILTIN_SPECIAL_TOKENS.get(chunk)
            if special is not None:
                ids.append(special)
            else:
                ids.extend(_builtin_piece_id(p) for p in _PIECE_RE.findall(chunk))
        return ids


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
