"""What a sim engine received: a middleware on its app records each request's JSON body."""
from __future__ import annotations

import json

from aiohttp import web


class EngineBodies:
    """``server.app.middlewares.append(bodies.record)`` before the sim starts; ``bodies.bodies``
    then holds every ``POST /v1/*`` body the engine got, in order."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    @web.middleware
    async def record(self, request: web.Request, handler):
        if request.method == "POST" and request.path.startswith("/v1/"):
            self.bodies.append(json.loads(await request.read()))  # read() is cached for the handler
        return await handler(request)
