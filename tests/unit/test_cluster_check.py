"""An executor alone in a world of several starts with less KV than one sequence of max_model_len takes, when
a TP merge of the world's executors holds it (AMOEBAs); it refuses with the numbers when none does. A request
longer than the instance holds is refused as kv_capacity (the gateway merges for it), never admitted to hang."""

import pytest

from services.executor.engine.engine import LLMEngine
from services.executor.process import cluster_check
from shared.config import EngineConfig
from shared.core.errors import KvCapacityError, MemoryBudgetError
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama3

PAGE = 8192  # the tiny model's page at block size 8: 92 of them hold its layers' slots


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_llama3(tmp_path_factory.mktemp("tiny")))


def engine(model: str, max_model_len: int, min_kv_tokens: int | None = 8) -> LLMEngine:
    # 100 pages: 8 KV pages alone (64 tokens); a TP2 cut frees 24 more a member, 2 KV heads: 64 blocks merged.
    return LLMEngine(EngineConfig(model=model, memory_budget=100 * PAGE, block_size=8, max_model_len=max_model_len,
                                  min_kv_tokens=min_kv_tokens), progress=False)


def test_an_executor_starts_when_a_merge_of_its_world_holds_the_longest_sequence(tiny):
    with pytest.raises(MemoryBudgetError, match="one sequence of 128 tokens needs 16 more"):
        engine(tiny, 128, min_kv_tokens=None)  # outside a world, it must hold one alone
    e = engine(tiny, 128)
    cluster_check(e, world_size=2)
    with pytest.raises(MemoryBudgetError, match=r"needs 16 KV blocks, but an instance of this world's executors "
                                                r"holds at most 8 at TP1"):
        cluster_check(e, world_size=1)
    with pytest.raises(MemoryBudgetError, match=r"needs 128 KV blocks.*8 at TP1, 64 at TP2: raise"):
        cluster_check(engine(tiny, 1025), world_size=2)


def test_a_request_longer_than_the_instance_holds_is_refused_as_kv_capacity(tiny):
    e = engine(tiny, 128)
    params = SamplingOptions(temperature=0.0, max_tokens=40, ignore_eos=True)
    with pytest.raises(KvCapacityError) as err:
        e.add_request("long", list(range(1, 41)), params)  # 79 KV tokens: 10 blocks, 8 held
    assert (err.value.prompt_tokens, err.value.blocks, err.value.capacity) == (40, 10, 8)
    with pytest.raises(KvCapacityError):  # without max_tokens it may grow to max_model_len
        e.add_request("open", [1, 2, 3], SamplingOptions(temperature=0.0, max_tokens=None))
    e.add_request("fits", list(range(1, 25)), params)  # 63 KV tokens: 8 blocks
    assert not e.has_request("long") and e.has_request("fits")
