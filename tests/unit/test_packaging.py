"""The distribution holds every package, and the services that need no torch never import it."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {"policyloop." + ".".join(p.parent.relative_to(REPO / "libs" / "policyloop").parts)
             for p in (REPO / "libs" / "policyloop").rglob("__init__.py")}
    found = {f.rstrip(".") for f in found}
    found |= {"policyloop.services" + ("." + ".".join(p.parent.relative_to(REPO / "services").parts)
                                       if p.parent != REPO / "services" else "")
              for p in (REPO / "services").rglob("__init__.py")}
    assert found == listed


def test_base_dependencies_exclude_torch() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith(("torch", "transformers")) for dep in project["dependencies"])
    for extra in ("learner", "rollout"):
        torch_spec = next(d for d in project["optional-dependencies"][extra] if d.startswith("torch"))
        # Admits the CPU wheel 2.13.0 and SGLang's torch, and nothing newer.
        assert SpecifierSet(torch_spec.removeprefix("torch")).contains("2.13.0")
        assert "<2.15" in torch_spec


def _sglang_pin() -> str:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    [pin] = [d for d in project["optional-dependencies"]["sglang"] if d.startswith("sglang")]
    return pin


def test_the_sglang_extra_pins_the_release_the_protocol_is_tested_against() -> None:
    [reference] = (REPO / "tests" / "data").glob("sglang-*-api.json")
    version = reference.name.removeprefix("sglang-").removesuffix("-api.json")
    assert f"sglang {version} wheel" in json.loads(reference.read_text())["source"]
    assert _sglang_pin() == f"sglang=={version}"


@pytest.mark.slow
def test_the_sglang_extra_resolves(tmp_path: Path) -> None:
    """SGLang needs a GPU and is never installed here: pip resolves the extra without installing,
    and what it would install keeps torch within the project's range."""
    report = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                             "--report", str(report), f"{REPO}[sglang]"],
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    install = json.loads(report.read_text())["install"]
    chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in install}
    assert f"sglang=={chosen['sglang']}" == _sglang_pin()
    assert SpecifierSet(">=2.6,<2.15").contains(chosen["torch"].split("+")[0])


def test_gateway_reward_sandbox_publisher_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "for name in ('gateway', 'reward', 'sandbox', 'publisher'):\n"
        "    __import__(f'policyloop.services.{name}.service')\n"
        "import policyloop.cli, policyloop.cluster.local, policyloop.cluster.status\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


def test_every_imported_distribution_is_declared() -> None:
    """A module the project imports must come from a distribution pyproject.toml asks for
    (a fresh clone installs only those)."""
    import ast
    import importlib.metadata
    import re

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [d for deps in project["optional-dependencies"].values() for d in deps]
    declared = {re.split(r"[<>=!~\[ ;]", s, maxsplit=1)[0].lower().replace("_", "-") for s in specs}
    declared |= {"policyloop"}
    owners = importlib.metadata.packages_distributions()
    missing = {}
    for path in list((REPO / "libs").rglob("*.py")) + list((REPO / "services").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "policyloop":
                    continue
                dists = {d.lower().replace("_", "-") for d in owners.get(top, [top])}
                if not dists & declared:
                    missing[top] = str(path.relative_to(REPO))
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
