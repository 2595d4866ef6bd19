"""Environment programs that ship with policyloop: `policyloop demo --agent-env` trains on the tally
desk, and it shows the form a team's own environment takes (docs/environments.md). Each is a
standard-library module read as a file and run in a sandbox session per episode, never imported
by a service."""

from __future__ import annotations

from pathlib import Path

TALLY_DESK = Path(__file__).with_name("tally_desk.py")
TALLY_DESK_ENTRY = "tally_desk:TallyDesk"
