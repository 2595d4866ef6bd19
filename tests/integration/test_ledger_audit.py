"""The ledger audit over a real NATS says when its figures are provisional: taken while groups are
in flight, a trajectory moving on as the bus is read can show as a gap that is gone at rest."""

from __future__ import annotations

import json
import subprocess
import sys

from policyloop.bus import Bus, rollouts_subject, trajectories_subject
from policyloop.ledger import audit_bus, record_generated
from tests.conftest import Server
from tests.helpers import publish_group, scored_group


def audit_cli(nats_url: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "policyloop", "audit", "--nats-url", nats_url],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout[result.stdout.index("{"):])


async def test_an_audit_with_groups_in_flight_is_provisional_and_final_at_rest(bus: Bus, nats_server: Server
                                                                                ) -> None:
    group = scored_group("live:0")
    await record_generated(bus, group, "rollout-0")
    await publish_group(bus, rollouts_subject("e"), *group)  # generated, not yet scored

    live = await audit_bus(bus)
    assert live.provisional and "1 groups wait in ROLLOUTS" in live.provisional_reason, live
    assert "audit at rest" in live.provisional_reason
    printed = audit_cli(nats_server.url)
    assert printed["provisional"] is True and "ROLLOUTS" in printed["provisional_reason"]

    # Reward scores it (takes it off ROLLOUTS, stores it in TRAJECTORIES); the learner holds it.
    subscription = await bus.js.pull_subscribe(rollouts_subject("e"), durable="reward", stream="ROLLOUTS")
    [message] = await subscription.fetch(1, timeout=10)
    await publish_group(bus, trajectories_subject("e"), *group)
    await message.ack_sync()

    rest = await audit_bus(bus)
    assert not rest.provisional and rest.provisional_reason == "", rest
    assert rest.generated == rest.pending == 2 and rest.lost == 0
    printed = audit_cli(nats_server.url)
    assert printed["provisional"] is False and printed["provisional_reason"] == ""
