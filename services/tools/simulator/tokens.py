"""A simulated sequence's tokens: every one is token 0, so a count stands for the list.

The engine's scheduler, block manager and growth rule read a sequence's tokens only by how many there are, and
the simulator writes them only by appending. A thousand executors hold a quarter of a million sequences at
saturation, whose prompts of a thousand ids each had been gigabytes, and whose outputs grew list by list.
"""

from collections.abc import Sized


class CountedTokens:
    """The list of `count` zeros, as much of it as the simulator and the engine's scheduling read."""

    __slots__ = ("count",)

    def __init__(self, count: int = 0):
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __iadd__(self, tokens: Sized) -> "CountedTokens":
        self.count += len(tokens)
        return self

    def append(self, token: int) -> None:
        self.count += 1

    def __repr__(self) -> str:
        return f"CountedTokens({self.count})"
