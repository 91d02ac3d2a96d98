"""Small socket helpers that several processes and tools need."""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for children started with an explicit port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
