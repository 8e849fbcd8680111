"""The house rules, checked from the source: import direction between packages, no import cycles between
modules, no module over 450 lines, no private name imported across modules, no program in a string literal
run with `python -c`, `ruff check .` clean."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("deltaps", "ps", "worker", "compression", "protos")
GENERATED = {"protos/deltaps_pb2.py", "protos/deltaps_pb2_grpc.py"}
MAX_LINES = 400
# `python -m ps` / `python -m worker` stay as aliases of `python -m deltaps` for users' scripts; these two
# entry points are never imported by anything, so they cannot pull the CLI into the server or the client.
ALIASES = {"ps.__main__", "worker.__main__"}
TOOLS = ("deltaps.tools", "deltaps.cli")
FORBIDDEN = {   # importer prefix -> prefixes it must not import
    "ps": ("worker",) + TOOLS,
    "worker": TOOLS,
    "compression": ("deltaps", "ps", "worker"),
    "deltaps": ("ps", "worker"),   # the kernel; its cli and tools are exempt below
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if str(path.relative_to(ROOT)) not in GENERATED:
                out[_module_name(path)] = path
    return out


SOURCES = _sources()


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _imports(mod: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, imported names, line) for every import, lazy ones in functions included."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}:{node.lineno}: relative import (the house uses absolute imports)"
            out.append((node.module or "", [a.name for a in node.names], node.lineno))
    return out


def _graph() -> dict[str, set[str]]:
    """Module -> modules of ours it imports (`from pkg import sub` counts as importing pkg.sub)."""
    graph = {}
    for mod, path in SOURCES.items():
        deps = set()
        for target, names, _ in _imports(mod, path):
            if target.split(".")[0] not in PACKAGES:
                continue
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in SOURCES]
            deps.update(subs or [target])
            if len(subs) < len(names):       # names that are attributes of `target` itself
                deps.add(target)
        graph[mod] = {d for d in deps if d in SOURCES and d != mod}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10_000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_import_direction():
    bad = []
    for mod, path in SOURCES.items():
        if mod in ALIASES:
            continue
        for importer, banned in FORBIDDEN.items():
            if not _within(mod, importer) or any(_within(mod, t) for t in TOOLS):
                continue
            for target, names, line in _imports(mod, path):
                full = [target] + [f"{target}.{n}" for n in names]
                if any(_within(t, b) for t in full for b in banned):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def test_module_sizes():
    paths = [p for p in ROOT.rglob("*.py") if ".venv" not in p.parts and str(p.relative_to(ROOT)) not in GENERATED
             and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    big = {str(p.relative_to(ROOT)): n for p in paths if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_private_names_stay_in_their_module():
    bad = []
    for mod, path in SOURCES.items():
        tree = ast.parse(path.read_text())
        module_aliases = {}
        for target, names, line in _imports(mod, path):
            if target.split(".")[0] not in PACKAGES:
                continue
            for n in names:
                if n.startswith("_") and not n.startswith("__"):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}.{n}")
        for node in ast.walk(tree):   # `import pkg.mod as m` / `from pkg import mod` -> m._private
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                for a in node.names:
                    if f"{node.module}.{a.name}" in SOURCES:
                        module_aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in SOURCES:
                        module_aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in module_aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {module_aliases[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)


# argv heads that run their next argument as a program: [sys.executable, "-c", "<source>"], ["bash", "-c", ...]
SHELLS = {"sh", "bash"}


def _runs_a_program_arg(node: ast.expr) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == "executable":        # sys.executable
        return True
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        name = node.value.rsplit("/", 1)[-1]
        return name.startswith("python") or name in SHELLS
    return False


def _programs_in_strings(tree: ast.AST) -> list[int]:
    """Lines of argv lists/tuples that hand an interpreter `-c` and a program in a string."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, (ast.List, ast.Tuple))
            and any(isinstance(arg, ast.Constant) and arg.value == "-c" and _runs_a_program_arg(head)
                    for head, arg in zip(node.elts, node.elts[1:]))]


def test_no_programs_in_string_literals():
    """A program run in a child process is a module with main(argv), started as `python -m pkg.mod ARGS`
    (deltaps/tools/socket_probes.py, deltaps/tools/torch_probes.py), or a test's script file (tests/*.py),
    never `python -c "<source>"`: so it is imported, linted and tested like the rest of the code."""
    tests = [p for p in (ROOT / "tests").rglob("*.py") if p.name != Path(__file__).name]   # its examples are bad
    bad = [f"{path.relative_to(ROOT)}:{line}" for path in [*SOURCES.values(), *tests]
           for line in _programs_in_strings(ast.parse(path.read_text()))]
    assert not bad, "programs in string literals run with -c:\n" + "\n".join(bad)


def test_the_checker_sees_a_cycle_and_a_wrong_direction():
    """The checks above can fail: a made-up graph with a cycle is caught."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _within("deltaps.tools.launch", "deltaps.tools") and not _within("deltaps.toolsx", "deltaps.tools")
    inline = ast.parse('subprocess.run([sys.executable, "-c", PROGRAM, "127.0.0.1"])\n'
                       'subprocess.run(prefix + ("/usr/bin/python3", "-c", "print(1)"))\n'
                       'subprocess.run([sys.executable, "-m", "deltaps.tools.socket_probes", "sink"])\n'
                       'subprocess.run(["tar", "-c", "-f", "out.tar"])\n')
    assert _programs_in_strings(inline) == [1, 2]


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed (dev extra)")
    out = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
