"""The engine on CUDA: transformers' tokens and logits in fp32, transformers' own rounding error in bf16, and
decode graphs that replay exactly what eager steps compute, swaps included."""

import json

import pytest
import torch

from services.executor.engine.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama3, write_tiny_qwen2
from tests.reference.test_engine_vs_hf import capture_logits

NEW_TOKENS = 24
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module", params=[write_tiny_llama3, write_tiny_qwen2], ids=["llama3", "qwen2"])
def checkpoint(request, tmp_path_factory):
    return request.param(tmp_path_factory.mktemp("ckpt") / "model")


def vocab(checkpoint) -> int:
    return json.loads((checkpoint / "config.json").read_text())["vocab_size"]


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of 3 to ~200 random tokens: one block, many, and block edges."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 16, 17, 64, 129, 200, 31, 90][:count] + [5 + 7 * i for i in range(max(0, count - 8))]
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def cuda_engine(path, dtype: str, graphs: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cuda", dtype=dtype, memory_budget=64 << 20,
                                  block_size=16, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=96,
                                  cuda_graphs=graphs), progress=False)


def reference(path, dtype: str):
    from transformers import AutoModelForCausalLM

    # loaded in its dtype from disk: casting a loaded model rounds RoPE's inv_freq too
    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to("cuda").eval()


@torch.inference_mode()
def teacher_forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """float32 logits at the positions that predicted `tokens`."""
    ids = torch.tensor([prompt + tokens[:-1]], device="cuda")
    return model(ids).logits[0, len(prompt) - 1:].float().cpu()


def generate(engine: LLMEngine, batch: list[list[int]], swaps: dict[int, tuple[list[int], int | None]] | None = None
             ) -> list[list[int]]:
    """Greedy tokens of `batch` run together; `swaps`: at step k, set layers to bits (None: restore them)."""
    params = SamplingOptions(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(str(i), p, params)
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished():
        if swaps and step in swaps:
            layers, bits = swaps[step]
            engine.swapper.restore(layers) if bits is None else engine.swapper.set_bits(layers, bits)
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
        step += 1
    return [tokens[str(i)] for i in range(len(batch))]


def replays(engine: LLMEngine) -> list[int]:
    """The batch sizes of the steps that replay graphs, from now on."""
    seen: list[int] = []
    run = engine.runner.graphs.run
    engine.runner.graphs.run = lambda decodes: seen.append(len(decodes)) or run(decodes)
    return seen


def test_float32_gives_transformers_tokens_and_logits(checkpoint):
    engine, hf = cuda_engine(checkpoint, "float32"), reference(checkpoint, "float32")
    seen = capture_logits(engine)
    batch = prompts(8, vocab(checkpoint))
    for i, (prompt, ours) in enumerate(zip(batch, generate(engine, batch))):
        theirs = teacher_forced(hf, prompt, ours)
        assert theirs.argmax(-1).tolist() == ours, f"prompt of {len(prompt)} tokens"
        for j in range(NEW_TOKENS):
            mine = seen[str(i), len(prompt) - 1 + j].cpu()
            assert (mine - theirs[j]).norm() / theirs[j].norm() <= 1e-4


def test_bfloat16_logits_err_as_transformers_own_do(checkpoint):
    # Against float32 transformers, our bf16 logits are off by what bf16 transformers' are off.
    engine = cuda_engine(checkpoint, "bfloat16")
    exact, rounded = reference(checkpoint, "float32"), reference(checkpoint, "bfloat16")
    seen = capture_logits(engine)
    batch = prompts(8, vocab(checkpoint), seed=1)
    ours_err, theirs_err = [], []
    for i, (prompt, ours) in enumerate(zip(batch, generate(engine, batch))):
        truth, theirs = teacher_forced(exact, prompt, ours), teacher_forced(rounded, prompt, ours)
        mine = torch.stack([seen[str(i), len(prompt) - 1 + j].cpu() for j in range(NEW_TOKENS)])
        ours_err.append(((mine - truth).norm(dim=-1) / truth.norm(dim=-1)).mean())
        theirs_err.append(((theirs - truth).norm(dim=-1) / truth.norm(dim=-1)).mean())
    ours_mean, theirs_mean = torch.stack(ours_err).mean(), torch.stack(theirs_err).mean()
    assert ours_mean <= 1.5 * theirs_mean + 1e-3, f"ours {ours_mean:.2e} vs transformers' {theirs_mean:.2e}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("count", [1, 4, 8])
def test_graph_replay_gives_the_eager_tokens(checkpoint, dtype, count):
    # Batches of a bucket's size: the padded rows of a smaller batch may change which GEMM cuBLAS picks, and
    # with it the last bits; a full bucket computes the very same kernels on the very same shapes.
    batch = prompts(count, vocab(checkpoint), seed=2)
    expected = generate(cuda_engine(checkpoint, dtype, graphs=False), batch)
    engine = cuda_engine(checkpoint, dtype)
    seen = replays(engine)
    assert generate(engine, batch) == expected
    assert count in seen


def test_a_padded_batch_replays_a_larger_bucket_with_the_eager_tokens(checkpoint):
    batch = prompts(3, vocab(checkpoint), seed=3)
    expected = generate(cuda_engine(checkpoint, "float32", graphs=False), batch)
    engine = cuda_engine(checkpoint, "float32")
    seen = replays(engine)
    assert generate(engine, batch) == expected
    assert 3 in seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_swaps_under_graphs_select_the_layers_variant_graphs(checkpoint, dtype):
    swaps = {4: ([1], 8), 6: ([2, 3], 4), 14: ([1, 2, 3], None)}
    batch = prompts(4, vocab(checkpoint), seed=4)
    expected = generate(cuda_engine(checkpoint, dtype, graphs=False), batch, swaps)
    engine = cuda_engine(checkpoint, dtype)
    seen = replays(engine)
    got = generate(engine, batch, swaps)
    assert got == expected
    assert len(seen) >= NEW_TOKENS // 2  # decode steps replayed, those next to a swap too
    assert got != generate(cuda_engine(checkpoint, dtype, graphs=False), batch)  # the swaps changed the output


def test_every_kernel_is_tuned_at_start_not_after_a_swap(checkpoint, tmp_path, monkeypatch):
    # A kernel first met while serving would compile and be timed on the critical path: the stall issue 15 saw
    # (652 ms) after an INT4 swap. Start from an empty tuning cache and watch what serving adds.
    from morphling_kernels import tuning

    monkeypatch.setenv("MORPHLING_TUNING_CACHE", str(tmp_path))
    monkeypatch.setattr(tuning, "_chosen", {})
    monkeypatch.setattr(tuning, "_loaded", set())
    monkeypatch.setattr(tuning, "_saved", {})
    engine = cuda_engine(checkpoint, "bfloat16")
    tuned = set(tuning._chosen)
    assert tuned  # the low-bit linears were tuned while the engine started
    swaps = {2: ([0, 1], 4), 5: ([2], 8), 9: ([0], None)}
    generate(engine, prompts(5, vocab(checkpoint), seed=5), swaps)
    assert set(tuning._chosen) == tuned
