"""The house rules a grep can check. The library's comments say why in the present: run and session numbers and
dates belong to docs/benchmarks-history.md and the git log, where they stay true."""

from __future__ import annotations

import ast
import re
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "hf_hybrid"
HISTORY = re.compile(r"\bruns? [0-9]+|\bsessions? [0-9]+|\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b")


def test_no_run_numbers_sessions_or_dates_in_the_library():
    found = [f"{path.relative_to(LIBRARY)}:{number}: {line.strip()}"
             for path in sorted(LIBRARY.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert found == []


def test_only_the_trainer_glue_reads_a_trainers_private_attributes():
    # The loop parts reach the trainer through loop/seam.py's protocol, where a reader sees all they ask of it.
    reach = re.compile(r"trainer\._[a-z]")
    glue = {"trainer.py", "trl_trainers.py", "__init__.py"}
    found = [f"{path.name}:{number}" for path in sorted(LIBRARY.rglob("*.py")) if path.name not in glue
             for number, line in enumerate(path.read_text().splitlines(), 1) if reach.search(line)]
    assert found == []


# Each capability is a package; a floor imports only from floors below it or from its own package.
FLOORS = {"flags": 0, "memory": 0, "loop": 0, "jumps": 1, "guard": 1, "autopilot": 2, "config": 3, "checkpoint": 3,
          "trace": 3, "launch": 3, "data": 3, "trl_logs": 3, "trainer": 4,
          "trl_trainers": 5}


def _runtime_imports() -> dict[str, set[str]]:
    """module -> the package modules it imports when it runs (imports under `if TYPE_CHECKING:` are types only)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(LIBRARY.rglob("*.py")):
        parts = path.relative_to(LIBRARY).with_suffix("").parts
        module = ".".join(p for p in parts if p != "__init__")
        package = parts[:-1]
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level and id(node) not in typing_only:
                base = package[:len(package) - node.level + 1]
                target = ".".join([*base, *(node.module or "").split(".")]).strip(".")
                found |= {target} if node.module else {f"{target}.{alias.name}".strip(".") for alias in node.names}
        graph[module] = found
    return graph


def _floor(module: str) -> int | None:
    return FLOORS.get(module.split(".")[0])


def test_every_module_sits_on_a_floor_and_imports_only_downward():
    graph = _runtime_imports()
    assert [m for m in graph if m and _floor(m) is None] == []
    upward = [f"{m} -> {t}" for m, targets in graph.items() if m for t in targets
              if t.split(".")[0] != m.split(".")[0] and _floor(t) is not None and _floor(t) >= _floor(m)]
    assert upward == []


def test_no_import_circle():
    graph = _runtime_imports()
    seen: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        seen[module] = 1
        for target in sorted(graph.get(module, ())):
            target = target if target in graph else target.rsplit(".", 1)[0]
            if seen.get(target) == 1:
                return [*path, module, target]
            if target in graph and target not in seen and (circle := visit(target, [*path, module])):
                return circle
        seen[module] = 2
        return None

    circles = [c for m in sorted(graph) if m not in seen and (c := visit(m, []))]
    assert circles == []


def test_no_part_reads_another_objects_private_attributes():
    # A part reaches another through its public methods. The exceptions are third-party internals the Trainer's loop
    # leaves no public way to reach, each pinned by tests/test_trainer_contract.py: the fp16 scaler's per-optimizer
    # state, accelerate's gradient-sync flag, the scheduler's last LR and the Trainer's `_prepare_inputs` (launch.py
    # asks whether a trainer overrides it).
    reach = re.compile(r"\b(\w+)\._[a-z]\w*")
    third_party = {"self", "cls", "torch", "dist", "scaler", "gradient_state", "scheduler", "Trainer"}
    glue = {"trainer.py", "trl_trainers.py"}
    found = [f"{path.relative_to(LIBRARY)}:{number}: {line.strip()}"
             for path in sorted(LIBRARY.rglob("*.py")) if path.name not in glue
             for number, line in enumerate(path.read_text().splitlines(), 1)
             for m in reach.finditer(line.split("#")[0]) if m.group(1) not in third_party]
    assert found == []


def test_no_module_over_300_lines_and_no_function_over_60():
    long_modules = [f"{path.relative_to(LIBRARY)}: {n}" for path in sorted(LIBRARY.rglob("*.py"))
                    if (n := len(path.read_text().splitlines())) > 300]
    long_functions = [f"{path.relative_to(LIBRARY)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1}"
                      for path in sorted(LIBRARY.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
                      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                      and node.end_lineno - node.lineno + 1 > 60]
    assert (long_modules, long_functions) == ([], [])
