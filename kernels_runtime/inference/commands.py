"""What a serving front end sends the ranks (``service.py``): JSON-safe, torch-free, so the
notebook side (``workbench.serving``) builds commands without importing torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Command:
    kind: str  # "completion", "chat", "abort" or "stop"
    request_id: str = ""
    prompt: Any = None  # text or token ids (completion), or chat messages (chat)
    params: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields
    adapter: str | None = None  # the LoRA adapter's name (Engine(adapters=...)); None: base

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "request_id": self.request_id, "prompt": self.prompt,
                "params": self.params, "adapter": self.adapter}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Command:
        return cls(data["kind"], data.get("request_id", ""), data.get("prompt"),
                   dict(data.get("params") or {}), data.get("adapter"))
