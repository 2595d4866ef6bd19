"""A JetStream cluster of nats-server processes on one host: their command lines, and who leads.

Each node has its own name, client, route and monitoring ports and store; every node lists the
routes of all the others. The meta leader (which places streams and consumers) is read from any
node's monitoring endpoint (/jsz); a stream's leader (which orders its writes) from JetStream's
stream info.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from nats.js.client import JetStreamContext

DEFAULT_CLUSTER_NAME = "policyloop"


@dataclass(frozen=True)
class NatsNode:
    name: str            # server name, e.g. "nats-0"; JetStream names leaders by it
    client_port: int
    route_port: int
    monitor_port: int
    store_dir: Path
    host: str = "127.0.0.1"

    @property
    def client_url(self) -> str:
        return f"nats://{self.host}:{self.client_port}"

    @property
    def route_url(self) -> str:
        return f"nats://{self.host}:{self.route_port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"

    @property
    def ports(self) -> dict[str, int]:
        return {"client": self.client_port, "route": self.route_port, "monitor": self.monitor_port}


def plan_nodes(count: int, store_root: Path, ports: list[tuple[int, int, int]],
               prefix: str = "nats") -> list[NatsNode]:
    """`count` nodes named <prefix>-<i>, each storing under store_root/<name>, on the given
    (client, route, monitor) ports."""
    if count < 1 or len(ports) != count:
        raise ValueError(f"{count} nodes need {count} port triples, got {len(ports)}")
    return [NatsNode(f"{prefix}-{i}", c, r, m, store_root / f"{prefix}-{i}") for i, (c, r, m) in enumerate(ports)]


def node_command(binary: str, node: NatsNode, peers: list[NatsNode],
                 cluster_name: str = DEFAULT_CLUSTER_NAME) -> list[str]:
    """The nats-server command line of `node` in a cluster with `peers` (the others; `node`
    itself is left out of its routes if present)."""
    routes = ",".join(p.route_url for p in peers if p.name != node.name)
    command = [
        binary, "-js", "-n", node.name, "-a", node.host, "-p", str(node.client_port),
        "-m", str(node.monitor_port), "-sd", str(node.store_dir),
        "--cluster_name", cluster_name, "--cluster", node.route_url,
    ]
    if routes:
        command += ["--routes", routes]
    return command


def nats_url_list(nodes: list[NatsNode]) -> str:
    """The comma-separated client URLs clients are given (they fail over between them)."""
    return ",".join(n.client_url for n in nodes)


def jsz(monitor_url: str, timeout_s: float = 2.0) -> dict:
    """The node's /jsz report (JetStream state, including the meta cluster's leader)."""
    with urllib.request.urlopen(f"{monitor_url}/jsz", timeout=timeout_s) as reply:  # noqa: S310 - local URL
        return json.loads(reply.read())


def node_stream_state(monitor_url: str, stream: str, timeout_s: float = 2.0) -> dict | None:
    """The state (messages, first_seq, last_seq, …) of `stream` as this node holds it, None
    when the node holds no copy: shows whether a restarted node has caught up."""
    with urllib.request.urlopen(f"{monitor_url}/jsz?accounts=true&streams=true",  # noqa: S310 - local URL
                                timeout=timeout_s) as reply:
        report = json.loads(reply.read())
    for account in report.get("account_details") or []:
        for detail in account.get("stream_detail") or []:
            if detail.get("name") == stream:
                return dict(detail.get("state") or {})
    return None


def meta_leader(monitor_urls: list[str], timeout_s: float = 2.0) -> str | None:
    """Name of the JetStream meta leader as the first answering node sees it (None: no node
    answers, or none knows a leader: an election is under way)."""
    for url in monitor_urls:
        try:
            leader = (jsz(url, timeout_s).get("meta_cluster") or {}).get("leader")
        except (OSError, urllib.error.URLError, ValueError):
            continue
        if leader:
            return str(leader)
    return None


def cluster_ready(monitor_urls: list[str], timeout_s: float = 2.0) -> bool:
    """Every node answers, agrees on one meta leader, and says it is healthy (/healthz)."""
    leaders = set()
    for url in monitor_urls:
        try:
            leaders.add((jsz(url, timeout_s).get("meta_cluster") or {}).get("leader"))
            with urllib.request.urlopen(f"{url}/healthz", timeout=timeout_s) as reply:  # noqa: S310
                if json.loads(reply.read()).get("status") != "ok":
                    return False
        except (OSError, urllib.error.URLError, ValueError):
            return False
    return len(leaders) == 1 and None not in leaders and "" not in leaders


def wait_cluster_ready(monitor_urls: list[str], timeout_s: float = 30.0) -> str:
    """Waits for `cluster_ready`; returns the meta leader's name."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cluster_ready(monitor_urls):
            leader = meta_leader(monitor_urls)
            if leader:
                return leader
        time.sleep(0.2)
    raise TimeoutError(f"no JetStream meta leader among {monitor_urls} after {timeout_s}s")


async def stream_leader(js: JetStreamContext, stream: str) -> str | None:
    """Name of the node leading `stream` now (None: a single server, or an election)."""
    info = await js.stream_info(stream)
    return info.cluster.leader if info.cluster is not None else None
