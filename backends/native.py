"""What the servers' own (non-OpenAI) protocols share: llama.cpp, TGI, SGLang native."""

from __future__ import annotations

from backends.base import Backend
from workloads.contracts import GenRequest


class NativeBackend(Backend):
    """Plain-text prompts only (``api`` completions)."""

    @classmethod
    def check_api(cls, api: str | None) -> None:
        super().check_api(api)
        if api == "chat":
            raise ValueError(f"{cls.name} sends plain-text prompts; use --api completions or its OpenAI backend")

    def plain_prompt(self, req: GenRequest, endpoint: str, chat_backend: str) -> str:
        """``req``'s prompt for the server's ``endpoint``; a chat prompt (messages) is refused, naming
        ``chat_backend`` (the same server's OpenAI endpoints)."""
        if not isinstance(req.prompt, str):
            raise ValueError(f"{self.name} speaks {endpoint} (plain-text prompts); use backend '{chat_backend}' for chat")
        return req.prompt
