"""The house's structure (docs/DESIGN.md, "Layers"): rooms are pagedllm's packages and top-level modules, arrows are
imports (every import: at module level, inside functions, and for type checking only). An arrow never runs up a
floor, no two rooms import each other, the benchmark lab lives outside the engine package, and `pagedllm --help`
imports none of it."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pagedllm"

# top to bottom; a room imports rooms on its own floor or below (DESIGN.md draws the same floors)
FLOORS: list[set[str]] = [
    {"__main__", "__init__", "cli", "entrypoints", "testing"},
    {"distributed"},
    {"engine"},
    {"worker"},
    {"lora"},
    {"model"},
    {"templating", "quantization", "attention", "dtypes"},
    {"kernels"},
    {"core", "structured", "sampling_params", "pooling_params", "outputs", "metrics", "kv_tier_metrics", "faults", "paths"},
]


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "pagedllm" or len(parts) < 2:
        return None
    return parts[1] if (PACKAGE / parts[1]).is_dir() or (PACKAGE / f"{parts[1]}.py").exists() else None


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported module or module.name, line) for every absolute import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return found


def room_arrows() -> dict[tuple[str, str], list[str]]:
    """(from room, to room) -> where: every import from one room into another."""
    arrows: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _room(_module_of(path)) or "__init__"
        for name, line in _imports(path):
            dst = _room(name)
            if dst is not None and dst != src:
                arrows[(src, dst)].append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    return arrows


def _floor_of() -> dict[str, int]:
    return {room: i for i, floor in enumerate(FLOORS) for room in floor}


def test_every_room_has_a_floor():
    rooms = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    missing = sorted(rooms - _floor_of().keys())
    assert not missing, f"rooms without a floor (add them to FLOORS here and to DESIGN.md's drawing): {missing}"


def test_no_arrow_runs_up():
    floor = _floor_of()
    up = [f"{a} (floor {floor[a]}) -> {b} (floor {floor[b]}) at {', '.join(w)}"
          for (a, b), w in room_arrows().items() if floor[b] < floor[a]]
    assert not up, "imports that run up a floor:\n" + "\n".join(up)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_rooms():
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in room_arrows():
        graph[a].add(b)
    assert not _cycles(graph), f"rooms that import each other: {_cycles(graph)}"


def test_no_import_cycle_between_modules():
    modules = {_module_of(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str | None:  # `from a.b import c` is module a.b.c or a name in a.b
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: {d for n, _ in _imports(p) if (d := resolve(n)) and d != m} for m, p in modules.items()}
    assert not _cycles(graph), f"modules that import each other: {_cycles(graph)}"


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_lab_is_not_in_the_engine_package():
    assert not (PACKAGE / "benchmarks").exists()
    importers = [p.name for p in PACKAGE.rglob("*.py") if any(n.startswith("pagedllm_bench") for n, _ in _imports(p))]
    assert importers == ["cli.py"]  # `pagedllm bench` alone, when asked for


def test_cli_help_imports_no_bench():
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "pagedllm", "--help"], capture_output=True,
                         text=True, check=True, cwd="/")
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert "pagedllm.cli" in imported  # the check reads the right output
    assert not [m for m in imported if m.startswith("pagedllm_bench")], "`pagedllm --help` imported the lab"
