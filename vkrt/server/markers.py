"""Output markers that are special tokens: a parser must see them, so they stay in the text.

A family's think or tool-call tags may be special tokens of its vocabulary (decoding with
special tokens skipped, as OpenAI requests do by default, would drop them and leave the parser
blind) or plain added tokens (kept either way). Which one a model has is read from its tokenizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from vkrt.engine.config import SamplingParams


def special_ids(tokenizer: Any, markers: Iterable[str]) -> dict[str, int]:
    """The markers that are one special token of `tokenizer` (its decoding skips them), by id."""
    found = {}
    for marker in markers:
        ids = tokenizer.encode(marker, add_special_tokens=False) if tokenizer is not None else []
        if len(ids) == 1 and tokenizer.decode(ids) == "" and tokenizer.decode(ids, skip_special_tokens=False) == marker:
            found[marker] = ids[0]
    return found


def keep_markers(params: SamplingParams, special: dict[str, int]) -> SamplingParams:
    """`params` with special tokens kept in the text when a marker the output is read by is one."""
    return dataclasses.replace(params, skip_special_tokens=False) if special else params
