"""The models the tests run on are built before the first test, outside every test's timeout
(tests/conftest.py, pytest_collection_finish), so that no test's pass depends on how long a build
takes on a busy machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from policyloop.models.bootstrap import bootstrap_dir, is_complete
from tests.conftest import MODULE_MODELS, PREBUILT, suite_models


def test_the_bootstrap_models_of_the_selected_tests_are_built_before_them(request: pytest.FixtureRequest) -> None:
    prebuilt = request.config.stash[PREBUILT]
    assert prebuilt.failed == {}
    assert set(prebuilt.built) >= set(MODULE_MODELS["integration/test_suite_models.py"]) == set(suite_models())
    for name, config in suite_models().items():
        assert prebuilt.built[name] == bootstrap_dir(config) and is_complete(prebuilt.built[name]), name


def test_the_tiny_model_is_built_before_the_tests(request: pytest.FixtureRequest, tiny_model_dir: Path) -> None:
    assert request.config.stash[PREBUILT].tiny_dir == tiny_model_dir
    assert (tiny_model_dir / "config.json").is_file() and (tiny_model_dir / "model.safetensors").is_file()

