"""A stored response as every store returns it, and the error of a store that cannot be used."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchserve.procs.api.schemas import ChatMessageIn


class ResponseStoreError(RuntimeError):
    """The store cannot be used (its message names the store)."""


@dataclass
class StoredResponse:
    response: dict[str, Any]
    history: list[ChatMessageIn]  # the conversation through this response's answer, without its instructions
    size: int
