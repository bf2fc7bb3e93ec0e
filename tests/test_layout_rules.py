"""Layout rules of issue 31 that a reader cannot see at a glance: no function over 80 lines in
export/ or benchmarks/ (set-up apart from loops, one job per function).

    python tests/test_layout_rules.py      # lists every function over the limit, longest first
"""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("export", "benchmarks")
MAX_LINES = 80


def long_functions(folders=FOLDERS, limit: int = MAX_LINES) -> list[tuple[int, str]]:
    """(lines, 'path:line name') of every function or method over `limit` lines (decorators and
    docstring included: def line to last line), longest first."""
    found = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > limit:
                        found.append((n, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def test_long_functions_are_found(tmp_path, monkeypatch):
    """The check itself: a function of 81 lines is reported, one of 80 is not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    def body(n: int, indent: str) -> str:   # n lines with the def line
        return "\n".join([indent + "x = 0"] * (n - 1))
    text = f"def ok():\n{body(80, '    ')}\n\n\nclass C:\n    def long(self):\n{body(81, '        ')}\n"
    (pkg / "m.py").write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert long_functions(("pkg",)) == [(81, "pkg/m.py:84 long")]   # ok: lines 1-80


def test_no_function_over_80_lines_in_export_or_benchmarks():
    found = long_functions()
    assert not found, "functions over 80 lines (split set-up from the loop):\n" + "\n".join(
        f"{n:4d} {where}" for n, where in found)


if __name__ == "__main__":
    for n, where in long_functions():
        print(f"{n:4d} {where}")
