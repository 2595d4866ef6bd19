"""Refusals in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from aiohttp import web

# OpenAI's code for a prompt, or a prompt and its completion, longer than the model's context.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class ApiError(Exception):
    """`param`: the request field at fault (OpenAI's `param`); `code`: OpenAI's machine-readable
    code where it has one. 4xx for what the client sent, 5xx only for the server's own failures."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)
