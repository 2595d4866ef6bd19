"""Ports on this host."""

from __future__ import annotations

import socket
import threading
from collections import OrderedDict

# The kernel may hand the same ephemeral port to two binds in a row once the first socket closes,
# so a launcher asking for a service's HTTP and gRPC ports could get one port twice. Ports handed
# out recently are remembered and not handed out again.
_RECENT_LIMIT = 4096
_recent: OrderedDict[int, None] = OrderedDict()
_recent_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now and this process has not handed out recently (the
    kernel's pick; another process may take it before the caller binds, which loopback tests and
    launchers accept)."""
    with _recent_lock:
        for _ in range(64):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port not in _recent:
                break
        _recent[port] = None
        _recent.move_to_end(port)
        while len(_recent) > _RECENT_LIMIT:
            _recent.popitem(last=False)
        return port
