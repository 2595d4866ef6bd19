"""`policyloop demo` checks its objective flags before it starts anything."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(("flags", "named"), [
    (["--loss", "dpo"], "--loss: kind must be one of ppo, cispo, cross_entropy, dro, gspo, importance_sampling"),
    (["--off-policy", "sometimes"], "--off-policy: Input should be 'none', 'tis' or 'decoupled'"),
    (["--off-policy", "tis", "--tis-cap", "0"], "tis_cap"),
    (["--loss", "dro"], "--beta: Field required"),
    (["--beta", "0.5"], "--beta: Extra inputs are not permitted"),  # ppo has none
    (["--weight-update-mode", "sideways"], "--weight-update-mode must be one of"),
    (["--tracker", "neptune"], "--tracker must be one of none, tensorboard, wandb, mlflow"),
    (["--agent", "--production"], "--production, --agent and --agent-env are demos of their own: choose one"),
    (["--agent-env", "--agent"], "--production, --agent and --agent-env are demos of their own: choose one"),
    (["--agent-env", "--tools"], "--agent-env trains the full model, without --tools or --tracker"),
    (["--agent", "--tools"], "--agent trains the full model, without --tools or --tracker, on --traffic >= 1"),
    (["--agent", "--traffic", "0"], "--agent trains the full model, without --tools or --tracker, on --traffic >= 1"),
])
def test_demo_refuses_an_unknown_objective(flags: list[str], named: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """In this process (typer's runner): the module entry point is run by the test below."""
    from typer.testing import CliRunner

    from policyloop.cli import app

    result = CliRunner().invoke(app, ["demo", "--run-dir", str(tmp_path / "run"), *flags])
    assert result.exit_code == 2 and named in " ".join(result.output.split()), result.output
    assert not (tmp_path / "run").exists()  # no cluster was started


def test_demo_flags_are_the_settings_fields() -> None:
    """Every setting of every loss kind, and the loop settings the demo sets, are flags with the
    field's own description (a setting left unset is the chosen kind's default), and --loss offers
    the registry's kinds: a setting or a kind added to the registry is a demo flag without another line."""
    import inspect
    from typing import get_type_hints

    from policyloop.cli.common import field_help
    from policyloop.demo.cli import demo
    from policyloop.learner.settings import TrackerSettings
    from policyloop.rl.losses import DEFAULT_KIND, LOSS_KINDS
    from policyloop.rl.losses import parameters as loss_parameters
    from policyloop.rl.settings import OptimizerSettings
    from policyloop.runtime.settings import ServiceSettings

    parameters = inspect.signature(demo).parameters
    assert parameters["loss"].default == DEFAULT_KIND
    assert parameters["loss"].annotation.__metadata__[0].help.endswith(f"One of: {', '.join(LOSS_KINDS)}.")
    for name, model in loss_parameters().items():
        if name != "kind":
            assert parameters[name].default is None
            assert parameters[name].annotation.__metadata__[0].help.startswith(field_help(model, name))
    for model, name in ((ServiceSettings, "groups_per_step"), (ServiceSettings, "max_lag"), (OptimizerSettings, "lr")):
        assert parameters[name].default == model.model_fields[name].default
    assert parameters["tracker"].default == TrackerSettings.model_fields["kind"].default
    tracker_help = get_type_hints(demo, include_extras=True)["tracker"].__metadata__[0].help
    assert tracker_help.startswith(field_help(TrackerSettings, "kind"))


def test_demo_refuses_a_tracker_whose_extra_is_missing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Before it bootstraps a model or starts a cluster, naming the extra to install."""
    import os

    hidden = tmp_path / "hidden" / "wandb"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('not installed here', name='wandb')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hidden.parent), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "policyloop", "demo", "--run-dir", str(tmp_path / "run"),
                             "--tracker", "wandb"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "pip install 'policyloop[trackers-wandb]'" in " ".join(result.stdout.split())
    assert "bootstrapping" not in result.stdout and not (tmp_path / "run").exists()


def test_a_demos_first_sigterm_interrupts_and_later_ones_are_ignored() -> None:
    """SIGTERM ends a demo as Ctrl-C does (its cluster is stopped on the way out); a second one
    while it stops is ignored rather than cutting the stop short."""
    import signal

    from policyloop.demo.cli import _interrupt

    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(KeyboardInterrupt):
            _interrupt(signal.SIGTERM, None)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_up_refuses_a_negative_relay_fanout_before_it_starts_anything(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from typer.testing import CliRunner

    from policyloop.cli import app

    result = CliRunner().invoke(app, ["up", "--run-dir", str(tmp_path / "run"), "--relay-fanout", "-1"])
    assert result.exit_code == 2 and "--relay-fanout" in result.output, result.output
    assert not (tmp_path / "run").exists()
