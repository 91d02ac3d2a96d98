"""The prompts the in-process benchmarks generate from: real ShareGPT first turns, chat-templated."""

import json
import random
from pathlib import Path

from services.executor.engine.engine import LLMEngine


def sharegpt_prompts(engine: LLMEngine, path: Path, count: int, max_prompt_tokens: int, seed: int) -> list[list[int]]:
    """`count` real first turns, chat-templated and cut to `max_prompt_tokens`, in a seeded random order."""
    items = json.loads(path.read_text())
    random.Random(seed).shuffle(items)
    tok = engine.tokenizer
    prompts = []
    for item in items[:count]:
        text = item["conversations"][0]["value"]
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        prompts.append(ids[-max_prompt_tokens:])
    return prompts
