"""Stored responses (`store: true`): what GET /v1/responses/{id} returns and the conversation a follow-up with
previous_response_id continues. Bounded by count and by characters, least recently used dropped first: a
follow-up of a dropped response gets a 400 naming it."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_CHARS = 256 * 1024 * 1024


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the Response object, as returned
    conversation: list[dict[str, Any]]  # chat messages through this response's output (instructions excluded)
    size: int = 0


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        stored.size = len(json.dumps(stored.response)) + len(json.dumps(stored.conversation))
        self.delete(response_id)
        if stored.size > self.max_chars or self.max_responses <= 0:
            return  # larger than the whole store: not kept
        self._items[response_id] = stored
        self._chars += stored.size
        while len(self._items) > self.max_responses or self._chars > self.max_chars:
            _, old = self._items.popitem(last=False)
            self._chars -= old.size

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._items.pop(response_id, None)
        if stored is None:
            return False
        self._chars -= stored.size
        return True
