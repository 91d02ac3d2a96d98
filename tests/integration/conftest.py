import pytest

from tests.nats_server import NatsServer


@pytest.fixture
def nats_server():
    server = NatsServer().start()
    yield server
    server.stop()
