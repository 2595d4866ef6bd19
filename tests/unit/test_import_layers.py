"""The library's layers are locked: a package imports only its own layer or lower ones, the
roles never import each other, nothing in the library imports the dev launcher (`cluster`) or
the CLI, nothing outside the demo package imports it, and a service never imports another
service. Lazy imports inside functions count."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Lowest first. A package may import its own layer and the layers before it.
LAYERS: list[set[str]] = [
    {"common"},
    {"contracts", "telemetry"},
    {"bus", "state"},
    {"ledger", "weights", "engines", "rl", "envs", "models", "sandbox", "runtime", "scorers", "releases"},
    {"learner", "rollout", "gateway", "reward", "publisher", "tinker", "serving", "evaluation"},
    {"cluster", "cli", "__main__", "services", "demo"},
]
# Imported by nothing else in the library (it joins the CLI through an entry point).
APART_FROM_ALL = {"demo"}
ROLES = LAYERS[4]
# Same-layer imports that are refused: (importer, imported). The broadcast sender drives engines
# through its own EngineControl protocol; engines use the weights' layout and group.
APART: list[tuple[str, str]] = [("weights", "engines")]


def layer_of(package: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def imported_packages(source: str) -> set[str]:
    """The `policyloop.<package>` names a module imports (absolute imports; the library has no
    relative ones)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "policyloop" and len(parts) > 1:
                found.add(parts[1])
    return found


def _library_modules(library: Path) -> list[tuple[str, Path]]:
    out = []
    for path in sorted(library.rglob("*.py")):
        relative = path.relative_to(library)
        if relative.parts[:2] == ("contracts", "v1"):
            continue  # generated
        package = relative.parts[0].removesuffix(".py") if len(relative.parts) > 1 or relative.stem != "__init__" \
            else "__init__"
        out.append((package, path))
    return out


def violations(library: Path, services: Path) -> list[str]:
    found = []
    for package, path in _library_modules(library):
        if package == "__init__":
            continue
        for target in imported_packages(path.read_text()) - {package}:
            where = f"{path.relative_to(library.parent)} imports policyloop.{target}"
            if target not in {p for layer in LAYERS for p in layer}:
                continue  # a name the table does not know is caught by test_every_package_has_a_layer
            if target in APART_FROM_ALL:
                found.append(f"{where}: nothing in the library imports the {target} package")
            elif layer_of(target) > layer_of(package):
                found.append(f"{where}: a higher layer")
            elif package in ROLES and target in ROLES:
                found.append(f"{where}: roles do not import each other")
            elif (package, target) in APART:
                found.append(f"{where}: {package} must not depend on {target}")
    for path in sorted(services.rglob("*.py")):
        own = path.relative_to(services).parts[0]
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                parts = node.module.split(".")
                if parts[:2] == ["policyloop", "services"] and len(parts) > 2 and parts[2] != own:
                    found.append(f"services/{path.relative_to(services)} imports another service: {node.module}")
                if parts[:2] in (["policyloop", "cluster"], ["policyloop", "demo"]):
                    found.append(f"services/{path.relative_to(services)} imports the dev launcher")
    return found


def test_the_library_and_services_keep_their_layers() -> None:
    assert violations(REPO / "libs" / "policyloop", REPO / "services") == []


def test_every_package_has_a_layer() -> None:
    library = REPO / "libs" / "policyloop"
    packages = {p.name.removesuffix(".py") for p in library.iterdir()
                if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"} - {"__init__"}
    assert packages <= {p for layer in LAYERS for p in layer}, "add new packages to LAYERS"


def test_a_planted_violation_is_found(tmp_path: Path) -> None:
    library, services = tmp_path / "policyloop", tmp_path / "services"
    for package in ("bus", "learner", "rollout", "weights", "engines", "cli", "demo"):
        (library / package).mkdir(parents=True)
        (library / package / "__init__.py").write_text("")
    (library / "bus" / "wire.py").write_text("def f():\n    from policyloop.learner.learner import Learner\n")
    (library / "learner" / "step.py").write_text("from policyloop.rollout import replica\n")
    (library / "rollout" / "ok.py").write_text("from policyloop.bus import Bus\n")
    (library / "weights" / "send.py").write_text("from policyloop.engines.sglang_client import SGLangClient\n")
    (library / "engines" / "receive.py").write_text("from policyloop.weights.broadcast import layout\n")  # allowed
    (library / "cli" / "demo.py").write_text("def f():\n    from policyloop.demo.cli import register\n")
    (library / "demo" / "cli.py").write_text("from policyloop.cli.common import app\n")  # allowed
    (services / "learner").mkdir(parents=True)
    (services / "learner" / "service.py").write_text(
        "from policyloop.services.rollout.service import body\nfrom policyloop.cluster.local import free_port\n")
    found = violations(library, services)
    assert len(found) == 6, found
    assert any("cli/demo.py imports policyloop.demo: nothing in the library imports the demo package" in f
               for f in found)
    assert any("weights/send.py imports policyloop.engines: weights must not depend on engines" in f for f in found)
    assert any("bus/wire.py imports policyloop.learner: a higher layer" in f for f in found)
    assert any("roles do not import each other" in f for f in found)
    assert any("imports another service" in f for f in found)
    assert any("imports the dev launcher" in f for f in found)
