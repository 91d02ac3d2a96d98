"""`docker compose up` on this machine, images and all: `make test-compose` runs it (MORPHLING_COMPOSE_TESTS=1),
since building the images takes minutes; everywhere else it is skipped."""

import os

import pytest

HERE = os.path.dirname(__file__)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MORPHLING_COMPOSE_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="builds Docker images for minutes: run it with `make test-compose`")
    for item in items:
        if str(item.fspath).startswith(HERE):
            item.add_marker(skip)
