"""Small socket helpers that several processes and tools need."""

import socket


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for children started with an explicit port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
