"""OpenAI error objects: ``{"error": {"message", "type", "code"}}`` with the right HTTP status."""
from __future__ import annotations

import msgspec

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(message: str, status: int, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code or str(status)}}


def error_bytes(message: str, status: int, code: str | None = None, param: str | None = None) -> bytes:
    return msgspec.json.encode(error_body(message, status, code, param))


class ApiError(Exception):
    """Raised anywhere in request handling; the server turns it into an OpenAI error response."""

    def __init__(self, status: int, message: str, code: str | None = None, *, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_bytes(self.message, self.status, self.code, self.param)


def sse_error_event(message: str, status: int = 502, code: str | None = None) -> bytes:
    """The SSE frame that ends a stream which failed after its first byte."""
    return b"data: " + error_bytes(message, status, code) + b"\n\n"
