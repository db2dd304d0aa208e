"""Functions of flask_idem over 50 lines, as issue 42 counts them: from the ``def`` line to the last line
(``end_lineno - lineno + 1``), docstring included, with how much of each is its docstring.

    uv run python bench/long_functions.py            # flask_idem/
    uv run python bench/long_functions.py some/dir   # another tree
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LIMIT = 50


def main(root: Path) -> None:
    total, long = 0, []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            total += 1
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > LIMIT:
                doc = node.body[0]
                is_doc = isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                docstring = (doc.end_lineno or doc.lineno) - doc.lineno + 1 if is_doc else 0
                long.append((lines, docstring, f"{path}:{node.lineno}", node.name))
    print(f"{len(long)} of {total} functions over {LIMIT} lines")
    for lines, docstring, where, name in sorted(long, reverse=True):
        print(f"  {lines:4d} (docstring {docstring:3d})  {where}  {name}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "flask_idem"))
