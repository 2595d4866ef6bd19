"""The distribution holds every package, and the services that need no torch never import it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

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
        assert "<2.14" in torch_spec  # admits the CPU wheel 2.13.0


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
