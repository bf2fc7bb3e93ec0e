"""Layout rules of issue 31 that a reader cannot see at a glance: no function over 80 lines in
export/ or benchmarks/ (set-up apart from loops, one job per function); no import cycle among the
serving modules (lazy imports inside functions count: the old kernel modules imported each other's
timing helpers that way); a module that defines a Triton kernel holds no timing code and no
`__main__` (benches live in benchmarks/ops/, checks in export/checks.py).

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


def imports_of(path: Path, package: str) -> set[str]:
    """The `package.*` modules `path` imports anywhere in it (module level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == package}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == package:
            # `from export import prefix_cache` names a module; `from export.ops.x import f` names x
            found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
    return found


def module_graph(package: str = "export") -> dict[str, set[str]]:
    """{module: the package's modules it imports} over the package's .py files (packages as
    `pkg.__init__` reduced to `pkg`)."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in sorted((ROOT / package).rglob("*.py"))}
    return {m: {d for d in imports_of(p, package) if d in files and d != m} for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path for each import cycle found by depth-first search (empty: the graph is acyclic);
    a package's own `__init__` importing its submodules is not a cycle of theirs."""
    found, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if m.startswith(d + ".") or d.startswith(m + "."):
                continue   # a package and its own submodule
            if state.get(d) == "open":
                found.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set(), "p": {"p.x"}, "p.x": {"p"}}) == []


def test_no_import_cycle_in_export():
    graph = module_graph("export")
    assert "export.ops.gla_prefill" in graph and "export.ops.triton_switch" in graph["export.ops.gla_prefill"]
    assert not cycles(graph), cycles(graph)


TIMING = ("do_bench", "perf_counter", "time_ms", "Event(")


def test_kernel_modules_hold_no_timing_and_no_main():
    kernels = [p for p in sorted((ROOT / "export").rglob("*.py")) if "@triton.jit" in p.read_text()]
    assert len(kernels) >= 5, kernels   # conv, gla_decode, gla_prefill, gla_prefill_chunked, gated_mix
    for p in kernels:
        text = p.read_text()
        assert '__name__ == "__main__"' not in text, p
        assert not [t for t in TIMING if t in text], (p, [t for t in TIMING if t in text])


if __name__ == "__main__":
    for n, where in long_functions():
        print(f"{n:4d} {where}")
