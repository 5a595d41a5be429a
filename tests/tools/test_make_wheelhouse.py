"""tools/make_wheelhouse.py's resolution inputs (no download: that is pip's job): the
requirements are vkrt's dependencies, its test extra and its build backend, and the platform
tags are every manylinux tag the target's glibc accepts."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import tomllib

from tests.tools.conftest import load_tool

REPO = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    return load_tool("make_wheelhouse")


def test_requirements_are_the_projects_own() -> None:
    tool = _tool()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = tool.requirements(peer=False)
    assert set(project["dependencies"]) <= set(reqs)
    assert set(project["optional-dependencies"]["test"]) <= set(reqs)
    assert tool.BUILD_BACKEND in reqs and tool.PEER not in reqs
    assert tool.requirements(peer=True) == reqs + [tool.PEER]
    assert tool.BUILD_BACKEND in tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]


def test_platform_tags_cover_every_older_glibc() -> None:
    tags = _tool().platform_tags("2.39", "x86_64")
    assert tags[0] == "manylinux_2_39_x86_64" and "manylinux_2_17_x86_64" in tags
    assert "manylinux_2_31_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert not any(t.startswith("manylinux_2_40") for t in tags)
    with pytest.raises(SystemExit, match="2.17 or newer"):
        _tool().platform_tags("2.5", "x86_64")


def test_wheel_names_normalise_to_project_names() -> None:
    name = _tool().project_name
    assert name(Path("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl")) == "pydantic-core"
    assert name(Path("MarkupSafe-3.0.2-cp312-cp312-manylinux_2_17_x86_64.whl")) == "markupsafe"
