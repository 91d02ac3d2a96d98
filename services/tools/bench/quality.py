"""The quality side of a run: perplexity at the precision mixes its tokens were generated at, read
from the table `morphling eval ppl --table` writes (docs/results/perplexity.json by default).

The table measures K layers all at INT8 or all at INT4, for K in (0, 4, 8, 16, all) by default, in a given
swap order. A mix the table holds is read as is; a K between two measured ones is interpolated
linearly; a mix of both widths — the controller's ladder puts the first b layers of its order at INT4
and the next a at INT8 — is estimated as ppl_int4(b) plus what the INT8 layers add on top,
ppl_int8(a + b) - ppl_int8(b). Each value says which of the three it is.
"""

import json
from pathlib import Path

from shared.config import RESULTS_DIR

DEFAULT_TABLE = RESULTS_DIR / "perplexity.json"


class PerplexityTable:
    def __init__(self, rows: list[dict], order: str, model: str, source: str):
        self.model, self.order, self.source = model, order, source
        self._curves: dict[int, dict[int, float]] = {}
        every = max((r["k"] for r in rows), default=0)
        for row in rows:
            # none and every layer quantized are the same whatever the order
            if row["order"] == order or row["k"] in (0, every):
                self._curves.setdefault(row["bits"], {})[row["k"]] = row["ppl"]

    @classmethod
    def load(cls, path: Path, order: str = "front") -> "PerplexityTable | None":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return None
        return cls(data.get("rows", []), order, data.get("model", "default"), str(path))

    def _at(self, bits: int, k: int) -> tuple[float, bool] | None:
        """(ppl, measured) for k layers at `bits`, interpolating between measured K."""
        curve = self._curves.get(bits, {})
        if k in curve:
            return curve[k], True
        below = [x for x in curve if x < k]
        above = [x for x in curve if x > k]
        if not below or not above:
            return None
        lo, hi = max(below), min(above)
        return curve[lo] + (curve[hi] - curve[lo]) * (k - lo) / (hi - lo), False

    def ppl(self, int8_layers: int, int4_layers: int) -> tuple[float | None, str]:
        """Perplexity at a mix, and how it was obtained: table, interpolated, estimated or unknown."""
        if int8_layers == 0 and int4_layers == 0:
            at = self._at(8, 0) or self._at(4, 0)
            return (at[0], "table") if at else (None, "unknown")
        if int4_layers == 0 or int8_layers == 0:
            bits, k = (8, int8_layers) if int4_layers == 0 else (4, int4_layers)
            at = self._at(bits, k)
            return (at[0], "table" if at[1] else "interpolated") if at else (None, "unknown")
        int4, both, int4_only = self._at(4, int4_layers), self._at(8, int8_layers + int4_layers), \
            self._at(8, int4_layers)
        if not (int4 and both and int4_only):
            return None, "unknown"
        return int4[0] + both[0] - int4_only[0], "estimated"


def quality(share: dict[tuple[int, int], float], table: "PerplexityTable | None", model: str) -> dict:
    """The results.json `precision` entry: one row per mix, and the token-weighted perplexity."""
    usable = table is not None and table.model == model
    rows = []
    for (int8, int4), fraction in share.items():
        ppl, how = table.ppl(int8, int4) if usable else (None, "unknown")
        rows.append({"int8_layers": int8, "int4_layers": int4, "quantized_layers": int8 + int4,
                     "token_share": fraction, "ppl": ppl, "ppl_source": how})
    weighted = (sum(r["token_share"] * r["ppl"] for r in rows) if rows and all(r["ppl"] is not None for r in rows)
                else None)
    return {"mixes": rows,
            # None where no sample said at what bits a token was served (a peer server without /v1/cluster)
            "full_precision_token_share": share.get((0, 0), 0.0) if share else None,
            "ppl_token_weighted": weighted,
            "ppl_table": table.source if usable else None,
            "ppl_order": table.order if usable else None}
