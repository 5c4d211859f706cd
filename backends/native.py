"""Common constructor of the servers' own (non-OpenAI) protocols: llama.cpp, TGI, SGLang native."""

from __future__ import annotations

from typing import Any

from backends.base import Backend
from workloads.contracts import Api


class NativeBackend(Backend):
    """Takes the options ``bench`` gives every backend; plain-text prompts only (``api`` completions)."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        api: Api | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(base_url, model, api_key)
        if api == "chat":
            raise ValueError(
                f"{self.name} sends plain-text prompts; use --api completions or its OpenAI backend"
            )
        self.extra_body = dict(extra_body or {})

    def body_extras(self, extra: dict[str, Any]) -> dict[str, Any]:
        """The backend's and then the request's pass-through fields."""
        return {**self.extra_body, **extra}
