"""A Hugging Face cache that tests fill themselves, offline: a model directory (e.g. one that
tests/tiny_model.py built) put into the hub cache's on-disk layout as huggingface_hub writes it
(https://huggingface.co/docs/hub/local-cache):

    <HF_HUB_CACHE>/models--<org>--<name>/
        blobs/<sha256 of the file>                 each file's bytes, once
        refs/<revision>                            the commit a branch or tag points at
        snapshots/<commit>/<path>                  -> ../../blobs/<sha256> (relative links)

    cache = offline_cache(monkeypatch, tmp_path / "hf")             # HF_HOME, HF_HUB_OFFLINE=1
    cache_model(cache, "org/tiny", model_dir)                       # refs/main
    cache_model(cache, "org/tiny", other_dir, revision="v2")        # a second commit, refs/v2
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest


def offline_cache(monkeypatch: pytest.MonkeyPatch, home: Path) -> Path:
    """HF_HOME=`home` and HF_HUB_OFFLINE=1 for this test, and the hub cache `home`/hub (empty)
    returned: in the environment, for the processes the test starts, and in huggingface_hub's
    constants, which this process read once, when it imported huggingface_hub."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home / "hub"


def cache_model(cache: Path, repo_id: str, source: Path, *, revision: str = "main") -> Path:
    """Copies the files under `source` into `cache` as commit <sha1 of their contents> of the
    model `repo_id`, points refs/`revision` at it, and returns the snapshot directory."""
    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    files = sorted(p for p in Path(source).rglob("*") if p.is_file())
    digest = hashlib.sha1()
    for path in files:
        digest.update(str(path.relative_to(source)).encode() + b"\0" + path.read_bytes())
    commit = digest.hexdigest()
    snapshot = repo / "snapshots" / commit
    for path in files:
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    ref = repo / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)  # huggingface_hub writes the bare hash, no newline
    return snapshot
