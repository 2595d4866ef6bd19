"""Naming a model: a Hugging Face model directory, or a Hugging Face model id found through the
Hugging Face cache.

Every setting and flag that names a model (`model_path` of each service, `--model-path`) takes a
`ModelRef`: a string that is either a directory or a model id `org/name`, optionally pinned to a
revision (`org/name@v1.0`, `org/name@<commit>`). Settings only check its form; the name is
resolved where a process loads the model, with `resolve_model`:

- an existing directory is used as it is (a directory always wins over an id of the same form);
- otherwise a name of the id's form is looked up with `huggingface_hub.snapshot_download`, which
  keeps its files in the Hugging Face cache (`HF_HOME`, or `HF_HUB_CACHE` for the hub cache
  itself) and answers from that cache alone under `HF_HUB_OFFLINE=1` — clusters download a model
  once (`policyloop models fetch`) and start their services offline on the shared cache;
- anything else is an error that names the setting: a path that is no directory says so.

The files fetched are the repository's less the formats nothing here loads (`IGNORED_FILES`); the
same filter applies offline, where huggingface_hub checks a snapshot against it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Annotated, Any

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

# What a Hugging Face model id looks like (huggingface_hub.utils.validate_repo_id's rules: ASCII
# letters, digits, '-', '_' and '.', not at either end, at most 96 each side, no '--' or '..'),
# with a namespace (a name without one would be taken for a directory) and an optional @revision.
_PART = r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?"
HUB_ID = re.compile(rf"(?P<repo>{_PART}/{_PART})(?:@(?P<revision>[^\s@]*))?", re.ASCII)
# The formats a policyloop process never loads, left out of downloads: other frameworks' weights,
# exports, and the original checkpoints some repositories carry beside the transformers ones.
IGNORED_FILES: tuple[str, ...] = ("original/*", "*.pth", "*.onnx", "*.onnx_data", "onnx/*", "*.gguf", "*.h5",
                                  "*.msgpack", "*.ot", "*.tflite", "coreml/*", "openvino/*")
REF_HELP = ("A Hugging Face model directory, or a Hugging Face model id (org/name, org/name@revision) found "
            "through the Hugging Face cache (HF_HOME; downloaded into it unless HF_HUB_OFFLINE=1).")


class ModelNotFound(ValueError):
    """A model name that resolves to no model directory; the message names the setting."""


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    revision: str | None = None  # None: the repository's default branch

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def is_explicit_path(name: str) -> bool:
    """Whether `name` can only be a path: absolute, or starting with '.' or '~'."""
    return name.startswith(("/", ".", "~", "\\"))


def hub_model(name: str | PurePath) -> HubModel | None:
    """The Hugging Face model `name` would be if it is no directory (None: it cannot be one)."""
    if isinstance(name, PurePath):
        return None
    match = HUB_ID.fullmatch(name)
    if match is None or is_explicit_path(name) or "--" in match["repo"] or ".." in match["repo"] \
            or match["repo"].endswith(".git"):
        return None
    return HubModel(match["repo"], match["revision"] or None)


def _check_ref(value: Any) -> Any:
    """A model name as settings take it: a path's text, refused when empty or an id with an empty
    revision. Whether it exists is known only where it is loaded."""
    if isinstance(value, PurePath):
        value = str(value)
    if not isinstance(value, str):
        raise PydanticCustomError(
            "model_ref", "expected a model directory or a Hugging Face model id (org/name[@revision]), "
                         "got {kind}", {"kind": type(value).__name__})
    if not value.strip():
        raise PydanticCustomError(
            "model_ref", "empty: name a model directory or a Hugging Face model id (org/name[@revision])")
    if value.endswith("@") and HUB_ID.fullmatch(value) and not is_explicit_path(value):
        raise PydanticCustomError(
            "model_ref", "'{value}': a Hugging Face model id with an empty revision (org/name or "
                         "org/name@<branch, tag or commit>)", {"value": value})
    return value


# The type of every setting that names a model: text (a Path given is taken as its text).
ModelRef = Annotated[str, BeforeValidator(_check_ref)]


def resolve_model(name: str | PurePath, *, setting: str = "model_path") -> Path:
    """The local directory of the model `name` names (see the module's docstring). Raises
    ModelNotFound, its message starting with `setting`, when there is none."""
    text = str(name)
    if not text.strip():
        raise ModelNotFound(f"{setting}: empty: name a model directory or a Hugging Face model id")
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    hub = hub_model(name)
    if hub is None:
        what = "is not a directory" if path.exists() else "does not exist"
        raise ModelNotFound(f"{setting}: the model directory {text} {what} (nor is it a Hugging Face model id, "
                            "org/name[@revision])")
    if path.exists():
        raise ModelNotFound(f"{setting}: {text} is a file, not a model directory")
    return _snapshot(hub, text, setting)


def _snapshot(hub: HubModel, text: str, setting: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        folder = snapshot_download(hub.repo_id, revision=hub.revision, local_files_only=offline,
                                   ignore_patterns=list(IGNORED_FILES))
    except RevisionNotFoundError as exc:
        raise ModelNotFound(f"{setting}: the Hugging Face model {hub.repo_id} has no revision "
                            f"{hub.revision!r}") from exc
    except RepositoryNotFoundError as exc:
        raise ModelNotFound(f"{setting}: no directory {text} here, and the Hugging Face Hub has no model "
                            f"{hub.repo_id} this token may read") from exc
    except LocalEntryNotFoundError as exc:
        if type(exc).__name__ == "IncompleteSnapshotError":  # huggingface_hub 1.x+: files of it are missing
            raise ModelNotFound(f"{setting}: the cached snapshot of the Hugging Face model {hub} is incomplete "
                                f"(fetch it again: `policyloop models fetch {hub}`): {exc}") from exc
        why = ("HF_HUB_OFFLINE is set: download it first (`policyloop models fetch "
               f"{hub}` with the same HF_HOME)") if offline else f"the Hub could not be reached: {exc}"
        raise ModelNotFound(f"{setting}: no directory {text} here, and the Hugging Face model {hub} is not in "
                            f"the cache {constants.HF_HUB_CACHE} ({why})") from exc
    except (OSError, ValueError) as exc:
        raise ModelNotFound(f"{setting}: the Hugging Face model {hub} could not be fetched: "
                            f"{type(exc).__name__}: {exc}") from exc
    return Path(folder)


def model_argument(text: str) -> Path:
    """`resolve_model` as an argparse type (`--model-path`): a name that names nothing is a usage
    error that says why."""
    import argparse

    try:
        return resolve_model(text, setting="--model-path")
    except ModelNotFound as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--model-path: ")) from exc


def hub_repo(name: str | PurePath) -> str | None:
    """The Hugging Face repository `name` stands for: the id it names, or the one whose cached
    snapshot the directory is (HF cache layout: models--<org>--<name>/snapshots/<commit>). None:
    a directory of its own."""
    path = Path(str(name)).expanduser()
    if not path.is_dir():
        hub = hub_model(name)
        return hub.repo_id if hub else None
    resolved = path.resolve()
    folder = resolved.parent.parent.name
    if resolved.parent.name == "snapshots" and folder.startswith("models--"):
        return folder.removeprefix("models--").replace("--", "/")
    return None


def model_label(name: str | PurePath) -> str:
    """A short name for the model `name` names: its Hugging Face id, else its directory's name."""
    return hub_repo(name) or Path(str(name)).expanduser().resolve().name
