"""MODULE_MODELS (tests/conftest.py) lists every test module that runs on a bootstrap model, so
that the model is built before the tests rather than inside one, under its timeout."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import MODULE_MODELS, suite_models

TESTS = Path(__file__).resolve().parents[1]
# Modules that call bootstrap() or start `policyloop demo`, yet need no model built beforehand.
BUILD_NOTHING_SHARED = {
    "integration/test_bootstrap.py": "builds its own tiny configs into tmp_path: the build is what it tests",
    "unit/test_cli_flags.py": "its demos are refused before they bootstrap anything",
    "integration/test_grpc.py": "\"demo\" is an environment version there, not the command",
    "unit/test_import_layers.py": "\"demo\" is the package the layers keep apart there, not the command",
}


def test_every_module_that_runs_on_a_bootstrap_model_is_listed() -> None:
    """A module that builds a bootstrap model (bootstrap(), or a demo given no model) and is not in
    MODULE_MODELS would build it inside a test, under that test's timeout."""
    unlisted, unknown = [], []
    for path in sorted(set(TESTS.rglob("test_*.py")) - {Path(__file__).resolve()}):  # this one names them
        module = path.relative_to(TESTS).as_posix()
        text = path.read_text()
        builds = re.search(r"\bbootstrap\s*[(),]|TOOLS_BOOTSTRAP|CHAT_BOOTSTRAP|\"demo\"", text)  # a call, or passed on
        if builds and module not in MODULE_MODELS and module not in BUILD_NOTHING_SHARED:
            unlisted.append(f"{module}: {builds.group(0)}")
        for name in re.findall(r"prebuilt_model\([^,]+,\s*\"(\w+)\"\)", text):
            if name not in MODULE_MODELS.get(module, ()):
                unknown.append(f"{module}: prebuilt_model(..., {name!r})")
    assert unlisted == [] and unknown == []
    assert all(name in suite_models() for names in MODULE_MODELS.values() for name in names)
    assert all((TESTS / module).is_file() for module in MODULE_MODELS)
