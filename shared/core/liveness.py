"""Who still lives, by their heartbeats: the rule an executor keeps its peers by (executor/peers.py) and the
gateways whose requests it runs by (executor/gateways.py), and the monitor the gateways (monitor/gateways.py). A
name is gone when it restarts (a new incarnation) or falls silent for `silence_s`; one never heard from is never
called gone, so a sender that does not beat (a test harness, a tool on the bus) loses nothing."""

from dataclasses import dataclass, field


@dataclass
class Heartbeats:
    silence_s: float
    _last: dict[str, tuple[str, float]] = field(default_factory=dict)  # name -> (incarnation, last heard)
    _looked: float | None = None  # when look() last ran

    def heard(self, name: str, incarnation: str, now: float) -> bool:
        """Note a beat; whether it is news (a new name, or a new incarnation of one: the old one is gone)."""
        before = self._last.get(name)
        self._last[name] = (incarnation, now)
        return before is None or before[0] != incarnation

    def silent(self, now: float) -> list[str]:
        """The names silent for longer than silence_s, forgotten from here on (a later beat is news again)."""
        gone = [name for name, (_, last) in self._last.items() if now - last > self.silence_s]
        for name in gone:
            del self._last[name]
        return gone

    def look(self, now: float, every_s: float, hearing: bool = True) -> list[str]:
        """silent(), for a caller that looks every `every_s`. While we cannot hear (our bus is down), or when this
        look comes late (our own process was stopped or starved, and the beats wait unread in our socket), the
        silence is ours: everyone counts as heard now."""
        late = self._looked is not None and now - self._looked > 2 * every_s
        self._looked = now
        if late or not hearing:
            self.refresh(now)
            return []
        return self.silent(now)

    def refresh(self, now: float) -> None:
        """Count everyone heard now: while we could not hear (our bus was down), silence says nothing of them."""
        self._last = {name: (incarnation, now) for name, (incarnation, _) in self._last.items()}

    def incarnation(self, name: str) -> str | None:
        heard = self._last.get(name)
        return heard[0] if heard else None

    def __contains__(self, name: str) -> bool:
        return name in self._last
