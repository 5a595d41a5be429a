"""Imports point down: no module of vkrt imports one of a layer above its own.

The layers are the table under docs/ARCHITECTURE.md's "## Layers" heading, read top (highest)
to bottom: its first column names a layer, its second lists the layer's paths in backticks
(a folder ends in "/"). Every module under vkrt/ must sit in exactly one layer, and may import
modules of its own layer and of the layers below it. Every import counts: at the top of a
file, inside a function, under `if TYPE_CHECKING:`. A violation names the file, the line and
the two layers.

Usage: python tools/check_layers.py [--root REPO_ROOT]
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "vkrt"
TABLE_DOC = "docs/ARCHITECTURE.md"
HEADING = re.compile(r"^##\s+Layers\b")


@dataclass(frozen=True)
class Layer:
    name: str
    rank: int  # 0 is the top of the table
    paths: tuple[str, ...]  # "vkrt/server/" (a folder) or "vkrt/cli.py" (a file)

    def holds(self, rel: str) -> bool:
        return any(rel.startswith(p) if p.endswith("/") else rel == p for p in self.paths)


def read_layers(doc: Path) -> list[Layer]:
    """The layer table of `doc`, top layer first; ValueError if there is none."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    start = next((i for i, line in enumerate(lines) if HEADING.match(line)), None)
    if start is None:
        raise ValueError(f"{doc}: no '## Layers' section")
    layers: list[Layer] = []
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        paths = tuple(re.findall(r"`(vkrt/[^`]*)`", cells[1])) if len(cells) > 1 else ()
        if paths:
            layers.append(Layer(cells[0].strip("`* "), len(layers), paths))
        elif layers and not line.startswith("|"):
            break  # the table has ended
    if not layers:
        raise ValueError(f"{doc}: the '## Layers' section has no table rows naming vkrt/ paths")
    return layers


def module_path(module: str, root: Path) -> str | None:
    """The repo-relative file of a vkrt module (a package's __init__.py), or None."""
    rel = Path(*module.split("."))
    for candidate in (rel.with_suffix(".py"), rel / "__init__.py"):
        if (root / candidate).is_file():
            return candidate.as_posix()
    return None


def imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import of `package` in a module (`package`: its own dotted
    name, for relative imports). `from a import b` counts as a.b where b is a module, else a."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
            out.append((node.lineno, base))
    return out


def check(root: Path) -> list[str]:
    layers = read_layers(root / TABLE_DOC)
    problems: list[str] = []
    for file in sorted((root / PACKAGE).rglob("*.py")):
        rel = file.relative_to(root).as_posix()
        homes = [layer for layer in layers if layer.holds(rel)]
        if len(homes) != 1:
            where = "no layer" if not homes else f"{len(homes)} layers ({', '.join(h.name for h in homes)})"
            problems.append(f"{rel}: in {where} of the table in {TABLE_DOC}; list it in exactly one")
            continue
        home = homes[0]
        dotted = ".".join(Path(rel).with_suffix("").parts)
        package = dotted.removesuffix(".__init__") if rel.endswith("__init__.py") else dotted.rpartition(".")[0]
        seen: set[tuple[int, str]] = set()
        for line, name in imported_modules(ast.parse(file.read_text(encoding="utf-8"), rel), package):
            if name.split(".")[0] != PACKAGE:
                continue
            target = module_path(name, root)
            if target is None:
                continue  # a name imported from a module, counted as that module
            owner = next((layer for layer in layers if layer.holds(target)), None)
            if owner is not None and owner.rank < home.rank and (line, owner.name) not in seen:
                seen.add((line, owner.name))
                problems.append(f"{rel}:{line}: {home.name} imports {name} of {owner.name}, a layer above it")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args(argv)
    try:
        problems = check(args.root)
    except (OSError, ValueError) as exc:
        print(f"check_layers: {exc}", file=sys.stderr)
        return 2
    layers = read_layers(args.root / TABLE_DOC)
    print("layers, top to bottom: " + " > ".join(layer.name for layer in layers))
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} import(s) point up the layers", file=sys.stderr)
        return 1
    print("every import points down (or within its layer)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
