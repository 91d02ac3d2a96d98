"""The device benchmark (`bench-engine --device/--shape`, gpu.py) on CPU, and the shapes it writes.

The benchmark's report is read by people comparing against targets, so the test checks what they read:
step times, the transformers comparison, a roofline fraction that can be believed, the kernels marked as
skipped off CUDA, and swap times. The checkpoint writer is held to the project's oracle: transformers and our
engine load what it writes and produce the same greedy tokens.
"""

import json

import pytest
import torch

from services.executor.engine.engine import LLMEngine
from services.executor.engine.model.tokenizer import Tokenizer
from services.tools import shapes
from services.tools.microbench.engine import main as bench_engine
from services.tools.microbench.gpu import RESULT_FILE
from shared.config import EngineConfig
from tests.reference.test_engine_vs_hf import NEW_TOKENS, greedy_check

transformers = pytest.importorskip("transformers")


def test_bench_on_cpu_reports_decode_roofline_kernels_and_swaps(tmp_path):
    out = tmp_path / "out"
    bench_engine(["--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--batches", "1,2", "--new-tokens", "6",
                  "--prompt-tokens", "16", "--cache-dir", str(tmp_path / "shapes"), "--out", str(out)])
    report = json.loads((out / RESULT_FILE).read_text())

    assert report["config"] | {"device": "cpu", "dtype": "float32", "batches": [1, 2]} == report["config"]
    assert report["checkpoint"]["cached"] is False and (tmp_path / "shapes" / "tiny-float32" / shapes.MARKER).is_file()
    copy = report["copy_bandwidth"]
    assert copy["gbs"] > 0 and "read plus the bytes written" in copy["convention"]

    rows = report["decode"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["ours_decode_steps"] == 6 - 1  # every token after the prefill's first
        assert r["ours_step_ms"] > 0 and r["transformers_step_ms"] > 0 and r["speedup"] > 0
        assert r["ours_eager_step_ms"] is None and r["graph_speedup"] is None  # no CUDA graphs on a CPU
        assert r["ours_decode_tok_s"] > 0 and r["transformers_decode_tok_s"] > 0
        # Reading the bytes can be no faster than copying them; Python overhead makes a tiny model far slower.
        assert 0 < r["roofline_fraction"] <= 1.5 and 0 < r["transformers_roofline_fraction"] <= 1.5
        assert r["read_bytes"] > report["model"]["decoder_bytes"]
    assert (out / "engine_gpu_decode.png").stat().st_size > 0

    assert report["kernels"] == {"skipped": "no CUDA"}

    swap = report["swap"]
    assert [s["to_bits"] for s in swap["idle"]] == [4, 32, 8, 32]
    assert all(s["complete_ms"] > 0 and s["bytes"] > 0 for s in swap["idle"])
    during = swap["during_decode"]
    assert [s["to_bits"] for s in during["swaps"]] == [4, 32, 8, 32] and during["batch"] == 1
    for s in during["swaps"]:
        assert s["overlapping_step_ms"] > 0 and s["baseline_step_ms"] > 0 and s["swap_call_ms"] > 0
        assert isinstance(s["compile_stall"], bool)


def test_device_without_shape_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_engine(["--device", "cuda"])
    assert exc.value.code == 2 and "--device needs --shape" in capsys.readouterr().err


def test_written_shape_loads_in_transformers_and_our_engine_with_the_same_greedy_tokens(tmp_path):
    # Small shards, so that the index both loaders follow is exercised too.
    path = shapes.ensure_checkpoint("tiny", "float32", tmp_path, progress=False, max_shard_bytes=2 << 20)
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 1

    ours_tok, hf_tok = Tokenizer.load(str(path)), transformers.AutoTokenizer.from_pretrained(path)
    text = "The tower is 324 metres tall, about the same height as an 81-storey building. 日本"
    assert ours_tok.encode(text) == hf_tok.encode(text) and ours_tok.decode(ours_tok.encode(text)) == text
    chat = [{"role": "user", "content": "hi"}]
    assert ours_tok.apply_chat_template(chat) == hf_tok.apply_chat_template(chat, tokenize=False,
                                                                            add_generation_prompt=True)

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=str(path), max_num_batched_tokens=48, max_model_len=256,
                                    memory_budget=8 << 20), progress=False)
    assert engine.model_config.vocab_size == shapes.SHAPES["tiny"].vocab_size == ours_tok.vocab_size
    gen = torch.Generator().manual_seed(0)
    regular = shapes.SHAPES["tiny"].vocab_size - shapes.NUM_SPECIAL
    prompts = [torch.randint(0, regular, (n,), generator=gen).tolist() for n in (1, 7, 16, 17, 40, 100)]
    assert max(map(len, prompts)) + NEW_TOKENS <= 256
    greedy_check(engine, hf_model, prompts, generate_count=2)


def test_an_interrupted_write_is_redone_and_a_complete_one_kept(tmp_path):
    path = shapes.ensure_checkpoint("tiny", "float32", tmp_path, progress=False)
    (path / shapes.MARKER).unlink()  # as if the process died before the marker
    (path / "model.safetensors").write_bytes(b"truncated")
    assert shapes.cached_checkpoint("tiny", "float32", tmp_path) is None
    again = shapes.ensure_checkpoint("tiny", "float32", tmp_path, progress=False)
    assert again == path and shapes.cached_checkpoint("tiny", "float32", tmp_path) == path
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    shapes.ensure_checkpoint("tiny", "float32", tmp_path, progress=False)
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert shapes.ensure_checkpoint(str(path), "float32") == path  # a directory is a shape too
    with pytest.raises(shapes.ShapeError, match="neither a named shape"):
        shapes.ensure_checkpoint(str(tmp_path / "nothing"), "float32")


def test_the_eager_comparison_sets_the_graphs_aside_and_puts_them_back(tmp_path):
    from services.executor.engine.graphs import DecodeGraphs
    from services.tools.microbench.gpu import run_eager
    from services.tools.microbench.timing import Clock

    path = shapes.ensure_checkpoint("tiny", "float32", tmp_path, progress=False)
    engine = LLMEngine(EngineConfig(model=str(path), max_model_len=128, memory_budget=8 << 20), progress=False)
    assert run_eager(engine, [[5, 6, 7]], 4, Clock(torch.device("cpu")), "e") is None  # no graphs: nothing to compare
    graphs = engine.runner.graphs = DecodeGraphs(engine.model, engine.config.block_size, 128, 4, (8, 4), capture=False)
    replayed = []
    run = graphs.run
    graphs.run = lambda decodes: replayed.append(len(decodes)) or run(decodes)
    eager = run_eager(engine, [[5, 6, 7], [8, 9]], 4, Clock(torch.device("cpu")), "e")
    assert len(eager["steps"]) == 3 and not replayed and engine.runner.graphs is graphs
