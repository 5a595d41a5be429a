"""Op test fixtures: a spy on the shaders a Vulkan backend dispatches."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from vkrt.backend.base import Backend


class Shaders:
    """The shader families dispatched since the last clear(), with their spec constants."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[int, int]]] = []

    def families(self) -> list[str]:
        return [name.rsplit(".", 1)[0] for name, _ in self.seen]


@pytest.fixture
def shaders(vk: Backend, monkeypatch: pytest.MonkeyPatch) -> Iterator[Shaders]:
    seen = Shaders()
    run_shader = vk.run_shader  # type: ignore[attr-defined]

    def spy(name: str, bindings: Any, groups: Any, push: Any = None, spec: Any = None) -> Any:
        seen.seen.append((name, dict(spec or {})))
        return run_shader(name, bindings, groups, push, spec)

    monkeypatch.setattr(vk, "run_shader", spy)
    yield seen
