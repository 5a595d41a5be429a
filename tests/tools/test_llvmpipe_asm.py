"""tools/llvmpipe_asm.py's loop summary, on a hand-written objdump listing."""

from __future__ import annotations

from types import ModuleType

from tests.tools.conftest import load_tool


def _tool() -> ModuleType:
    return load_tool("llvmpipe_asm")


LISTING = """
0000000000000000 <cs_variant>:
   10:\tvmovaps 0x20(%rsp),%ymm0
   14:\tcall   *%rbx
   16:\tvmulps %ymm1,%ymm0,%ymm0
   1a:\tvaddps %ymm0,%ymm2,%ymm2
   1e:\tvmulps %ymm1,%ymm0,%ymm0
   22:\tcmp    %eax,%ecx
   24:\tjb     10 <cs_variant+0x10>
   26:\tjmp    40 <cs_variant+0x40>
   28:\tret
"""


def test_reports_backward_jumps_only() -> None:
    found = _tool().loops(LISTING, minimum=3)
    assert len(found) == 1  # the forward jmp is not a loop
    assert "loop 10-24: 7 instructions, 1 calls" in found[0]
    assert "vmulps 2" in found[0]


def test_minimum_filters_small_loops() -> None:
    assert _tool().loops(LISTING, minimum=7) == []
