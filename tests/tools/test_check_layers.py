"""tools/check_layers.py on small fake trees, and on this checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tools.conftest import load_tool

REPO = Path(__file__).resolve().parents[2]
checker = load_tool("check_layers")

TABLE = """# Architecture

## Layers (imports point down)

| layer | paths | job |
| --- | --- | --- |
| engine | `vkrt/engine/` | the engine |
| ops | `vkrt/ops/`, `vkrt/extra.py` | ops |
| core | `vkrt/core/`, `vkrt/__init__.py` | the floor |

## Next section
"""


def tree(root: Path, files: dict[str, str], table: str = TABLE) -> Path:
    (root / "docs").mkdir(parents=True, exist_ok=True)
    (root / "docs" / "ARCHITECTURE.md").write_text(table, encoding="utf-8")
    base = {"vkrt/__init__.py": "", "vkrt/core/__init__.py": "", "vkrt/core/tensor.py": "X = 1\n",
            "vkrt/ops/__init__.py": "", "vkrt/engine/__init__.py": "", "vkrt/extra.py": ""}
    for rel, text in {**base, **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_the_table_is_read_top_down(tmp_path: Path) -> None:
    layers = checker.read_layers(tree(tmp_path, {}) / "docs" / "ARCHITECTURE.md")
    assert [(layer.name, layer.rank) for layer in layers] == [("engine", 0), ("ops", 1), ("core", 2)]
    assert layers[1].holds("vkrt/extra.py") and layers[1].holds("vkrt/ops/dispatch.py")
    assert not layers[1].holds("vkrt/extras.py")


def test_imports_down_and_within_a_layer_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tree(tmp_path, {"vkrt/engine/step.py": "from vkrt.ops import dispatch\nfrom vkrt.core.tensor import X\n",
                           "vkrt/ops/dispatch.py": "from vkrt.core import tensor\nfrom vkrt import extra\n"})
    assert checker.main(["--root", str(root)]) == 0
    assert "engine > ops > core" in capsys.readouterr().out


@pytest.mark.parametrize("source", [
    "from vkrt.engine import step\n",
    "import vkrt.engine.step\n",
    "from ..engine import step\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vkrt.engine.step import Step\n",
    "def later():\n    from vkrt.engine.step import Step\n    return Step\n",
])
def test_an_import_pointing_up_fails_naming_file_line_and_layers(tmp_path: Path, source: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    root = tree(tmp_path, {"vkrt/engine/step.py": "Step = 1\n", "vkrt/core/tensor.py": source})
    assert checker.main(["--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert "vkrt/core/tensor.py:" in out and "core imports vkrt.engine" in out and "of engine, a layer above" in out


def test_a_module_in_no_layer_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tree(tmp_path, {"vkrt/stray.py": ""})
    assert checker.main(["--root", str(root)]) == 1
    assert "vkrt/stray.py: in no layer" in capsys.readouterr().out


def test_a_missing_table_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tree(tmp_path, {}, table="# Architecture\n\nno table here\n")
    assert checker.main(["--root", str(root)]) == 2
    assert "no '## Layers' section" in capsys.readouterr().err


def test_this_checkout_points_down() -> None:
    assert checker.check(REPO) == []
