"""The `policyloop` command: serve one service, bring up a local cluster, show its status, build
or fetch base models, submit environments and drive runs through a gateway (`env`, `run`,
`versions`, `traces`). One module per group of sub-commands; packages that add commands of their
own (the demo: `policyloop demo`, `evaluate`) name a function taking the app in the
`policyloop.commands` entry-point group, so that the library never imports them."""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import entry_points

from policyloop.cli.common import app

for group in ("services", "cluster", "models", "loop", "releases"):  # each adds its commands, in this order
    import_module(f"policyloop.cli.{group}")
for plugin in sorted(entry_points(group="policyloop.commands"), key=lambda ep: ep.name):
    plugin.load()(app)

__all__ = ["app"]
