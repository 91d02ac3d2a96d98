"""Real prompts for the trace's arrivals, cut or repeated to the exact token count each one asks for.

The traces give lengths, not text. Each arrival takes the next prompt of a seeded shuffle of the
ShareGPT first turns and the self-instruct instructions (instruction plus the instance's input); a
prompt longer than asked is cut, a shorter one is repeated, in token ids of the served model's own
tokenizer, so that the server sees exactly the trace's prompt length (the request sends the ids).
"""

import json
import random
from pathlib import Path

SHAREGPT = "ShareGPT_V3_filtered_1000.json"
SELF_INSTRUCT = "user_oriented_instructions.jsonl"


def read_texts(prompts_dir: Path) -> list[str]:
    """Every prompt text of the ShareGPT and self-instruct files in `prompts_dir`."""
    prompts_dir = Path(prompts_dir)
    texts = []
    sharegpt = prompts_dir / SHAREGPT
    if sharegpt.exists():
        for item in json.loads(sharegpt.read_text(encoding="utf-8")):
            turns = item.get("conversations") or []
            if turns and turns[0].get("value", "").strip():
                texts.append(turns[0]["value"])
    self_instruct = prompts_dir / SELF_INSTRUCT
    if self_instruct.exists():
        for line in self_instruct.read_text(encoding="utf-8").splitlines():
            if line.strip():
                item = json.loads(line)
                instance = (item.get("instances") or [{}])[0].get("input", "")
                texts.append(f"{item['instruction']}\n\n{instance}".strip())
    if not texts:
        raise FileNotFoundError(f"no prompts in {prompts_dir}: expected {SHAREGPT} and/or {SELF_INSTRUCT}")
    return texts


def fit(ids: list[int], length: int) -> list[int]:
    """`ids` cut to `length`, or repeated until it reaches `length`."""
    if not ids:
        raise ValueError("cannot fit an empty prompt")
    repeats = -(-length // len(ids))
    return (ids * repeats)[:length]


class PromptPool:
    """Hands out real prompts as token ids of an exact length, in a seeded order."""

    def __init__(self, texts: list[str], encode, seed: int = 0):
        self._texts = list(texts)
        random.Random(seed).shuffle(self._texts)
        self._encode = encode
        self._next = 0
        self._cache: dict[int, list[int]] = {}

    def take(self, length: int) -> list[int]:
        for _ in range(len(self._texts)):
            i = self._next % len(self._texts)
            self._next += 1
            if i not in self._cache:
                self._cache[i] = self._encode(self._texts[i])
            if self._cache[i]:  # a text of only whitespace or special characters encodes to nothing
                return fit(self._cache[i], length)
        raise ValueError("no prompt text encodes to any token")
