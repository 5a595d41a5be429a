"""Device selection, capability probe, falling back without Vulkan, layout checks."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import vkrt.backend
from vkrt.backend.base import Backend
from vkrt.backend.vulkan import device as vkdevice
from vkrt.backend.vulkan.kernels.common import grid_1d, local_size, module
from vkrt.backend.vulkan.pipelines import LayoutMismatch
from vkrt.errors import DeviceUnavailable, VkrtError

REPO = Path(__file__).resolve().parents[2]

# Makes `import vulkan` fail the way the binding does when libvulkan.so is missing (cffi
# raises OSError from dlopen); the system loader is found by soname, so hiding it by
# LD_LIBRARY_PATH would not work.
HIDE_LOADER = """
import sys
class _NoLoader:
    def find_spec(self, name, path=None, target=None):
        if name == "vulkan" or name.startswith("vulkan."):
            raise OSError("Cannot find Vulkan SDK version. Please ensure that it is installed")
        return None
sys.meta_path.insert(0, _NoLoader())
"""


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VKRT_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=full_env, capture_output=True,
                          text=True, timeout=120)


def run_cli(*args: str, prelude: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    code = prelude + f"\nimport sys\nfrom vkrt.cli import main\nsys.exit(main({list(args)!r}))\n"
    return run_python(code, **env)


# -- selection ------------------------------------------------------------------------------

@pytest.mark.parametrize("selector", ["0", "llvmpipe", "LLVMpipe"])
def test_device_selector_picks_llvmpipe(vk_default: Any, monkeypatch: pytest.MonkeyPatch,
                                        selector: str) -> None:
    monkeypatch.setenv("VKRT_DEVICE", selector)
    _, caps = vkdevice.choose(vk_default.devices)
    assert "llvmpipe" in caps.name


@pytest.mark.parametrize("selector", ["0", "llvmpipe"])
def test_device_selector_in_a_fresh_process(vk_default: Any, selector: str) -> None:
    result = run_cli("devices", "--json", VKRT_DEVICE=selector)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    chosen = next(d for d in info["devices"] if d["index"] == info["chosen"])
    assert "llvmpipe" in chosen["name"]


def test_unknown_device_names_the_available_ones(vk_default: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VKRT_DEVICE", "nosuchgpu")
    with pytest.raises(DeviceUnavailable) as info:
        vkdevice.choose(vk_default.devices)
    message = str(info.value)
    assert "nosuchgpu" in message
    for _, caps in vk_default.devices:
        assert caps.name in message


def test_device_index_out_of_range(vk_default: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VKRT_DEVICE", str(len(vk_default.devices)))
    with pytest.raises(DeviceUnavailable, match=f"only {len(vk_default.devices)} device"):
        vkdevice.choose(vk_default.devices)


def test_unknown_device_in_a_fresh_process(vk_default: Any) -> None:
    result = run_python(
        "from vkrt.backend import get_backend\n"
        "from vkrt.errors import DeviceUnavailable\n"
        "try:\n    get_backend('vulkan')\nexcept DeviceUnavailable as exc:\n    print('ERR', exc)\n",
        VKRT_DEVICE="nosuchgpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ERR ") and "nosuchgpu" in result.stdout
    assert "llvmpipe" in result.stdout  # names what is there


def _fake_caps(index: int, device_type: str) -> vkdevice.DeviceCaps:
    return vkdevice.DeviceCaps(index=index, name=f"dev{index}-{device_type}", device_type=device_type,
                               vendor_id=0, device_id=index, driver_version=0, api_version="1.2.0",
                               pipeline_cache_uuid="")


def test_ranking_prefers_discrete_then_integrated_then_virtual_then_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VKRT_DEVICE", raising=False)
    order = ["cpu", "virtual", "integrated", "discrete", "discrete"]
    devices = [(object(), _fake_caps(i, t)) for i, t in enumerate(order)]
    for expected in ("dev3-discrete", "dev2-integrated", "dev1-virtual", "dev0-cpu"):
        _, caps = vkdevice.choose(devices)
        assert caps.name == expected  # ties go to the lower index
        devices = [d for d in devices if d[1].device_type != caps.device_type]


# -- no Vulkan -----------------------------------------------------------------------------

# One child process per scenario: get_backend("auto") runs an op, then the CLI reports.
WITHOUT_VULKAN = """
import json, logging, sys
logging.basicConfig()
import numpy as np
from vkrt import ops
from vkrt.backend import get_backend
from vkrt.cli import main
b = get_backend("auto")
x = b.upload(np.array([1.0, 2.0], np.float32))
print(json.dumps({"backend": b.name, "add": ops.add(x, x).numpy().tolist()}))
for argv in (["devices"], ["devices", "--json"], ["ops", "--json"]):
    print("=====", flush=True)
    assert main(argv) == 0
"""

# (prelude, environment, words of the reason vkrt gives); the VK_* variables point the
# system loader at no driver at all.
NO_VULKAN = [
    pytest.param("", {"VKRT_DISABLE_VULKAN": "1"}, "VKRT_DISABLE_VULKAN", id="disabled"),
    pytest.param(HIDE_LOADER, {}, "libvulkan is not installed", id="no-loader"),
    pytest.param("", {"VK_ICD_FILENAMES": "/nonexistent/icd.json", "VK_DRIVER_FILES": "/nonexistent/icd.json"},
                 "vkCreateInstance failed", id="no-driver"),
]


@pytest.mark.parametrize(("prelude", "env", "reason_words"), NO_VULKAN)
def test_without_vulkan_everything_runs_on_reference(prelude: str, env: dict[str, str],
                                                     reason_words: str) -> None:
    result = run_python(prelude + WITHOUT_VULKAN, **env)
    assert result.returncode == 0, result.stderr
    auto, human, devices_json, ops_json = result.stdout.split("=====\n")
    assert json.loads(auto) == {"backend": "reference", "add": [2.0, 4.0]}
    assert "Vulkan unavailable" in result.stderr and reason_words in result.stderr  # logged why
    assert "Vulkan unavailable" in human and reason_words in human and "reference" in human
    devices = json.loads(devices_json)
    assert devices["vulkan"] is False and reason_words in devices["reason"]
    listed = json.loads(ops_json)
    assert listed["vulkan_available"] is False and reason_words in listed["reason"]
    assert all(row["vulkan"] is None and row["reference"] == "numpy" for row in listed["ops"])


def test_unimportable_binding_in_process(monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    """An ImportError (binding not installed) is reported too; nothing touches a device."""
    monkeypatch.setattr(vkrt.backend, "_vulkan_singleton", None)
    monkeypatch.setitem(sys.modules, "vulkan", None)  # `import vulkan` -> ImportError
    reason = vkrt.backend.vulkan_unavailable_reason()
    assert reason is not None and "could not be loaded" in reason
    caplog.set_level(logging.WARNING, logger="vkrt")
    backend = vkrt.backend.get_backend("auto")
    assert backend.name == "reference"
    assert any("Vulkan unavailable" in r.getMessage() for r in caplog.records)
    with pytest.raises(DeviceUnavailable):
        vkrt.backend.get_backend("vulkan")


# -- capabilities ----------------------------------------------------------------------------

def test_llvmpipe_caps_are_sane(vk_default: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VKRT_ACCESS", raising=False)
    physical, _ = vk_default.devices[vk_default.caps.index]
    caps = vkdevice.probe(vk_default.vk, physical, vk_default.caps.index)  # fresh: no test override
    if "llvmpipe" not in caps.name:
        pytest.skip(f"these expectations are for llvmpipe, not {caps.name}")
    assert caps.device_type == "cpu"
    assert caps.subgroup_size >= 1 and "basic" in caps.subgroup_ops
    assert caps.unified_memory is True
    assert caps.access_path == "texel"
    assert caps.max_allocation > 0 and caps.max_storage_range > 0 and caps.max_uniform_range > 0
    assert caps.max_texel_elements > 0 and caps.max_shared_memory > 0
    assert caps.max_push_constants >= 128  # the Vulkan minimum
    assert caps.max_workgroup_invocations >= 128
    assert caps.device_local_bytes > 0
    assert caps.as_dict()["name"] == caps.name


def test_access_override_flips_the_path(vk_default: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    physical, _ = vk_default.devices[vk_default.caps.index]
    for path in ("ssbo", "texel", "SSBO"):
        monkeypatch.setenv("VKRT_ACCESS", path)
        assert vkdevice.probe(vk_default.vk, physical, 0).access_path == path.lower()
    monkeypatch.setenv("VKRT_ACCESS", "smoke-signals")
    with pytest.raises(VkrtError, match="VKRT_ACCESS"):
        vkdevice.probe(vk_default.vk, physical, 0)


def test_access_override_in_a_fresh_process(vk_default: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VKRT_ACCESS", raising=False)
    physical, _ = vk_default.devices[vk_default.caps.index]
    default = vkdevice.probe(vk_default.vk, physical, 0).access_path
    flipped = {"texel": "ssbo", "ssbo": "texel"}[default]
    result = run_python(
        "import json\nfrom vkrt.backend import get_backend\n"
        "caps = get_backend('vulkan').caps\nprint(json.dumps([caps.name, caps.access_path]))\n",
        VKRT_ACCESS=flipped)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [vk_default.caps.name, flipped]


# -- pipeline layouts -------------------------------------------------------------------------

def _add_bindings(vk: Backend, n: int) -> tuple[Any, Any, Any]:
    return (vk.upload(np.ones(n, np.float32)), vk.upload(np.ones(n, np.float32)), vk.empty((n,), "f32"))


def test_wrong_binding_count_is_refused(vk_default: Any) -> None:
    name = module(vk_default, "elementwise", "add")
    a, b, y = _add_bindings(vk_default, 16)
    before = vk_default.counters.snapshot()
    with pytest.raises(LayoutMismatch, match="elementwise.add"):
        vk_default.run_shader(name, [(a, "f32", False), (y, "f32", True)], grid_1d(16),
                              ("<IIf", (16, 16, 0.0)), local_size())
    assert vk_default.counters.since(before)["dispatches"] == 0


def test_layout_is_checked_after_the_module_was_used(vk_default: Any) -> None:
    """A correct first call must not switch the check off for later, wrong ones."""
    name = module(vk_default, "elementwise", "add")
    a, b, y = _add_bindings(vk_default, 16)
    good = [(a, "f32", False), (b, "f32", False), (y, "f32", True)]
    vk_default.run_shader(name, good, grid_1d(16), ("<IIf", (16, 16, 0.0)), local_size())
    with pytest.raises(LayoutMismatch):
        vk_default.run_shader(name, good[:2], grid_1d(16), ("<IIf", (16, 16, 0.0)), local_size())
    with pytest.raises(LayoutMismatch):  # the output declared read-only
        vk_default.run_shader(name, [*good[:2], (y, "f32", False)], grid_1d(16),
                              ("<IIf", (16, 16, 0.0)), local_size())
    with pytest.raises(LayoutMismatch):  # an input declared written
        vk_default.run_shader(name, [(a, "f32", True), *good[1:]], grid_1d(16),
                              ("<IIf", (16, 16, 0.0)), local_size())
    np.testing.assert_array_equal(y.numpy(), np.full(16, 2.0, np.float32))  # the good call ran: 1 + 1


def test_push_constant_size_mismatch_is_refused(vk_default: Any) -> None:
    name = module(vk_default, "elementwise", "add")
    a, b, y = _add_bindings(vk_default, 16)
    with pytest.raises(VkrtError, match="push constants"):
        vk_default.run_shader(name, [(a, "f32", False), (b, "f32", False), (y, "f32", True)],
                              grid_1d(16), ("<I", (16,)), local_size())


def test_check_layout_against_the_manifest(vk_default: Any) -> None:
    name = module(vk_default, "elementwise", "add")
    actual = [(b["type"], b["written"]) for b in vk_default.pipelines.meta(name)["bindings"]]
    vk_default.pipelines.check_layout(name, actual)
    with pytest.raises(LayoutMismatch, match=name):
        vk_default.pipelines.check_layout(name, actual[:-1])
    with pytest.raises(VkrtError, match="no SPIR-V module"):
        vk_default.pipelines.meta("no_such_shader.texel")


def test_unknown_specialisation_constant_is_refused(vk_default: Any) -> None:
    name = module(vk_default, "elementwise", "add")
    with pytest.raises(VkrtError, match="specialisation constants"):
        vk_default.pipelines.get(name, {0: 64, 42: 1})
