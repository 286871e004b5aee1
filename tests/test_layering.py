"""The tree's layering: no import cycles in Python or C, and the dependency rules of the design.

- pyruntime/model/ (the shared description) imports no executor, strategy or front end;
- the executors pyruntime/cpu/ and pyruntime/gpu/ import nothing from each other;
- kernels/ (installed as pyruntime.kernels) imports nothing from pyruntime;
- no options are read from the environment outside pyruntime/options.py (and Triton's own
  TRITON_INTERPRET), and the C core reads none.
Imports inside functions count: a lazy import that closes a cycle is still a cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def python_modules() -> dict[str, Path]:
    """Module name -> file, for pyruntime/ and kernels/ (as pyruntime.kernels.*)."""
    out = {}
    for path in (REPO / "pyruntime").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    for path in (REPO / "kernels").glob("*.py"):
        out[f"pyruntime.kernels.{path.stem}"] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports (module level and inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in modules:  # `from pkg import module` or a name in a module
                t = t.rpartition(".")[0]
            # an ancestor package is imported before any of its modules anyway
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    modules = python_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (cycle := visit(n)):
            return cycle
    return None


def test_no_python_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def violations(edges, source_prefix, forbidden_prefixes) -> list[str]:
    return [
        f"{n} imports {m}"
        for n, deps in edges.items()
        if n.startswith(source_prefix)
        for m in deps
        if any(m == f or m.startswith(f + ".") for f in forbidden_prefixes)
    ]


def test_dependency_rules():
    g = graph()
    fronts = ["pyruntime.api", "pyruntime.cli", "pyruntime.tools", "pyruntime.placement"]
    execs = ["pyruntime.cpu", "pyruntime.gpu", "pyruntime.offload", "pyruntime.decoding"]
    bad = violations(g, "pyruntime.model", execs + fronts)
    bad += violations(g, "pyruntime.cpu", ["pyruntime.gpu", "pyruntime.kernels"])
    bad += violations(g, "pyruntime.gpu", ["pyruntime.cpu"])
    kernels = {n: d for n, d in g.items() if n.startswith("pyruntime.kernels.")}
    bad += [f"{n} imports {m}" for n, d in kernels.items() for m in d
            if not m.startswith("pyruntime.kernels")]  # fmt: skip
    assert not bad, "\n".join(sorted(bad))


def test_environment_is_read_only_by_the_option_registry():
    allowed = {REPO / "pyruntime" / "options.py", REPO / "kernels" / "launch.py"}
    readers = re.compile(r"os\.environ|os\.getenv|getenv\(")
    offenders = [
        str(p.relative_to(REPO))
        for p in [*python_modules().values()]
        if p not in allowed and readers.search(p.read_text())
    ]
    offenders += [
        str(p.relative_to(REPO))
        for p in (REPO / "runtime").rglob("*.[ch]")
        if "getenv" in p.read_text()
    ]
    assert not offenders, offenders


def c_include_graph() -> dict[str, set[str]]:
    """C module (file stem: x.c and x.h together) -> modules whose header it includes."""
    edges: dict[str, set[str]] = {}
    files = [
        *(REPO / "runtime" / "src").glob("*.[ch]"),
        *(REPO / "runtime" / "include").glob("*.h"),
    ]
    stems = {p.stem for p in files}
    for p in files:
        deps = edges.setdefault(p.stem, set())
        for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', p.read_text(), re.M):
            stem = Path(inc).stem
            if stem in stems and stem != p.stem:
                deps.add(stem)
    return edges


def test_no_c_include_cycles():
    cycle = find_cycle(c_include_graph())
    assert cycle is None, " -> ".join(cycle)
