"""Picking a free local TCP port for a process this one starts (a server, a worker, a group's rendezvous)."""

from __future__ import annotations

import random
import socket

_LOWEST = 20000


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, below the kernel's ephemeral range where it can: a
    port from bind(0) is one the kernel may hand to the next socket bound to port 0 (a tensor-parallel rank's,
    an outgoing connection's) before the process it was picked for binds it, and a server binds its HTTP
    port last, after its group has started."""
    high = 32767
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = int(f.read().split()[0]) - 1
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()  # seeded from the OS: processes started together must not walk the same ports
    if high > _LOWEST:
        for _ in range(200):
            port = rng.randint(_LOWEST, high)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # nothing free there: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
