"""Keep device knowledge out of vkrt's upper layers (design invariant 1).

Scans every ``.py`` file under ``vkrt/`` except the backend (``vkrt/backend/**``) and
native-kernel modules (``vkrt/ops/**/native*.py``) with the ``ast`` module, and fails on:

* importing the ``vulkan`` binding, or ``vkrt.backend.vulkan`` and its submodules
  (absolute, relative, ``from vkrt.backend import vulkan``, ``importlib.import_module``);
* naming a device type or a backend access path: an identifier or string literal that
  contains a word from ``DEVICE_WORDS``. Docstrings and comments are prose and are not
  scanned. The bare word "vulkan" is allowed (``--device vulkan`` is a user-facing value).

A line may opt out with a comment ``# device-leak-ok: <reason>``. Every escape is printed
on every run; an escape without a reason, or on a line with nothing to escape, is an error.

Usage: python tools/check_device_leakage.py [--root REPO_ROOT]
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# Words that name a device, driver, vendor or backend access path. Matched
# case-insensitively as whole words, where identifiers split on "_" and camelCase.
DEVICE_WORDS: tuple[str, ...] = (
    "llvmpipe",
    "lavapipe",
    "nvidia",
    "amd",
    "radv",
    "intel",
    "anv",
    "mesa",
    "moltenvk",
    "gb10",
    "VK_PHYSICAL_DEVICE_TYPE",
    "discrete",
    "integrated gpu",
    "texel",
    "ssbo",
)

# Modules the upper layers must not import (the module itself or any submodule).
FORBIDDEN_MODULES: tuple[str, ...] = ("vulkan", "vkrt.backend.vulkan")

PACKAGE = "vkrt"
EXEMPT_DIRS: tuple[str, ...] = ("vkrt/backend/",)
EXEMPT_NATIVE_UNDER = "vkrt/ops/"  # files named native*.py below this are kernel code

ESCAPE_RE = re.compile(r"#\s*device-leak-ok\b:?(?P<reason>.*)$")


def _word_pattern(word: str) -> re.Pattern[str]:
    parts = [re.escape(p) for p in re.split(r"[\s_]+", word.lower()) if p]
    return re.compile(r"(?<![a-z0-9])" + r"[\s_\-]*".join(parts) + r"(?![a-z0-9])")


_WORD_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (word, _word_pattern(word)) for word in DEVICE_WORDS
)


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


def device_word_in(text: str, *, identifier: bool = False) -> str | None:
    """Return the first DEVICE_WORDS entry that ``text`` names, or None."""
    if identifier:
        # isAMD -> is_AMD, RADVQueue -> RADV_Queue, NvidiaQuirk -> Nvidia_Quirk
        text = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", text)
        text = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", text)
    lowered = text.lower()
    for word, pattern in _WORD_PATTERNS:
        if pattern.search(lowered):
            return word
    return None


def is_forbidden_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in FORBIDDEN_MODULES)


def is_scanned(rel: str) -> bool:
    """Whether a repo-relative posix path is subject to the scan."""
    if not rel.startswith(PACKAGE + "/") or not rel.endswith(".py"):
        return False
    if any(rel.startswith(d) for d in EXEMPT_DIRS):
        return False
    return not (rel.startswith(EXEMPT_NATIVE_UNDER) and Path(rel).name.startswith("native"))


def _package_of(rel: str) -> list[str]:
    """Package a module's relative imports resolve against (same for __init__.py)."""
    return rel.removesuffix(".py").split("/")[:-1]


def _docstring_ids(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    ids.add(id(body[0].value))
    return ids


def _identifiers(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr
    elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        yield node.name
    elif isinstance(node, ast.arg):
        yield node.arg
    elif isinstance(node, ast.keyword) and node.arg:
        yield node.arg
    elif isinstance(node, ast.alias):
        yield node.asname or node.name
    elif isinstance(node, ast.ExceptHandler) and node.name:
        yield node.name
    elif isinstance(node, ast.Global | ast.Nonlocal):
        yield from node.names


def _import_violations(node: ast.AST, package: list[str]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            if is_forbidden_module(alias.name):
                yield f"imports {alias.name}"
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            if node.level - 1 >= len(package):
                return  # beyond the top-level package: Python rejects it anyway
            base = package[: len(package) - (node.level - 1)]
            module = ".".join([*base, *([node.module] if node.module else [])])
        else:
            module = node.module or ""
        shown = "." * node.level + (node.module or "")
        if is_forbidden_module(module):
            yield f"imports {module}" + (f" (from {shown})" if node.level else "")
            return
        for alias in node.names:
            if is_forbidden_module(f"{module}.{alias.name}"):
                yield f"imports {module}.{alias.name} (from {shown} import {alias.name})"
    elif isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in ("import_module", "__import__") and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                if is_forbidden_module(first.value):
                    yield f"imports {first.value} (via {name})"


def _escapes(source: str) -> dict[int, str]:
    escapes: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            match = ESCAPE_RE.search(tok.string)
            if match:
                escapes[tok.start[0]] = match.group("reason").strip()
    return escapes


def scan_source(source: str, rel: str) -> tuple[list[Finding], list[Finding]]:
    """Scan one file's text. Returns (violations, escapes used or malformed)."""
    try:
        tree = ast.parse(source, filename=rel)
        escapes = _escapes(source)
    except (SyntaxError, tokenize.TokenError) as exc:
        return [Finding(rel, getattr(exc, "lineno", None) or 1, f"cannot parse: {exc}")], []

    package = _package_of(rel)
    docstrings = _docstring_ids(tree)
    raw: list[tuple[int, int, str]] = []  # (first line, last line, reason)
    for node in ast.walk(tree):
        first = getattr(node, "lineno", None)
        if first is None:
            continue
        last = getattr(node, "end_lineno", None) or first
        for reason in _import_violations(node, package):
            raw.append((first, last, reason))
        for name in _identifiers(node):
            word = device_word_in(name, identifier=True)
            if word:
                raw.append((first, last, f"identifier {name!r} names a device ({word!r})"))
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            word = device_word_in(node.value)
            if word:
                shown = node.value if len(node.value) <= 40 else node.value[:37] + "..."
                raw.append((first, last, f"string {shown!r} names a device ({word!r})"))

    violations: list[Finding] = []
    used: set[int] = set()
    for first, last, reason in sorted(set(raw)):
        escaped = [n for n in range(first, last + 1) if n in escapes]
        if escaped:
            used.update(escaped)
        else:
            violations.append(Finding(rel, first, reason))

    escape_findings: list[Finding] = []
    for line, reason in sorted(escapes.items()):
        if not reason:
            violations.append(Finding(rel, line, "device-leak-ok escape without a reason"))
        elif line not in used:
            violations.append(
                Finding(rel, line, "device-leak-ok escape on a line with nothing to escape")
            )
        else:
            escape_findings.append(Finding(rel, line, f"escape: {reason}"))
    violations.sort(key=lambda f: f.line)
    return violations, escape_findings


def scanned_files(root: Path) -> list[Path]:
    package_dir = root / PACKAGE
    if not package_dir.is_dir():
        return []
    return sorted(
        p for p in package_dir.rglob("*.py") if is_scanned(p.relative_to(root).as_posix())
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="repository root (default: this checkout)",
    )
    args = parser.parse_args(argv)
    root: Path = args.root.resolve()

    files = scanned_files(root)
    violations: list[Finding] = []
    escapes: list[Finding] = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        found, escaped = scan_source(path.read_text(encoding="utf-8"), rel)
        violations.extend(found)
        escapes.extend(escaped)

    for finding in escapes:
        print(finding)
    for finding in violations:
        print(finding)
    print(
        f"device-leakage: {len(files)} files scanned, {len(escapes)} escapes, "
        f"{len(violations)} violations"
    )
    if violations:
        print(
            "Upper layers must stay device-agnostic (design invariant 1): move device "
            "knowledge into vkrt/backend/, or add '# device-leak-ok: <reason>' to the line.",
            file=sys.stderr,
        )
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
