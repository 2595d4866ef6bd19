"""The loss registry is the one list of loss kinds: the docs' table, the learner's settings, the
demo's flags and Tinker's losses all derive from it, and a kind declared in a new module is found."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from policyloop.rl import losses
from policyloop.rl.losses import KINDS, LOSS_KINDS, PolicyLoss, loss_settings

DOCS = Path(__file__).resolve().parents[2] / "docs" / "losses.md"


def documented_kinds() -> dict[str, str]:
    """The docs' table of kinds: kind → its settings column."""
    section = DOCS.read_text().split("## Kinds", 1)[1].split("\n\n", 2)[1]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {re.match(r"\| `(\w+)`", row).group(1): row.rsplit("|", 2)[1] for row in rows}  # type: ignore[union-attr]


def test_the_docs_table_lists_each_kind_and_its_own_settings_with_their_defaults() -> None:
    documented = documented_kinds()
    assert list(documented) == list(LOSS_KINDS)
    for kind, model in KINDS.items():
        own = [name for name, info in model.model_fields.items()
               if name not in PolicyLoss.model_fields or info.default != PolicyLoss.model_fields[name].default]
        own = [name for name in own if name != "kind"]
        for name in own:
            info = model.model_fields[name]
            default = "required" if info.is_required() else str(info.default)
            assert f"`{name}` ({default})" in documented[kind], (kind, name)
        if not own:
            assert documented[kind].strip() == "—", kind


def test_the_learner_takes_every_kind_by_name() -> None:
    from policyloop.learner.settings import LearnerSettings

    for kind in LOSS_KINDS:
        extra = {"beta": 0.1} if kind == "dro" else {}
        assert LearnerSettings(loss={"kind": kind, **extra}).loss.kind == kind
    assert LearnerSettings().loss == loss_settings()  # the default kind, ppo


def test_a_kind_in_a_new_module_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What docs/losses.md says: one module is the whole change."""
    package = tmp_path / "policyloop_extra_losses"
    package.mkdir()
    (package / "reinforce.py").write_text(
        "from typing import Literal\n"
        "from policyloop.rl.losses.base import LossInputs, LossTerms, PolicyLoss\n\n\n"
        "class ReinforceLoss(PolicyLoss):\n"
        "    kind: Literal['reinforce'] = 'reinforce'\n\n"
        "    def terms(self, inputs: LossInputs) -> LossTerms:\n"
        "        return LossTerms(-inputs.advantages * inputs.logprobs, {})\n")
    monkeypatch.setattr(losses, "__path__", [*losses.__path__, str(package)])
    try:
        found = losses._discover()
    finally:
        sys.modules.pop("policyloop.rl.losses.reinforce", None)
    assert list(found)[0] == "ppo" and set(found) == {*KINDS, "reinforce"}
    import torch

    from policyloop.rl.objective import BatchCounts, objective

    logprobs, advantages, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[0.5, 0.5]]), torch.ones(1, 2)
    result = objective(found["reinforce"](), logprobs, advantages, mask, BatchCounts(2.0, 1, 2),
                       behaviour_logprobs=logprobs)
    assert float(result.loss) == 0.75  # −Σ A·log π / tokens
