"""What the `policyloop` command's groups share: the typer app they add their commands to, the
console, and options derived from settings models."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, get_args, get_origin

import typer
from pydantic import BaseModel
from rich.console import Console

if TYPE_CHECKING:
    pass

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="policyloop: an RL post-training loop of independent services.")
# Tables stay readable when the output is a file or a CI log (rich assumes 80 columns there).
console = Console() if sys.stdout.isatty() else Console(width=160)

DEFAULT_RUN_DIR = Path("runs/local")
F = TypeVar("F", bound=Callable[..., Any])


def field_help(model: type[BaseModel], name: str) -> str:
    """A settings field's description, with its choices when it has a fixed set."""
    info = model.model_fields[name]
    choices = get_args(info.annotation) if get_origin(info.annotation) is Literal else ()
    return (info.description or "") + (f" One of: {', '.join(map(str, choices))}." if choices else "")


def field_default(model: type[BaseModel], name: str) -> Any:
    return model.model_fields[name].default


def loss_options(*, into: str) -> Callable[[F], F]:
    """Gives a command one option per setting of the loss registry's kinds (`--loss` for the kind,
    `--clip-low` ...: help and type from the first kind that has it) and passes those given to the
    command as one dict `into`, for the kind to validate: a setting added to a kind is a flag at
    once, and one left unset takes the chosen kind's default."""
    from policyloop.rl.losses import DEFAULT_KIND, LOSS_KINDS, parameters

    def decorate(command: F) -> F:
        signature = inspect.signature(command)
        own = [p for p in signature.parameters.values() if p.name != into]
        added = []
        for name, model in parameters().items():
            if name == "kind":
                option = typer.Option(help=f"The loss kind. One of: {', '.join(LOSS_KINDS)}.")
                added.append(inspect.Parameter("loss", inspect.Parameter.KEYWORD_ONLY, default=DEFAULT_KIND,
                                               annotation=Annotated[str, option]))
                continue
            info = model.model_fields[name]
            annotation = str if get_origin(info.annotation) is Literal else info.annotation
            first_kind = model.model_fields["kind"].default
            option = typer.Option(help=f"{field_help(model, name)} (default: the kind's; {first_kind}: {info.default})")
            added.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                           annotation=Annotated[annotation | None, option]))

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            values = {"kind": kwargs.pop("loss")}
            for name in parameters():
                if name != "kind" and (value := kwargs.pop(name)) is not None:
                    values[name] = value
            return command(**kwargs, **{into: values})

        wrapper.__signature__ = signature.replace(parameters=[*own, *added])  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate
