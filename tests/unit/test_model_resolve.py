"""Naming a model (policyloop.models.resolve): a directory, or a Hugging Face model id found in
the Hugging Face cache — offline, against a cache each test fills itself (tests/hf_cache.py).
Settings take either form and say what is wrong with a name; `resolve_model` turns a name into
a directory where a process loads the model, and says which setting named nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from policyloop.cluster.catalogue import SERVICES
from policyloop.models.resolve import ModelNotFound, ModelRef, hub_model, model_label, resolve_model
from policyloop.rollout.settings import RolloutSettings
from tests.helpers import settings_model
from tests.hf_cache import cache_model, offline_cache

REPO_ID = "policyloop-test/tiny"


def _model_files(directory: Path, marker: str) -> Path:
    """Enough of a model directory for resolving (nothing loads it here)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", "marker": marker}))
    (directory / "tokenizer.json").write_text("{}")
    return directory


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache under HF_HOME=tmp_path/hf, offline."""
    return offline_cache(monkeypatch, tmp_path / "hf")


def test_a_hub_id_resolves_to_its_snapshot_in_the_cache(hub: Path, tmp_path: Path) -> None:
    snapshot = cache_model(hub, REPO_ID, _model_files(tmp_path / "src", "main"))
    found = resolve_model(REPO_ID)
    assert found == snapshot and found.is_dir()
    assert json.loads((found / "config.json").read_text())["marker"] == "main"  # through the blob links


def test_a_revision_picks_its_own_snapshot(hub: Path, tmp_path: Path) -> None:
    main = cache_model(hub, REPO_ID, _model_files(tmp_path / "a", "main"))
    v2 = cache_model(hub, REPO_ID, _model_files(tmp_path / "b", "v2"), revision="v2")
    assert main != v2
    assert resolve_model(f"{REPO_ID}@v2") == v2
    assert resolve_model(f"{REPO_ID}@main") == resolve_model(REPO_ID) == main
    assert resolve_model(f"{REPO_ID}@{main.name}") == main  # a commit hash: its snapshot, no ref needed
    with pytest.raises(ModelNotFound, match=rf"^model_path: .*{REPO_ID}@v3 is not in the cache"):
        resolve_model(f"{REPO_ID}@v3")


def test_offline_a_snapshot_is_checked_against_its_listing_less_the_files_left_out(hub: Path, tmp_path: Path) -> None:
    """huggingface_hub keeps each commit's file listing beside the snapshots (trees/<commit>.json,
    written by a download): offline, a snapshot missing a listed file is incomplete — except files
    of the formats fetches leave out (IGNORED_FILES), which are never there."""
    pytest.importorskip("huggingface_hub._tree_cache", reason="this huggingface_hub keeps no listings")
    snapshot = cache_model(hub, REPO_ID, _model_files(tmp_path / "src", "main"))
    listing = snapshot.parent.parent / "trees" / f"{snapshot.name}.json"
    listing.parent.mkdir()
    files = {"config.json": {"size": 1, "blob_id": "a" * 40}, "tokenizer.json": {"size": 1, "blob_id": "b" * 40},
             "original/consolidated.00.pth": {"size": 1, "blob_id": "c" * 40}}
    listing.write_text(json.dumps({"format_version": 1, "files": files}))
    assert resolve_model(REPO_ID) == snapshot
    files["model.safetensors"] = {"size": 1, "blob_id": "d" * 40}
    listing.with_name(f"{'e' * 40}.json").write_text(json.dumps({"format_version": 1, "files": files}))
    (hub / f"models--{REPO_ID.replace('/', '--')}" / "refs" / "broken").write_text("e" * 40)
    (snapshot.parent / ("e" * 40)).symlink_to(snapshot.name)  # the same files: model.safetensors missing
    with pytest.raises(ModelNotFound, match=r"^model_path: the cached snapshot of .*@broken is incomplete.*"
                                            r"model\.safetensors"):
        resolve_model(f"{REPO_ID}@broken")


def test_a_missing_id_offline_names_the_setting_the_cache_and_the_way_out(hub: Path) -> None:
    with pytest.raises(ModelNotFound) as missing:
        resolve_model("nobody/nothing", setting="learner model_path")
    message = str(missing.value)
    assert message.startswith("learner model_path: no directory nobody/nothing here")
    assert str(hub) in message and "HF_HUB_OFFLINE" in message and "policyloop models fetch nobody/nothing" in message


@pytest.mark.parametrize("name", ["/no/such/model", "./no-such-model", "no-such-model", "~/no-such-model"])
def test_a_missing_directory_says_so_and_never_asks_the_hub(hub: Path, name: str) -> None:
    assert hub_model(name) is None  # never taken for an id
    with pytest.raises(ModelNotFound, match=rf"^model_path: the model directory {name} does not exist"):
        resolve_model(name)
    assert not hub.exists()


def test_a_directory_wins_over_an_id_of_the_same_form(hub: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cache_model(hub, REPO_ID, _model_files(tmp_path / "src", "hub"))
    monkeypatch.chdir(tmp_path)
    local = _model_files(tmp_path / REPO_ID, "local")
    assert resolve_model(REPO_ID) == Path(REPO_ID) and resolve_model(Path(REPO_ID)).resolve() == local
    assert resolve_model(str(local)) == local
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelNotFound, match="the model directory .*file is not a directory"):
        resolve_model(str(tmp_path / "file"))


def test_a_fresh_process_finds_the_cache_through_hf_home(hub: Path, tmp_path: Path) -> None:
    """HF_HOME and HF_HUB_OFFLINE as a service's process reads them: from its environment."""
    snapshot = cache_model(hub, REPO_ID, _model_files(tmp_path / "src", "main"))
    code = f"from policyloop.models.resolve import resolve_model; print(resolve_model({REPO_ID!r}))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    found = subprocess.run([sys.executable, "-c", code], env={**env, "HF_HOME": str(hub.parent), "HF_HUB_OFFLINE": "1"},
                           capture_output=True, text=True, timeout=60)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(snapshot)
    missing = subprocess.run([sys.executable, "-c", code.replace(REPO_ID, "nobody/nothing")],
                             env={**env, "HF_HOME": str(tmp_path / "elsewhere"), "HF_HUB_OFFLINE": "1"},
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and str(tmp_path / "elsewhere" / "hub") in missing.stderr


def test_labels_name_the_hub_model_a_name_stands_for(hub: Path, tmp_path: Path) -> None:
    from policyloop.tinker.settings import TinkerSettings

    snapshot = cache_model(hub, REPO_ID, _model_files(tmp_path / "src", "main"))
    assert model_label(REPO_ID) == model_label(f"{REPO_ID}@v2") == REPO_ID
    assert model_label(snapshot) == REPO_ID  # a snapshot, also through a link such as /models/base
    (tmp_path / "base").symlink_to(snapshot)
    assert model_label(tmp_path / "base") == REPO_ID
    assert model_label(_model_files(tmp_path / "mine", "x")) == "mine"
    assert TinkerSettings(model_path=str(tmp_path / "base")).model_name() == REPO_ID
    assert TinkerSettings(model_path=str(tmp_path / "mine"), base_model="arith").model_name() == "arith"


async def test_a_service_that_names_nothing_cannot_start(hub: Path) -> None:
    from policyloop.runtime import ServiceCannotStart, model_directory

    with pytest.raises(ServiceCannotStart, match="^model_path: no directory nobody/nothing here"):
        await model_directory("nobody/nothing")


# --- settings: either form, one type, clear refusals -------------------------------------------------------

def _model_fields() -> list[tuple[str, str, Any]]:
    """(settings model, field, its FieldInfo) for every field of a service's settings that names a model."""
    found = {}
    for entry in SERVICES:
        model = settings_model(entry)
        for name, info in model.model_fields.items():
            if name == "model_path" or name.endswith("_model_path"):
                found[(model.__name__, name)] = (model, info)
    return [(model, name, info) for (_, name), (model, info) in sorted(found.items())]


def test_every_setting_that_names_a_model_takes_a_model_ref() -> None:
    from typing import get_args

    fields = _model_fields()
    assert {model.__name__ for model, _, _ in fields} >= {"GatewaySettings", "RolloutSettings", "LearnerSettings",
                                                         "EvaluatorSettings", "TinkerSettings"}
    ref_validators = get_args(ModelRef)[1:]
    for model, name, info in fields:
        assert info.metadata == list(ref_validators) or ModelRef in get_args(info.annotation), (model, name)
        assert "Hugging Face model id" in (info.description or ""), (model, name)


@pytest.mark.parametrize("value", ["/models/base", "models/base", "org/name", "org/name@v1.0", "org/name@refs/pr/1",
                                   "org/name@" + "a" * 40, Path("/models/base")])
def test_settings_take_a_directory_or_an_id(value: object) -> None:
    assert RolloutSettings(model_path=value).model_path == str(value)


@pytest.mark.parametrize(("value", "message"), [
    ("", "model_path\n  empty: name a model directory or a Hugging Face model id (org/name[@revision])"),
    ("  ", "model_path\n  empty: name a model directory or a Hugging Face model id"),
    ("org/name@", "model_path\n  'org/name@': a Hugging Face model id with an empty revision"),
    (5, "model_path\n  expected a model directory or a Hugging Face model id (org/name[@revision]), got int"),
])
def test_settings_say_what_is_wrong_with_a_name(value: object, message: str) -> None:
    for model, name, _ in _model_fields():
        with pytest.raises(ValidationError) as refused:
            model(**{name: value})
        assert message.replace("model_path", name) in str(refused.value), (model, str(refused.value))


def test_settings_read_an_id_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from policyloop.gateway.settings import GatewaySettings
    from policyloop.runtime.settings import load_settings

    monkeypatch.setenv("POLICYLOOP_MODEL_PATH", "Qwen/Qwen2.5-0.5B-Instruct@main")
    assert load_settings(RolloutSettings).model_path == "Qwen/Qwen2.5-0.5B-Instruct@main"
    assert load_settings(RolloutSettings, ["--model-path", "org/name"]).model_path == "org/name"
    monkeypatch.delenv("POLICYLOOP_MODEL_PATH")
    assert GatewaySettings().model_path is None  # unset: prompts are not checked against a model


# --- the CLI: `policyloop models fetch`, the models job of a cluster -----------------------------------------

def _cli(*args: str) -> Any:
    from typer.testing import CliRunner

    from policyloop.cli import app

    return CliRunner().invoke(app, list(args))


def test_models_fetch_finds_the_model_and_links_it(hub: Path, tmp_path: Path) -> None:
    """Offline it only checks the cache (the download itself is huggingface_hub's)."""
    snapshot = cache_model(hub, REPO_ID, _model_files(tmp_path / "src", "main"))
    link = tmp_path / "models" / "base"
    result = _cli("models", "fetch", REPO_ID, "--link", str(link))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["path"] == str(snapshot)
    assert link.is_symlink() and not os.path.isabs(os.readlink(link)) and link.resolve() == snapshot.resolve()
    assert json.loads((link / "config.json").read_text())["marker"] == "main"
    v2 = cache_model(hub, REPO_ID, _model_files(tmp_path / "b", "v2"), revision="v2")
    assert _cli("models", "fetch", f"{REPO_ID}@v2", "--link", str(link)).exit_code == 0
    assert link.resolve() == v2.resolve()  # relinked in place


@pytest.mark.parametrize(("args", "says"), [
    (("nobody/nothing",), "is not in the cache"),
    (("./some/dir",), "is not a Hugging Face model id"),
])
def test_models_fetch_refuses_what_it_cannot_fetch(hub: Path, args: tuple[str, ...], says: str) -> None:
    result = _cli("models", "fetch", *args)
    assert result.exit_code == 2 and says in " ".join(result.output.split()), result.output
