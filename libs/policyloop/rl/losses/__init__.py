"""The loss registry: one module per loss kind in this package, each a settings model with its
`terms` (rl.losses.base). The learner's full-model and LoRA runs, supervised steps and the
Tinker API all compute their loss through it (rl.objective), and the CLI's choices, the learner's
settings, runs' loss settings and the docs derive from KINDS. A new kind is a new module here
(plus its test); a setting of a new name is also a field of LossSettings in loop.proto."""

from __future__ import annotations

import importlib
import math
import pkgutil
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Union

from pydantic import Discriminator, Field, Tag, TypeAdapter, ValidationError

from policyloop.rl.losses.base import (
    ADVANTAGE_KINDS,
    KL_ESTIMATORS,
    NORMALIZATIONS,
    LossInputs,
    LossTerms,
    PolicyLoss,
)

if TYPE_CHECKING:
    from policyloop.contracts.v1 import loop_pb2

DEFAULT_KIND = "ppo"


def _discover() -> dict[str, type[PolicyLoss]]:
    found: dict[str, type[PolicyLoss]] = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"):
        namespace = vars(importlib.import_module(f"{__name__}.{module}"))
        for value in namespace.values():
            if isinstance(value, type) and issubclass(value, PolicyLoss) and value.__module__ == namespace["__name__"]:
                kind = value.model_fields["kind"].default
                if kind in found:
                    raise TypeError(f"loss kind {kind!r} is declared twice")
                found[kind] = value
    return {DEFAULT_KIND: found.pop(DEFAULT_KIND), **found}


KINDS: dict[str, type[PolicyLoss]] = _discover()
LOSS_KINDS: tuple[str, ...] = tuple(KINDS)


def _kind_of(value: Any) -> str:
    """A loss's kind: its `kind`, or the default kind when the settings leave it unsaid."""
    kind = value.get("kind", DEFAULT_KIND) if isinstance(value, Mapping) else getattr(value, "kind", DEFAULT_KIND)
    return kind if isinstance(kind, str) else DEFAULT_KIND


LossSettings = Annotated[
    Union[tuple(Annotated[model, Tag(kind)] for kind, model in KINDS.items())],  # type: ignore[valid-type]  # noqa: UP007
    Discriminator(_kind_of, custom_error_type="loss_kind",
                  custom_error_message=f"kind must be one of {', '.join(LOSS_KINDS)}"),
    Field(description=f"The objective: its kind ({', '.join(LOSS_KINDS)}) and settings."),
]
_ADAPTER: TypeAdapter[PolicyLoss] = TypeAdapter(LossSettings)


def loss_settings(**values: Any) -> PolicyLoss:
    """A kind's settings from field values (`kind` among them; the default kind without)."""
    return _ADAPTER.validate_python(values)


def parameters() -> dict[str, type[PolicyLoss]]:
    """Each setting's name → the first kind that has it (every setting of any kind, once)."""
    found: dict[str, type[PolicyLoss]] = {}
    for model in KINDS.values():
        for name in model.model_fields:
            found.setdefault(name, model)
    return found


def setting_problem(name: str, value: Any, kind: str | None = None) -> str | None:
    """What is wrong with one setting a run names (of `kind`, or of any kind that has it), or None."""
    if name == "kind":
        return None if value in KINDS else f"one of {', '.join(LOSS_KINDS)}, got {value!r}"
    if kind is not None and kind in KINDS:
        model = KINDS[kind]
        if name not in model.model_fields:
            return f"not a setting of the {kind} loss (its settings: {', '.join(model.model_fields)})"
    else:
        model = parameters()[name]
    if isinstance(value, float) and not math.isfinite(value):
        return f"a finite number expected, got {value!r}"
    info = model.model_fields[name]
    try:
        TypeAdapter(Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
                    ).validate_python(value)
    except ValidationError as exc:
        return f"{exc.errors()[0]['msg']}, got {value!r}"
    return None


def to_proto(loss: PolicyLoss) -> loop_pb2.LossSettings:
    """Every setting of `loss`, as the learner advertises its objective."""
    from policyloop.contracts.v1 import loop_pb2

    return loop_pb2.LossSettings(**loss.model_dump())


def named_in(message: loop_pb2.LossSettings) -> dict[str, Any]:
    """The settings a LossSettings message sets (a run's: those it needs)."""
    return {field.name: getattr(message, field.name) for field in message.DESCRIPTOR.fields
            if message.HasField(field.name)}


__all__ = ["ADVANTAGE_KINDS", "DEFAULT_KIND", "KINDS", "KL_ESTIMATORS", "LOSS_KINDS", "NORMALIZATIONS",
           "LossInputs", "LossSettings", "LossTerms", "PolicyLoss", "loss_settings",
           "named_in", "parameters", "setting_problem", "to_proto"]
