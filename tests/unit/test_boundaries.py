"""Services meet only on the bus and in shared/: no service imports another service's code.

Each package under services/ is one process (gateway, executor, monitor, controller) or one tool
(bench); what two of them need lives in shared/ (messages, the command sender, sampling options,
configuration) or kernels/. A direct import across that line is how a gateway ends up loading torch,
or a controller pulling in nats to run a pure policy; this test names the offending import instead.
The entry points beside the packages (cli.py, up.py, admin_cli.py, events_cli.py) start processes by
command line, never by import, and are held to the same rule.

The simulator is the one exception, by design: it runs the other services' own pure code (the router, the
monitor's aggregation, the controller's policies, the engine's scheduler and ledger) on simulated executors,
so it imports exactly the modules SIMULATED_PARTS names, and a module added there is a decision to review.
"""

import ast
from pathlib import Path

import pytest

from shared.config import PROJECT_ROOT

SERVICES = PROJECT_ROOT / "services"
PACKAGES = sorted(p.name for p in SERVICES.iterdir() if (p / "__init__.py").exists())
SIMULATED_PARTS = {
    "services.gateway.router", "services.monitor.aggregate", "services.monitor.held", "services.monitor.pace",
    "services.controller.dispatch", "services.controller.loop",
    "services.controller.policies", "services.controller.policies.interface", "services.controller.policies.ladder",
    "services.executor.engine.errors", "services.executor.engine.memory.block_manager",
    "services.executor.engine.memory.ledger", "services.executor.engine.scheduling.growth",
    "services.executor.engine.scheduling.scheduler", "services.executor.engine.scheduling.sequence",
    "services.executor.engine.scheduling.phases",  # a step as a latency profile reads it, counted as the engine does
    "services.executor.latency", "services.executor.admission", "services.executor.engine.morphing.slots",
    # instances of several executors: which replica computes which rows, the AMOEBAs merges the gateway decides,
    # the heads and FFN pieces a TP member holds
    "services.executor.fabric.replicas", "services.gateway.tp_merges", "services.executor.fabric.shards",
    # the body of GET /v1/cluster, which the bench's rest rule reads
    "services.gateway.admin", "services.bench.rest",
    # the bench's experiment, rules and report, so that a simulation is measured and written as a run is
    "services.bench.capacity", "services.bench.client", "services.bench.events", "services.bench.metrics",
    "services.bench.modes", "services.bench.plots", "services.bench.quality", "services.bench.report",
    "services.bench.sweep", "services.bench.trace", "services.bench.windows"}


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
        if mine == "simulator" and module in SIMULATED_PARTS:
            continue
        if target[0] == "services" and len(target) > 1 and target[1] in PACKAGES and target[1] != mine:
            bad.append(f"{path.relative_to(services.parent)}:{line} imports {module}")
    return bad


def test_the_service_packages_are_found():
    assert {"gateway", "executor", "monitor", "controller", "bench", "simulator"} <= set(PACKAGES)


@pytest.mark.parametrize("package", [*PACKAGES, "(entry points)"])
def test_no_service_imports_another(package):
    files = sorted(SERVICES.glob("*.py")) if package == "(entry points)" else sorted((SERVICES / package).rglob("*.py"))
    assert files
    assert [c for f in files for c in crossings(f)] == []


@pytest.mark.parametrize("folder, forbidden", [("shared", ("services", "kernels", "torch")),
                                               ("kernels", ("services", "shared"))])
def test_shared_code_depends_on_no_service(folder, forbidden):
    bad = [f"{f.relative_to(PROJECT_ROOT)}:{line} imports {module}"
           for f in sorted((PROJECT_ROOT / folder).rglob("*.py"))
           for line, module in imported_modules(f) if module.split(".")[0] in forbidden]
    assert bad == []


def test_policies_import_no_bus():
    """The controller's policies run in the simulator too: nothing under policies/ may reach nats."""
    policies = SERVICES / "controller" / "policies"
    reach = {m for f in policies.rglob("*.py") for _, m in imported_modules(f)}
    assert not {m for m in reach if m.split(".")[0] == "nats" or m in ("shared.bus", "shared.commands",
                                                                          "services.controller.loop")}


def test_the_crossing_detector_sees_function_level_imports(tmp_path):
    sneaky = tmp_path / "services" / "gateway" / "sneaky.py"
    sneaky.parent.mkdir(parents=True)
    sneaky.write_text("import services.gateway.app\n\ndef f():\n    from services.executor.engine import engine\n")
    assert crossings(sneaky, tmp_path / "services") == ["services/gateway/sneaky.py:4 imports "
                                                        "services.executor.engine"]
