"""The API's error: an OpenAI-shaped JSON body with its HTTP status."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import Response


class ApiError(Exception):
    """A request's failure: its HTTP status, message and the OpenAI ``param``/``code`` it names."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def body(self) -> dict[str, Any]:
        kind = {429: "rate_limit_error", 404: "not_found_error", 413: "request_too_large",
                500: "internal_server_error", 503: "service_unavailable"}.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # ASCII JSON: a message quoting the client's text may hold lone surrogates, which UTF-8 cannot
        return Response(json.dumps(self.body), status_code=self.status, media_type="application/json")


def clip(value: object, n: int = 80) -> str:
    """``value``'s repr cut to ``n`` characters, to quote client input in a message."""
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."
