"""Under CI=true a missing prerequisite fails; elsewhere the tests that need it skip with why.

The Vulkan driver is hidden from a child process with VK_ICD_FILENAMES pointing at nothing
(the loader then finds no driver). The full command, `CI=true VK_ICD_FILENAMES=/nonexistent
bash tools/test.sh`, stops at its prerequisites step the same way (docs/TESTING.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
NEEDS_VULKAN = "tests/test_ci_prerequisites.py::test_the_vulkan_fixture_gives_a_device"


def test_the_vulkan_fixture_gives_a_device(vk_default: Any) -> None:
    """What the child processes below run: a test that needs the Vulkan device."""
    assert vk_default.caps.name


def _env(ci: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "VKRT_DISABLE_VULKAN")}
    env["VK_ICD_FILENAMES"] = "/nonexistent"
    if ci:
        env["CI"] = "true"
    return env


def _pytest(ci: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", NEEDS_VULKAN],
                          cwd=REPO, env=_env(ci), capture_output=True, text=True, timeout=300)


def test_missing_vulkan_fails_under_ci() -> None:
    child = _pytest(ci=True)
    assert child.returncode == 1, child.stdout[-2000:]
    assert "CI=true and Vulkan unavailable" in child.stdout, child.stdout[-2000:]
    assert "1 failed" in child.stdout or "1 error" in child.stdout, child.stdout[-2000:]


def test_missing_vulkan_skips_with_the_reason_elsewhere() -> None:
    child = _pytest(ci=False)
    assert child.returncode == 0, child.stdout[-2000:]
    assert "1 skipped" in child.stdout and "Vulkan unavailable" in child.stdout, child.stdout[-2000:]


def test_prerequisite_check_names_what_is_missing() -> None:
    """tools/check_prerequisites.py (the first check of tools/test.sh): exit 1 under CI."""
    for ci, rc in ((True, 1), (False, 0)):
        child = subprocess.run([sys.executable, "tools/check_prerequisites.py"], cwd=REPO, env=_env(ci),
                               capture_output=True, text=True, timeout=300)
        assert child.returncode == rc, child.stderr
        assert "Vulkan device unavailable" in child.stderr


def _collect(deselect: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "VKRT_TEST_DESELECT_MODELS"}
    env["VKRT_TEST_DESELECT_MODELS"] = deselect
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                           "tests/engine/test_token_exact.py", "tests/models/test_llama_golden.py"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_tests_needing_a_named_model_can_be_deselected_and_are_counted() -> None:
    """VKRT_TEST_DESELECT_MODELS (an offline machine's gpu_check run) drops exactly the tests
    whose fixtures need that model, and pytest reports how many it dropped."""
    everything, dropped = _collect(""), _collect("smollm2-135m-instruct")
    assert everything.returncode == dropped.returncode == 0, dropped.stdout[-2000:]
    kept = [line for line in dropped.stdout.splitlines() if "::" in line]
    assert kept and not any("smollm2" in line or "test_token_exact" in line for line in kept)
    assert any("tiny_llama" in line for line in kept)
    total = sum("::" in line for line in everything.stdout.splitlines())
    assert f"{len(kept)}/{total} tests collected ({total - len(kept)} deselected)" in dropped.stdout
    unknown = _collect("smollm2-135m-instruct,nonesuch")
    assert unknown.returncode != 0 and "unknown model nonesuch" in unknown.stdout + unknown.stderr


NEEDS_CHROMIUM = "tests/server/test_webui_browser.py::test_the_page_asks_for_the_api_key_and_sends_it"


def _pytest_without_chromium(ci: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["VKRT_TEST_CHROMIUM"] = "/nonexistent/chromium"
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", NEEDS_CHROMIUM],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_missing_chromium_fails_under_ci_and_skips_elsewhere() -> None:
    child = _pytest_without_chromium(ci=True)
    assert child.returncode == 1, child.stdout[-2000:]
    assert "CI=true and Chromium unavailable: /nonexistent/chromium not found" in child.stdout, child.stdout[-2000:]
    child = _pytest_without_chromium(ci=False)
    assert child.returncode == 0, child.stdout[-2000:]
    assert "1 skipped" in child.stdout and "apt-get install chromium" in child.stdout, child.stdout[-2000:]
