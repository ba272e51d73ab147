"""The simulator's LoRA adapters, as vLLM 0.32 serves them: its flags (``--enable-lora``,
``--lora-modules name=path`` or its JSON form, ``--max-loras``), each adapter listed in
``/v1/models`` with the base model as ``parent``, requests naming an adapter as their model, and
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, as vLLM) with vLLM's messages and status codes.

An adapter's prompt is cached apart from the base model's and every other adapter's, as vLLM folds
the adapter into each block hash: the request's cache key is a :class:`LoraScope` (a ``str``, so the
cache and the events carry it where they carry a ``cache_salt``), whose chain starts from
``infera.kv.hashing.chain_root(salt, adapter)``; its first block's ``BlockStored`` names the adapter
as ``lora_name`` and first in that block's ``extra_keys`` (vLLM's ``to_event_extra_keys``). The sim
keeps no weights: a path is recorded, never read.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from infera.kv.hashing import chain_root, salt_root

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
DEFAULT_MAX_LORAS = 1  # vLLM's --max-loras default


class LoraScope(str):
    """A request's prefix-cache key under a LoRA adapter (and its ``cache_salt``, if any): a string
    unique to the pair (the engine-side hash seed), with both parts kept."""

    lora: str
    salt: str | None

    def __new__(cls, lora: str, salt: str | None = None) -> LoraScope:
        name = lora.encode("utf-8", "surrogatepass")
        self = super().__new__(cls, f"\x00lora\x00{len(name)}\x00{lora}\x00{salt or ''}")
        self.lora = lora
        self.salt = salt or None
        return self


def scope_root(key: str | None) -> int:
    """The router-space parent of a prompt's first block for a cache key: a plain salt's root, or
    an adapter's ``chain_root``."""
    if isinstance(key, LoraScope):
        return chain_root(key.salt, key.lora)
    return salt_root(key)


def first_block_keys(key: str) -> list[str]:
    """vLLM's ``extra_keys`` entry for a prompt's first block: the LoRA name first, then the salt."""
    if isinstance(key, LoraScope):
        return [key.lora] if key.salt is None else [key.lora, key.salt]
    return [key]


def lora_name_of(key: str | None) -> str | None:
    return key.lora if isinstance(key, LoraScope) else None


def parse_lora_module(text: str) -> tuple[str, str]:
    """One ``--lora-modules`` value: ``name=path``, or vLLM's JSON ``{"name": ..., "path": ...}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"invalid JSON for --lora-modules: {e}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
            raise argparse.ArgumentTypeError('--lora-modules JSON needs "name" and "path" strings')
        return obj["name"], obj["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules wants name=path or JSON, got {text!r}")
    return name, path


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (vLLM's flag)")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=None,
        help='adapters loaded at start: name=path or JSON {"name","path"} (needs --enable-lora)',
    )
    p.add_argument(
        "--max-loras",
        type=_positive_int,
        default=DEFAULT_MAX_LORAS,
        help="adapters a batch may mix (vLLM's flag); runtime loads beyond it are refused here",
    )


def check_lora_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if getattr(args, "lora_modules", None) and not args.enable_lora:
        p.error("--lora-modules needs --enable-lora")


class LoraAdapters:
    """The adapters an engine has loaded, by name (their paths)."""

    def __init__(self, args: argparse.Namespace, base_names: list[str]) -> None:
        self.enabled = bool(getattr(args, "enable_lora", False))
        self.max_loras = int(getattr(args, "max_loras", DEFAULT_MAX_LORAS) or DEFAULT_MAX_LORAS)
        self._bases = set(base_names)
        self.paths: dict[str, str] = dict(getattr(args, "lora_modules", None) or [])

    def holds(self, model: str | None) -> bool:
        return bool(model) and model in self.paths and model not in self._bases

    def scope(self, model: str | None, salt: str | None) -> str | None:
        """The cache key of a request for ``model`` under ``salt``: an adapter's scope, else the salt."""
        return LoraScope(model, salt) if model is not None and self.holds(model) else salt

    def cards(self, base: str, created: int) -> list[dict[str, Any]]:
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": path,
                "parent": base,
                "max_model_len": None,
                "permission": [],
            }
            for name, path in self.paths.items()
        ]

    def load(self, name: Any, path: Any) -> tuple[int, Any]:
        if not name or not path:
            return 400, _error("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        if name in self._bases:
            return 400, _error(
                f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput", 400
            )
        if name in self.paths:
            return 400, _error(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                "in place, set 'load_inplace' to True.",
                "InvalidUserInput",
                400,
            )
        if len(self.paths) >= self.max_loras:
            # (vLLM keeps more on the CPU; the sim holds at most --max-loras, so a fleet's bound shows)
            return 400, _error(
                f"The engine already holds --max-loras={self.max_loras} adapters.", "InvalidUserInput", 400
            )
        self.paths[name] = str(path)
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: Any) -> tuple[int, Any]:
        if not name:
            return 400, _error("'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400)
        if name not in self.paths:
            return 404, _error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        del self.paths[name]
        return 200, f"Success: LoRA adapter '{name}' removed successfully."


def _error(message: str, err_type: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": None, "code": code}}


def _reply(status: int, body: Any) -> web.Response:
    if isinstance(body, str):
        return web.Response(status=status, text=body)
    return web.json_response(body, status=status)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        raise web.HTTPBadRequest(text="invalid JSON body") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="the body must be a JSON object")
    return body


def install(app: web.Application, adapters: LoraAdapters, env: Mapping[str, str] | None = None) -> None:
    """vLLM's load/unload routes, when runtime updating is allowed (its env variable) and LoRA is on."""
    environ: Mapping[str, str] = os.environ if env is None else env
    if not adapters.enabled or environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() not in ("1", "true"):
        return

    async def load(request: web.Request) -> web.Response:
        body = await _json_body(request)
        return _reply(*adapters.load(body.get("lora_name"), body.get("lora_path")))

    async def unload(request: web.Request) -> web.Response:
        body = await _json_body(request)
        return _reply(*adapters.unload(body.get("lora_name")))

    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)
