"""Command lines of a local JetStream cluster's nodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from policyloop.cluster.nats_cluster import nats_url_list, node_command, plan_nodes


def nodes(root: Path):  # type: ignore[no-untyped-def]
    return plan_nodes(3, root, [(4222, 6222, 8222), (4223, 6223, 8223), (4224, 6224, 8224)])


def test_plan_names_nodes_and_gives_each_its_store(tmp_path: Path) -> None:
    planned = nodes(tmp_path)
    assert [n.name for n in planned] == ["nats-0", "nats-1", "nats-2"]
    assert [n.store_dir for n in planned] == [tmp_path / f"nats-{i}" for i in range(3)]
    assert planned[1].ports == {"client": 4223, "route": 6223, "monitor": 8223}
    assert nats_url_list(planned) == "nats://127.0.0.1:4222,nats://127.0.0.1:4223,nats://127.0.0.1:4224"
    with pytest.raises(ValueError):
        plan_nodes(3, tmp_path, [(1, 2, 3)])


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_each_node_routes_to_the_others_only(tmp_path: Path) -> None:
    planned = nodes(tmp_path)
    command = node_command("/usr/bin/nats-server", planned[1], planned, cluster_name="pl")
    assert command[0] == "/usr/bin/nats-server" and "-js" in command
    assert option(command, "-n") == "nats-1"
    assert option(command, "-p") == "4223"
    assert option(command, "-m") == "8223"
    assert option(command, "-sd") == str(tmp_path / "nats-1")
    assert option(command, "--cluster_name") == "pl"
    assert option(command, "--cluster") == "nats://127.0.0.1:6223"
    assert option(command, "--routes") == "nats://127.0.0.1:6222,nats://127.0.0.1:6224"


def test_a_lone_node_has_no_routes(tmp_path: Path) -> None:
    [node] = plan_nodes(1, tmp_path, [(4222, 6222, 8222)])
    assert "--routes" not in node_command("nats-server", node, [node])
