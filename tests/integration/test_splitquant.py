"""SplitQuant end to end on this CPU: `morphling plan` for two executors with unequal memory (the shipped latency
profile, measured on this machine, and the default model's variance indicator), served by `morphling up --plan`
just as the planner wrote it, answers the official `openai` client over real HTTP with the greedy text of one
engine holding the same per-layer bits."""

import json

import httpx
import openai
import torch

from services.executor.engine.engine import LLMEngine
from services.tools.plan.run import main as plan_main
from services.up import cpu_cores
from shared.config import RESULTS_DIR, EngineConfig, parse_size
from shared.sampling import SamplingOptions
from tests.integration.test_fabric import STOP_TIMEOUT_S, serve

MODEL = "SmolLM2-135M-Instruct"
LATENCY_PROFILE = RESULTS_DIR / "latency_profile.json"
# Each member keeps pages for the batch's KV (16 sequences of 512 tokens, 360 MiB): beside it the two cannot
# hold all 30 layers at full precision (14 MiB each), so the plan has to quantize some, and more where less fits.
DEVICES = "cpu:480MiB,cpu:650MiB"
WORKLOAD = "batch=16,prompt=448,output=64"
PROMPTS = ["The history of the city begins", "Once upon a time, a lighthouse keeper", "The recipe calls for",
           "Scientists have long argued that"]
TOKENS = 16


def one_engine(bits: list[int]) -> list[str]:
    """The greedy texts of one engine whose layers are at `bits`, quantized by its own swapper."""
    engine = LLMEngine(EngineConfig(model="default", memory_budget=parse_size("1GiB"), max_model_len=512),
                       progress=False)
    for width in (8, 4):
        layers = [i for i, b in enumerate(bits) if b == width]
        if layers:
            engine.swapper.set_bits(layers, width)
    params = SamplingOptions(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    # One prompt at a time on one thread, as the test's client sends them and as each of `up`'s two executors runs
    # (cores / 2): on CPU an INT8 layer of up to 8 rows runs torch's packed kernel in bfloat16 (w8a16.py),
    # whose rounding depends on the rows batched together and on how the threads split the sums.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, cpu_cores() // 2))
    try:
        return [engine.generate([prompt], params)[0].outputs[0].text for prompt in PROMPTS]
    finally:
        torch.set_num_threads(threads)


def test_a_plan_for_unequal_executors_is_served_as_planned_and_generates_what_one_engine_does(tmp_path):
    plan_file = tmp_path / "plan.json"
    assert plan_main(["--devices", DEVICES, "--model", "default", "--workload", WORKLOAD,
                      "--profile", str(LATENCY_PROFILE), "--out", str(plan_file)]) == 0
    record = json.loads(plan_file.read_text())
    [layers] = [instance["layers"] for instance in record["instances"]]
    bits = [layer["bits"] for layer in layers]
    memory = {d["executor"]: d["memory"] for d in record["devices"]}
    assert sorted(memory.values()) == [parse_size("480MiB"), parse_size("650MiB")]
    assert min(bits) < 16
    assert {layer["placement"][0] for layer in layers} == {"exec0", "exec1"}
    assert all(used <= memory[d["executor"]] for used, d in zip(record["predicted"]["memory_bytes"],
                                                                 record["devices"]))
    expected = one_engine(bits)

    up = serve(tmp_path / "up", "default", (), "--plan", str(plan_file))  # executors, budgets, context: the plan's
    try:
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused")
        got = [client.completions.create(model=MODEL, prompt=p, max_tokens=TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
        cluster = httpx.get(f"{up.url}/v1/cluster", timeout=10).json()
    finally:
        up.interrupt(STOP_TIMEOUT_S)
    assert got == expected
    [served] = cluster["instances"]
    assert served["slots"] == "placed" and [layer["bits"] for layer in served["layers"]] == bits
    assert [layer["placement"] for layer in served["layers"]] == [layer["placement"] for layer in layers]
    # Each executor's arena is the memory the plan gave its device: the larger one has more pages.
    pages = {e["id"]: e["kv"]["pages_total"] for e in cluster["executors"]}
    larger = max(memory, key=memory.get)
    assert pages[larger] == max(pages.values()) and len(set(pages.values())) == 2
