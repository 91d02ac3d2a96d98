"""The oracle: Hugging Face transformers on the same weights must produce our greedy tokens and logits.

Our engine runs all prompts as one continuous batch (chunked prefill mixed with decodes, a small token
budget so that chunks and decodes share steps); transformers runs each prompt alone, unpadded.
"""

import json

import pytest
import torch

from services.executor.engine.engine import LLMEngine
from services.executor.engine.model.loader import default_model_path
from shared.config import EngineConfig, data_dir
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama3, write_tiny_qwen2

NEW_TOKENS = 64


def varied_prompts(engine: LLMEngine) -> list[list[int]]:
    """24 prompts from 1 to a few hundred tokens: raw ShareGPT text, chat-templated instructions, oddities."""
    tok = engine.tokenizer
    share = json.loads((data_dir() / "prompts" / "ShareGPT_V3_filtered_1000.json").read_text())
    texts = [c["conversations"][0]["value"] for c in share]
    raw = [tok.encode(t)[:n] for t, n in zip(texts[:12], [5, 17, 33, 64, 100, 150, 210, 260, 300, 48, 9, 128])]
    instructions = [json.loads(line) for line in (data_dir() / "prompts" / "user_oriented_instructions.jsonl")
                    .read_text().splitlines()[:8]]
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": d["instruction"]}]))
             for d in instructions]
    odd = [tok.encode(t) for t in ["Hello", "1 2 3 4 5 6 7 8 9", "日本の首都は", "def fib(n):\n    "]]
    return raw + chats + odd


def capture_logits(engine: LLMEngine) -> dict[tuple[str, int], torch.Tensor]:
    """Record the logits each sequence was sampled from, keyed by (request id, position)."""
    seen: dict[tuple[str, int], torch.Tensor] = {}
    run = engine.runner.run

    def recording_run(out):
        logits, sampled = run(out)
        for row, chunk in enumerate(sampled):
            seen[(chunk.seq.request_id, chunk.start + chunk.length - 1)] = logits[row].clone()
        return logits, sampled

    engine.runner.run = recording_run
    return seen


def greedy_check(engine: LLMEngine, hf_model, prompts: list[list[int]], generate_count: int = 4) -> None:
    """Our greedy tokens are transformers' argmax at every position, and our logits are its logits.

    Teacher forcing (one forward over prompt + our tokens) checks every position of every prompt in one
    pass. `generate_count` prompts also go through transformers' own `generate`, among those whose output
    holds no EOS: we ignore EOS by sampling it and going on, while `min_new_tokens` masks it instead.
    """
    seen = capture_logits(engine)
    params = SamplingOptions(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    completions = engine.generate(prompts, params)
    assert engine.stats().ledger.pages_kv_used == 0
    generated = 0
    for prompt, completion in zip(prompts, completions):
        ours = completion.outputs[0].token_ids
        assert len(ours) == NEW_TOKENS
        with torch.inference_mode():
            hf_logits = hf_model(torch.tensor([prompt + ours[:-1]])).logits[0].float()
        first = len(prompt) - 1
        assert hf_logits[first:].argmax(-1).tolist() == ours, f"prompt of {len(prompt)} tokens"
        for pos in range(first, first + NEW_TOKENS):
            mine = seen[(completion.request_id, pos)]
            rel = (mine - hf_logits[pos]).norm() / hf_logits[pos].norm()
            assert rel <= 1e-4, f"prompt of {len(prompt)} tokens, position {pos}: relative error {rel:.2e}"
        if generated < generate_count and not set(ours) & set(engine.eos_token_ids):
            generated += 1
            with torch.inference_mode():
                ref = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            assert ref[0, len(prompt):].tolist() == ours, f"generate differs for a prompt of {len(prompt)} tokens"
    assert generated == min(generate_count, len(prompts))


@pytest.fixture(scope="module")
def hf_default():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    directory, name = path.rsplit("/", 1)
    return transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()


def test_default_model_matches_transformers_in_a_continuous_batch(hf_default):
    engine = LLMEngine(EngineConfig(max_num_batched_tokens=96, max_num_seqs=16, max_model_len=1024,
                                    memory_budget=1 << 30), progress=False)
    prompts = varied_prompts(engine)
    assert len(prompts) >= 20 and len({len(p) for p in prompts}) >= 15
    greedy_check(engine, hf_default, prompts)


def test_preemption_by_recompute_keeps_greedy_output(hf_default):
    """A budget with room for few sequences forces preemptions; the recomputed ones still match."""
    cfg = EngineConfig(max_num_batched_tokens=128, max_num_seqs=8, max_model_len=512,
                       memory_budget=(600 + 40) * 737280)
    engine = LLMEngine(cfg, progress=False)
    prompts = varied_prompts(engine)[:10]
    greedy_check(engine, hf_default, prompts, generate_count=1)
    assert engine.stats().preemptions > 0


@pytest.mark.parametrize("writer", [write_tiny_llama3, write_tiny_qwen2], ids=["llama3", "qwen2"])
def test_tiny_hf_checkpoints_match_transformers(tmp_path, writer):
    transformers = pytest.importorskip("transformers")
    directory = writer(tmp_path / "model")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=str(directory), max_num_batched_tokens=48, max_model_len=512,
                                    memory_budget=8 << 20, block_size=8), progress=False)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 5, 8, 9, 30, 64, 100, 17)]
    prompts.append(engine.tokenizer.encode("The tower is 324 metres tall , about the same height as"))
    greedy_check(engine, hf_model, prompts)
