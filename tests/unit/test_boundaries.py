"""Services meet only on the bus and in shared/: no service imports another service's code, nothing imports a tool,
and no module imports itself around a circle.

Each package under services/ is one process (gateway, executor, monitor, controller) or the tools (benchmarks,
profilers, the planner's CLI, the simulator); what two processes need lives in shared/ (messages, the command
sender, sampling options, configuration) or morphling_kernels/. A direct import across that line is how a gateway
ends up loading torch, or a controller pulling in nats to run a pure policy; this test names the offending import.
The pure rules live in shared/core, below every process and importing none of them, torch or nats; the protocol
(shared's subjects, messages, bus, configuration) sits below the rules. Tools may import any of it (the simulator
runs the services' own rules on simulated executors), but nothing serving imports a tool, so a benchmark never loads
into a serving process. The entry points beside the packages
(cli.py, up.py, admin_cli.py, events_cli.py) start processes and tools by command line, never by import.
"""

import ast
from pathlib import Path

import pytest

from shared.config import PROJECT_ROOT

SERVICES = PROJECT_ROOT / "services"
PACKAGES = sorted(p.name for p in SERVICES.iterdir() if (p / "__init__.py").exists())
TOOLS = "tools"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, function-level imports included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def crossings(path: Path, services: Path = SERVICES) -> list[str]:
    parts = path.relative_to(services).parts
    mine = parts[0] if len(parts) > 1 else None  # None: an entry point beside the packages
    bad = []
    for line, module in imported_modules(path):
        target = module.split(".")
        if mine == TOOLS:
            continue
        if target[0] == "services" and len(target) > 1 and target[1] in PACKAGES and target[1] != mine:
            bad.append(f"{path.relative_to(services.parent)}:{line} imports {module}")
    return bad


def test_the_service_packages_are_found():
    assert {"gateway", "executor", "monitor", "controller", TOOLS} <= set(PACKAGES)


@pytest.mark.parametrize("package", [*PACKAGES, "(entry points)"])
def test_no_service_imports_another(package):
    files = sorted(SERVICES.glob("*.py")) if package == "(entry points)" else sorted((SERVICES / package).rglob("*.py"))
    assert files
    assert [c for f in files for c in crossings(f)] == []


@pytest.mark.parametrize("folder, forbidden", [("shared", ("services", "morphling_kernels", "torch")),
                                               ("morphling_kernels", ("services", "shared"))])
def test_shared_code_depends_on_no_service(folder, forbidden):
    bad = [f"{f.relative_to(PROJECT_ROOT)}:{line} imports {module}"
           for f in sorted((PROJECT_ROOT / folder).rglob("*.py"))
           for line, module in imported_modules(f) if module.split(".")[0] in forbidden]
    assert bad == []


CORE = PROJECT_ROOT / "shared" / "core"


def test_the_rules_import_neither_torch_nor_nats_nor_a_process():
    """shared/core holds the pure rules the services and the simulator both run (the scheduler and ledger, admission,
    the router's choice, the monitor's aggregation, the controller's policies, plans, the planner): they may import
    the protocol and one another, and nothing that needs a device, the bus or a process."""
    forbidden = ("torch", "nats", "services", "morphling_kernels", "shared.bus", "shared.commands")
    bad = [f"{f.relative_to(PROJECT_ROOT)}:{line} imports {module}"
           for f in sorted(CORE.rglob("*.py")) for line, module in imported_modules(f)
           if any(module == x or module.startswith(x + ".") for x in forbidden)]
    assert bad == []


def test_the_protocol_imports_no_rule():
    """The protocol (subjects, messages, the bus, configuration) is what the rules are written against, not above them."""
    protocol = [f for f in sorted((PROJECT_ROOT / "shared").rglob("*.py")) if CORE not in f.parents]
    assert protocol
    bad = [f"{f.relative_to(PROJECT_ROOT)}:{line} imports {module}"
           for f in protocol for line, module in imported_modules(f) if module.startswith("shared.core")]
    assert bad == []


def test_the_crossing_detector_sees_function_level_imports(tmp_path):
    sneaky = tmp_path / "services" / "gateway" / "sneaky.py"
    sneaky.parent.mkdir(parents=True)
    sneaky.write_text("import services.gateway.app\n\ndef f():\n    from services.executor.engine import engine\n")
    assert crossings(sneaky, tmp_path / "services") == ["services/gateway/sneaky.py:4 imports "
                                                        "services.executor.engine"]


LAYERS = ("protocol", "rules", "engine", "fabric", "services", "tools")


def layer(module: str) -> str | None:
    """Which of LAYERS a project module sits in; each may import only its own layer and those before it."""
    parts = module.split(".")
    if parts[0] == "shared":
        return "rules" if parts[1:2] == ["core"] else "protocol"
    if parts[0] == "morphling_kernels" or parts[:3] == ["services", "executor", "engine"]:
        return "engine"
    if parts[:3] == ["services", "executor", "fabric"]:
        return "fabric"
    if parts[0] == "services":
        return "tools" if parts[1:2] == ["tools"] else "services"
    return None


def test_every_layer_imports_only_the_layers_below_it():
    """protocol <- rules <- engine <- fabric <- services <- tools: the engine knows no fabric (an instance's runner is
    handed to it), the fabric no service, and the rules nothing above the protocol."""
    files = [f for folder in ("shared", "morphling_kernels", "services")
             for f in sorted((PROJECT_ROOT / folder).rglob("*.py"))]
    bad = []
    for f in files:
        mine = layer(module_name(f, PROJECT_ROOT))
        for line, module in imported_modules(f):
            theirs = layer(module)
            if mine and theirs and LAYERS.index(theirs) > LAYERS.index(mine):
                bad.append(f"{f.relative_to(PROJECT_ROOT)}:{line} ({mine}) imports {module} ({theirs})")
    assert bad == []


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path, known: set[str]) -> set[str]:
    """The project modules the file imports when it runs: `from package import module` names the module, and
    what sits under `if TYPE_CHECKING:` (annotations only) is left out."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found & known


def import_circles(root: Path,
                   folders: tuple[str, ...] = ("services", "shared", "morphling_kernels")) -> list[list[str]]:
    """Every set of modules that import one another around a circle (Tarjan's strongly connected components)."""
    files = {module_name(f, root): f for folder in folders for f in sorted((root / folder).rglob("*.py"))}
    graph = {m: runtime_imports(f, set(files)) - {m} for m, f in files.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_module_imports_itself_around_a_circle():
    assert import_circles(PROJECT_ROOT) == []


def test_the_circle_finder_sees_a_function_level_circle_and_not_an_annotation(tmp_path):
    package = tmp_path / "services" / "x"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from services.x import b\n")
    (package / "b.py").write_text("def f():\n    from services.x.c import g\n")
    (package / "c.py").write_text("import services.x.a\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from services.x import e\n")
    (package / "e.py").write_text("from services.x import d\n")
    assert import_circles(tmp_path, ("services",)) == [["services.x.a", "services.x.b", "services.x.c"]]


MAX_CLASS_LINES = 300  # a class a reader can hold in mind; a larger one is several jobs in one


def long_classes(root: Path, folders=("services", "shared", "morphling_kernels")) -> list[str]:
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and (lines := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_class_is_longer_than_a_reader_holds_in_mind(tmp_path):
    assert long_classes(PROJECT_ROOT) == []
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "big.py").write_text("class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES)
    assert long_classes(tmp_path) == [f"services/big.py:1 Big ({MAX_CLASS_LINES + 1} lines)"]
