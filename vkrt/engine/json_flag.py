"""The JSON-object flags vLLM configures with (`--speculative-config`, `--kv-events-config`):
parsed and their keys checked the same way, so their errors read alike."""

from __future__ import annotations

import json
from collections.abc import Mapping, Set
from typing import Any

from vkrt.errors import VkrtError


def json_object(value: str | Mapping[str, Any] | None, flag: str, known: Set[str],
                example: str) -> Mapping[str, Any] | None:
    """The object `value` holds (the flag's text, or a dict), with only `known` keys; None for
    None or an empty string. VkrtError names the flag and what is wrong."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise VkrtError(f"{flag} is not JSON: {exc.msg} at character {exc.pos}") from None
    if not isinstance(value, Mapping):
        raise VkrtError(f"{flag} must be a JSON object, e.g. '{example}'")
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise VkrtError(f"{flag}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return value
