"""The package's shape: lines per module and the largest functions (for architecture reviews).

Usage: python benchmarks/code_shape.py [PACKAGE_DIR] [--top N]
Prints a table of modules (code lines, comment lines, comment share) and the N longest
functions. Run it on two checkouts to compare before and after a restructuring.
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from pathlib import Path


def line_counts(path: Path) -> tuple[int, int]:
    """(code lines, comment lines); docstrings count as code, blank lines as neither."""
    source = path.read_text()
    comment_lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comment_lines.add(token.start[0])
    code = sum(1 for number, line in enumerate(source.splitlines(), start=1)
               if line.strip() and not line.strip().startswith("#"))
    return code, len(comment_lines)


def functions(path: Path, root: Path) -> list[tuple[int, str]]:
    out = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            out.append((size, f"{path.relative_to(root)}::{node.name}"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default=str(Path(__file__).parents[1] / "megatron_packing"))
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    root = Path(args.package)
    rows, largest = [], []
    for path in sorted(root.rglob("*.py")):
        code, comments = line_counts(path)
        rows.append((str(path.relative_to(root)), code, comments))
        largest.extend(functions(path, root))
    total_code = sum(r[1] for r in rows)
    total_comments = sum(r[2] for r in rows)
    print("| module | code lines | comment lines |\n|---|---|---|")
    for name, code, comments in rows:
        print(f"| {name} | {code} | {comments} |")
    print(f"| **{len(rows)} modules** | **{total_code}** | **{total_comments}** "
          f"({100 * total_comments / max(total_code, 1):.1f}%) |")
    print("\n| largest functions | lines |\n|---|---|")
    for size, name in sorted(largest, reverse=True)[: args.top]:
        print(f"| {name} | {size} |")


if __name__ == "__main__":
    main()
