"""Every import in the package points down the layers, and no modules import each other in a circle.

The layers are the folder tree read bottom-up (docs/DESIGN.md, "Layout"). A unit may import its
own modules and those of lower layers only; the two modes, ``packed`` and ``padded``, share a
layer and so never import each other. Imports inside functions count as well.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import megatron_packing

PACKAGE = Path(megatron_packing.__file__).parent

LAYERS: list[set[str]] = [
    {"common"},  # leaves: value checks, shared plan and step types
    {"packing"},  # pure algorithms: numpy only
    {"data"},  # datasets, tokenization, the length index and token store
    {"config"},  # the YAML schema: packing, data, model, train and logging sections
    {"stream"},  # epoch order, resume checks, planned fetches, iterators that own their cursor
    {"packed", "padded"},  # the two modes
    {"loader"},  # the torchdata loader, its state, per-step metrics
    {"reports"},  # simulate / tune / inspect on length pools or a training YAML's own data
    {"megatron"},  # glue to megatron-core (packed-sequence params, loss, DDP, FSDP2), the step loop
    {"megatron_lm", "demo", "bridge"},  # entry points: the Megatron-LM and Bridge hosts, the demo
    {"cli"},  # the ``megatron-packing`` command
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            graph[module].update(n for n in names if n.startswith("megatron_packing."))
    return graph


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(unit: str) -> int:
    for level, units in enumerate(LAYERS):
        if unit in units:
            return level
    raise AssertionError(f"unit {unit!r} is in no layer: add it to LAYERS and to docs/DESIGN.md")


def downward_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, imported in graph.items():
        source = unit_of(module)
        if not source:  # the package's lazy re-exports
            continue
        for target_module in imported:
            target = unit_of(target_module)
            if target != source and layer_of(target) >= layer_of(source):
                bad.append(f"{module} imports {target_module}")
    return sorted(bad)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_unit_is_in_a_layer():
    units = {unit_of(m) for m in import_graph()} - {""}
    for unit in units:
        layer_of(unit)


def test_imports_point_down():
    assert downward_violations(import_graph()) == []


def test_no_import_circle():
    assert find_cycle(import_graph()) is None


def test_the_checks_see_an_upward_import_and_a_circle():
    graph = {"megatron_packing.packed.sampler": {"megatron_packing.loader.dataloader"},
             "megatron_packing.padded.collate": {"megatron_packing.padded.sampler"},
             "megatron_packing.padded.sampler": {"megatron_packing.padded.collate"}}
    assert downward_violations(graph) == ["megatron_packing.packed.sampler imports megatron_packing.loader.dataloader"]
    assert find_cycle(graph) is not None
    assert downward_violations({"megatron_packing.packed.x": {"megatron_packing.padded.y"}})


TOP_LEVEL_FILES = {"__init__.py", "cli.py"}


def flat_top_level_files(package: Path) -> list[str]:
    return sorted(p.name for p in package.glob("*.py") if p.name not in TOP_LEVEL_FILES)


def test_the_top_level_holds_only_the_package_and_the_cli(tmp_path):
    assert flat_top_level_files(PACKAGE) == []
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "loader.py").write_text("")
    assert flat_top_level_files(tmp_path) == ["loader.py"]


STEP_LOOP_HOSTS = ("megatron_packing/megatron_lm/loop.py", "megatron_packing/demo/trainer.py",
                   "megatron_packing/bridge/entry.py")


def loops_and_loop_calls(source: str) -> tuple[list[int], int]:
    """Line numbers of ``while`` loops, and the count of ``run_steps(...)`` calls, in ``source``."""
    tree = ast.parse(source)
    loops = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.While)]
    calls = sum(1 for node in ast.walk(tree) if isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None)) == "run_steps")
    return loops, calls


def test_both_training_programs_run_the_one_step_loop():
    root = Path(megatron_packing.__file__).parent.parent
    for host in STEP_LOOP_HOSTS:
        loops, calls = loops_and_loop_calls((root / host).read_text())
        assert loops == [], f"{host} has its own loop (lines {loops}); steps run in run_steps"
        assert calls == 1, f"{host} calls run_steps {calls} times"


def test_the_host_check_sees_a_second_loop():
    assert loops_and_loop_calls("while step < stop:\n    step += 1\n") == ([1], 0)
    assert loops_and_loop_calls("result = run_steps(host, stream, start=0, stop=3)\n") == ([], 1)
