"""Kernel-level tests call exactly the ops they name: the fusion layer's deferral and folding
are off here unless a test is marked `fusion`, so a composition of primitives really runs
unfused and can be compared with the fused kernel it stands for."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vkrt.ops import fusion


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fusion: run with the fusion layer on (vkrt.ops.fusion)")


@pytest.fixture(autouse=True)
def _ops_unfused(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("fusion") is not None:
        yield
        return
    with fusion.disabled():
        yield
