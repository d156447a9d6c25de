#!/usr/bin/env python3
"""Source lines per package of src/kvtier, modules over 500 lines and functions over 100 lines:
the size measures issue 14 ("One idea, one place") asks for before and after its moves.

    python3 scripts/source-size.py [SRC_DIR]      (default: src/kvtier)
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

MODULE_LINES = 500
FUNCTION_LINES = 100


def main(root: Path) -> None:
    """Print the three measures for the package at `root`."""
    lines: Counter[str] = Counter()
    files: Counter[str] = Counter()
    big_modules: list[tuple[int, str]] = []
    big_functions: list[tuple[int, str]] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        unit = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        text = path.read_text()
        n = len(text.splitlines())
        lines[unit] += n
        files[unit] += 1
        if n > MODULE_LINES:
            big_modules.append((n, str(rel)))
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > FUNCTION_LINES:
                    big_functions.append((length, f"{rel}:{node.lineno} {node.name}"))
    total = sum(lines.values())
    print(f"source lines per package ({total} in all):")
    for unit, n in lines.most_common():
        print(f"  {unit:16s} {n:6d} lines  {files[unit]:3d} files  {100 * n / total:5.1f}%")
    print(f"modules over {MODULE_LINES} lines:")
    for n, name in sorted(big_modules, reverse=True):
        print(f"  {n:6d}  {name}")
    print(f"functions over {FUNCTION_LINES} lines:")
    for n, name in sorted(big_functions, reverse=True):
        print(f"  {n:6d}  {name}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("src/kvtier"))
