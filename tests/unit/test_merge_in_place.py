"""Two TP1 engines merged in place into one TP2 instance (AMOEBAs §3: the FFN cut first, then the KV by
head) go on generating exactly what one engine generates for all their requests: no request is recomputed,
no weight copied. The two members run in two threads of this process, their partial sums added through a
barrier where the fabric would all-reduce; the protocol that carries this over processes is the runtime's."""

import threading

import torch

from services.executor.engine.engine import LLMEngine
from services.executor.engine.model.decoder import DecodeGroup, ForwardBatch
from services.executor.fabric.kv_heads import UnitPool, plan_merge
from services.executor.fabric.merge import become_member
from shared.config import EngineConfig
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama3

PROMPTS = ["The quick brown fox", "In 1990 the city of", "Hello there, how are you", "A B C D E F G H I J K"]
NEW_TOKENS = 24  # past a block boundary after the merge: new blocks are placed by head unit too


class BarrierSum:
    """all_reduce(SUM) of two threads, in one order for both."""

    def __init__(self):
        self.parts: list[torch.Tensor | None] = [None, None]
        self.barrier = threading.Barrier(2, timeout=60)

    def of(self, rank: int):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t
            self.barrier.wait()
            total = self.parts[0] + self.parts[1]
            self.barrier.wait()
            return total
        return reduce


def test_two_tp1_engines_merged_in_place_generate_what_one_engine_does(tmp_path):
    config = EngineConfig(model=str(write_tiny_llama3(tmp_path / "tiny")), memory_budget=4 << 20, block_size=8,
                          max_model_len=128, prepare_variants=False)
    params = SamplingOptions(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = [c.outputs[0].token_ids for c in LLMEngine(config, progress=False).generate(PROMPTS, params)]

    engines = [LLMEngine(config, progress=False) for _ in range(2)]
    for i, prompt in enumerate(PROMPTS):
        engines[i // 2].add_request(f"r{i}", prompt, params)
    for _ in range(3):
        for e in engines:
            e.step()
    seqs = [seq for e in engines for rid in sorted(e._requests) for seq in e._requests[rid]]
    assert all(s.num_uncomputed == 1 and 0 < len(s.output_ids) < NEW_TOKENS for s in seqs)

    # FFN first: each member keeps half the pieces of every layer, and the pages the rest filled are KV pages.
    reduce = BarrierSum()
    reports = [become_member(e.model, e.arena, 2, rank, reduce.of(rank)) for rank, e in enumerate(engines)]
    slot_pages = engines[0].arena.slot_pages * 4
    assert all(sum(map(len, r["freed"].values())) >= slot_pages * 0.2 for r in reports)  # of 4 layers' slots
    # Then the KV: every block keeps its own heads in place, sends the other member its heads.
    heads_per_page = engines[0].arena.kv_cache.shape[1]
    member_heads = [r["heads"].kv for r in reports]
    blocks = [{(rank, page): page for s in seqs[2 * rank:2 * rank + 2] for page in s.block_table}
              for rank in range(2)]
    plan = plan_merge(heads_per_page, member_heads, blocks, [e.arena.ledger.free_pages() for e in engines])
    units = [e.arena.kv_cache.view(-1, *e.arena.kv_cache.shape[2:]) for e in engines]
    sent = [(m, units[m.src][m.src_unit].clone()) for m in plan.moves]
    for m, data in sent:
        units[m.dst][m.dst_unit] = data
    names = [[(i // 2, page) for page in s.block_table] for i, s in enumerate(seqs)]
    pools = [UnitPool(heads_per_page, set(free)) for free in plan.free_units]

    def batch_of(rank: int) -> ForwardBatch:
        bs, local = config.block_size, len(member_heads[rank])
        for i, s in enumerate(seqs):  # a block for the position about to be written, where it crosses one
            if s.num_computed // bs == len(names[i]):
                block = ("new", i, len(names[i]))
                for r in range(2):
                    plan.units[r][block] = tuple(pools[r].take(len(member_heads[r])))
                names[i].append(block)
        width = max(len(n) for n in names)
        tables = torch.tensor([[plan.units[rank][b] for b in n + n[:1] * (width - len(n))] for n in names])
        pos = torch.tensor([s.num_computed for s in seqs])
        slots = tables[torch.arange(len(seqs)), pos // bs] * bs + (pos % bs).unsqueeze(-1)
        assert tables.shape == (len(seqs), width, local)
        return ForwardBatch(input_ids=torch.tensor([s.token_at(s.num_computed) for s in seqs]), positions=pos,
                            slot_mapping=slots, decodes=[DecodeGroup(0, len(seqs), tables.int(), (pos + 1).int())],
                            prefills=[], logits_rows=torch.arange(len(seqs)))

    while any(len(s.output_ids) < NEW_TOKENS for s in seqs):
        batches = [batch_of(rank) for rank in range(2)]
        logits: list[torch.Tensor | None] = [None, None]

        def run(rank: int) -> None:
            logits[rank] = engines[rank].model.forward(batches[rank])

        threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert torch.equal(logits[0], logits[1])  # both members end each step with the same hidden states
        for s, token in zip(seqs, logits[0].argmax(-1).tolist()):
            if len(s.output_ids) < NEW_TOKENS:
                s.output_ids.append(token)
            s.num_computed += 1
    assert [s.output_ids for s in seqs] == expected
