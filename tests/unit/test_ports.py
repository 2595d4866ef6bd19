"""free_port never hands one process the same port twice in a row of requests."""

from policyloop.common.ports import free_port


def test_a_process_is_not_handed_the_same_port_twice() -> None:
    # The kernel's picks from ~28k ephemeral ports repeat within 2,000 binds (birthday bound),
    # which once gave a service's HTTP and gRPC servers one port.
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
