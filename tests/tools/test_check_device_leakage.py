"""tools/check_device_leakage.py on small fake trees, and on this checkout."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from tests.tools.conftest import load_tool

REPO = Path(__file__).resolve().parents[2]


def _load_checker() -> ModuleType:
    return load_tool("check_device_leakage")


checker = _load_checker()


def run(root: Path, files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    code = checker.main(["--root", str(root)])
    return code, capsys.readouterr().out


def test_clean_file_passes(tmp_path, capsys):
    code, out = run(
        tmp_path,
        {
            "vkrt/engine/sched.py": (
                '"""Runs on NVIDIA and llvmpipe alike: docstrings are prose."""\n'
                "from vkrt.backend import get_backend  # the factory is allowed\n"
                "command = 'amd64 canvas intelligence'  # substrings are not words\n"
                "device = 'vulkan'\n"
            )
        },
        capsys,
    )
    assert code == 0, out
    assert "device-leakage: 1 files scanned, 0 escapes, 0 violations" in out


def test_import_vulkan_fails_with_file_and_line(tmp_path, capsys):
    code, out = run(tmp_path, {"vkrt/models/llama.py": "x = 1\nimport vulkan\n"}, capsys)
    assert code == 1
    assert "vkrt/models/llama.py:2: imports vulkan" in out
    assert "1 violations" in out


def test_from_vulkan_import_fails(tmp_path, capsys):
    code, out = run(
        tmp_path, {"vkrt/models/llama.py": "from vulkan import vkCreateInstance\n"}, capsys
    )
    assert code == 1
    assert "vkrt/models/llama.py:1: imports vulkan" in out


def test_absolute_backend_vulkan_import_fails(tmp_path, capsys):
    code, out = run(
        tmp_path, {"vkrt/engine/llm.py": "from vkrt.backend.vulkan.device import X\n"}, capsys
    )
    assert code == 1
    assert "vkrt/engine/llm.py:1: imports vkrt.backend.vulkan.device" in out


def test_relative_backend_vulkan_import_fails(tmp_path, capsys):
    code, out = run(
        tmp_path,
        {
            "vkrt/engine/llm.py": "from ..backend.vulkan import x\n",
            "vkrt/engine/__init__.py": "from ..backend import vulkan\n",
        },
        capsys,
    )
    assert code == 1
    assert "vkrt/engine/llm.py:1: imports vkrt.backend.vulkan (from ..backend.vulkan)" in out
    assert "vkrt/engine/__init__.py:1: imports vkrt.backend.vulkan" in out


def test_import_module_of_backend_vulkan_fails(tmp_path, capsys):
    code, out = run(
        tmp_path,
        {
            "vkrt/server/app.py": "import importlib\nimportlib.import_module('vkrt.backend.vulkan')\n"
        },
        capsys,
    )
    assert code == 1
    assert "vkrt/server/app.py:2: imports vkrt.backend.vulkan (via import_module)" in out


@pytest.mark.parametrize(
    "line",
    [
        "name = 'llvmpipe'",
        "if dev == 'NVIDIA GeForce': pass",
        "kind = 'VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU'",
        "label = 'Integrated-GPU'",
        "path = f'{x}-texel'",
        "is_amd = True",
        "def use_ssbo(): pass",
        "class RADVQuirks: pass",
        "isIntel = False",
    ],
)
def test_device_words_fail(tmp_path, capsys, line):
    code, out = run(tmp_path, {"vkrt/engine/pick.py": line + "\n"}, capsys)
    assert code == 1, out
    assert "vkrt/engine/pick.py:1: " in out
    assert "names a device" in out


def test_escaped_line_passes_and_is_printed(tmp_path, capsys):
    code, out = run(
        tmp_path,
        {"vkrt/config.py": "ACCESS = ('texel', 'ssbo')  # device-leak-ok: VKRT_ACCESS values\n"},
        capsys,
    )
    assert code == 0, out
    assert "vkrt/config.py:1: escape: VKRT_ACCESS values" in out
    assert "1 escapes, 0 violations" in out


def test_escape_without_reason_fails(tmp_path, capsys):
    code, out = run(tmp_path, {"vkrt/config.py": "ACCESS = 'texel'  # device-leak-ok:\n"}, capsys)
    assert code == 1
    assert "vkrt/config.py:1: device-leak-ok escape without a reason" in out


def test_escape_with_nothing_to_escape_fails(tmp_path, capsys):
    code, out = run(tmp_path, {"vkrt/config.py": "x = 1  # device-leak-ok: stale\n"}, capsys)
    assert code == 1
    assert "vkrt/config.py:1: device-leak-ok escape on a line with nothing to escape" in out


def test_backend_and_native_kernels_are_not_scanned(tmp_path, capsys):
    code, out = run(
        tmp_path,
        {
            "vkrt/backend/vulkan/device.py": "import vulkan\nVENDOR = 'nvidia'\n",
            "vkrt/backend/__init__.py": "from vkrt.backend.vulkan import VulkanBackend\n",
            "vkrt/ops/matmul/native_vulkan.py": "from vkrt.backend.vulkan import x\n",
            "vkrt/ops/matmul/__init__.py": "",
            "tools/other.py": "import vulkan\n",
        },
        capsys,
    )
    assert code == 0, out
    assert "device-leakage: 1 files scanned, 0 escapes, 0 violations" in out


def test_unparsable_file_is_a_violation(tmp_path, capsys):
    code, out = run(tmp_path, {"vkrt/engine/broken.py": "def (:\n"}, capsys)
    assert code == 1
    assert "vkrt/engine/broken.py:1: cannot parse" in out


def test_this_checkout_is_clean(capsys):
    code = checker.main(["--root", str(REPO)])
    out = capsys.readouterr().out
    assert code == 0, out
