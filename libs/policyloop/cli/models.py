"""`policyloop bootstrap` and `policyloop models`: the base models built here or fetched from the hub."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    pass

from policyloop.cli.common import app, console


@app.command()
def bootstrap(
    out: Annotated[Path | None, typer.Option(
        help="Cache root: the model goes into OUT/<name>-<config hash>/ "
             "(default $POLICYLOOP_CACHE/models or ~/.cache/policyloop/models).")] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even when a complete cached model exists.")] = False,
    tools: Annotated[bool, typer.Option(help="The multi-turn demo's model (it knows the python tool).")] = False,
    chat: Annotated[bool, typer.Option(
        help="The chat model: a BPE tokenizer, the Qwen2.5 chat template, and function tools it calls "
             "(<tool_call> blocks) after a warm-up on arithmetic questions.")] = False,
    reward_model: Annotated[bool, typer.Option(
        "--reward-model",
        help="The reward model: a sequence classifier scoring an arithmetic answer (prompt + completion), trained "
             "on pairs of right and wrong answers; its build samples the arithmetic model (built first, in OUT).")
    ] = False,
    link: Annotated[Path | None, typer.Option(
        help="Also point this path at the model (a relative symlink, replaced atomically): a fixed name "
             "such as /models/base for containers that mount the same volume.")] = None,
) -> None:
    """Build (or find cached) the small base model warmed up on arithmetic, or its reward model; prints JSON."""
    from policyloop.models.bootstrap import (
        TOOLS_BOOTSTRAP,
        BootstrapConfig,
        BootstrapError,
        BootstrapRecipe,
        bootstrap_dir,
        is_complete,
        read_record,
    )
    from policyloop.models.bootstrap import bootstrap as build_bootstrap

    if tools + chat + reward_model > 1:
        console.print("[red]--tools, --chat and --reward-model name different models: give one[/red]")
        raise typer.Exit(2)
    config: BootstrapRecipe
    if chat:
        from policyloop.models.chat import CHAT_BOOTSTRAP

        config = CHAT_BOOTSTRAP
    elif reward_model:
        from policyloop.models.reward_model import REWARD_MODEL_BOOTSTRAP

        config = REWARD_MODEL_BOOTSTRAP
    else:
        config = TOOLS_BOOTSTRAP if tools else BootstrapConfig()
    cached = is_complete(bootstrap_dir(config, out)) and not force
    try:
        path = build_bootstrap(config, out, force=force)
    except BootstrapError as exc:
        console.print(f"[red]bootstrap failed:[/red] {exc}")
        raise typer.Exit(1) from exc
    record = read_record(path)
    if link is not None:
        _replace_symlink(link, path)
    if chat:
        from policyloop.models.chat import summary

        printed = {"path": str(path.resolve()), **summary(record), "cached": cached}
    elif reward_model:
        from policyloop.models.reward_model import summary as reward_model_summary

        printed = {"path": str(path.resolve()), **reward_model_summary(record), "cached": cached}
    else:
        printed = {"path": str(path.resolve()), "heldout_accuracy": record["heldout_accuracy"],
                   "steps": record["steps"], "seconds": record["seconds"], "cached": cached}
    print(json.dumps(printed, indent=2))


def _replace_symlink(link: Path, target: Path) -> None:
    """`link` -> `target`, relative so that it resolves wherever the volume is mounted; a rename
    over the old link, so a reader sees one or the other."""
    link = link.absolute()
    if link.exists() and not link.is_symlink():
        raise typer.BadParameter(f"{link} exists and is not a symlink", param_hint="--link")
    link.parent.mkdir(parents=True, exist_ok=True)
    relative = os.path.relpath(target.resolve(), link.parent.resolve())
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(relative, target_is_directory=True)
    tmp.replace(link)


# -- base models: a directory, or a Hugging Face model id in the Hugging Face cache -------------

models_app = typer.Typer(no_args_is_help=True, help="Base models named by a Hugging Face model id (docs/deploy.md).")
app.add_typer(models_app, name="models")


def model_dir(name: str | Path, flag: str = "--model-path") -> Path:
    """The directory of the model a flag names (models.resolve: a directory, or a Hugging Face
    model id looked up in, or fetched into, the Hugging Face cache); a bad name is a usage error."""
    from policyloop.models.resolve import ModelNotFound, resolve_model

    try:
        return resolve_model(name, setting=flag)
    except ModelNotFound as exc:
        raise typer.BadParameter(str(exc).removeprefix(f"{flag}: "), param_hint=flag) from exc


@models_app.command("fetch")
def models_fetch(
    model: Annotated[str, typer.Argument(
        help="A Hugging Face model id: org/name, or org/name@revision (a branch, tag or commit).")],
    link: Annotated[Path | None, typer.Option(
        help="Also point this path at the model's snapshot (a relative symlink, replaced atomically): a fixed "
             "name such as /models/base for containers that mount the same volume.")] = None,
) -> None:
    """Download a Hugging Face model into the Hugging Face cache (HF_HOME), once for a cluster whose
    services share that cache; prints JSON. With HF_HUB_OFFLINE=1 it only checks the cache."""
    from policyloop.models.resolve import hub_model

    if hub_model(model) is None:
        raise typer.BadParameter(f"{model!r} is not a Hugging Face model id (org/name[@revision])",
                                 param_hint="MODEL")
    path = model_dir(model, "MODEL")
    if link is not None:
        _replace_symlink(link, path)
    print(json.dumps({"model": model, "path": str(path), "link": str(link) if link else None}, indent=2))
