"""Two TP1 engines merged in place into one TP2 instance (AMOEBAs §3: the FFN cut first, then the KV by
head) and split back (the KV first, then the FFN refilled) generate exactly what one engine generates for
all their requests: no request is recomputed, no weight copied on the merge. The two members run in two
threads of this process, their partial sums added through a barrier where the fabric would all-reduce; the
protocol that carries this over processes is the runtime's."""

import threading

import torch

from services.executor.engine.engine import LLMEngine
from services.executor.engine.model.decoder import DecodeGroup, ForwardBatch
from services.executor.fabric.kv_heads import UnitPool, plan_merge, plan_split
from services.executor.fabric.merge import become_member, become_whole
from shared.config import EngineConfig
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama3

PROMPTS = ["The quick brown fox", "In 1990 the city of", "Hello there, how are you", "A B C D E F G H I J K"]
NEW_TOKENS = 30  # past block boundaries while merged (new blocks by head unit) and after the split
MERGED_UNTIL = 18  # output tokens when the instance splits again


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


def test_two_tp1_engines_merged_and_split_in_place_generate_what_one_engine_does(tmp_path):
    config = EngineConfig(model=str(write_tiny_llama3(tmp_path / "tiny")), memory_budget=4 << 20, block_size=8,
                          max_model_len=128, variant_cache_dir=str(tmp_path / "variants"))
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
    reports = [become_member(e.model, e.arena, e.variants, 2, rank, reduce.of(rank)) for rank, e in enumerate(engines)]
    slot_pages = engines[0].arena.slot_pages * 4
    assert all(sum(map(len, r.freed.values())) >= slot_pages * 0.2 for r in reports)  # of 4 layers' slots
    # Then the KV: every block keeps its own heads in place, sends the other member its heads.
    heads_per_page = engines[0].arena.kv_cache.shape[1]
    member_heads = [r.heads.kv for r in reports]
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

    while any(len(s.output_ids) < MERGED_UNTIL for s in seqs):
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
            s.output_ids.append(token)
            s.num_computed += 1

    # Split, KV first: every request back to the engine it came from, out of the pages the FFN takes back.
    before = [{p for s in seqs[2 * rank:2 * rank + 2] for p in s.block_table} for rank in range(2)]
    target = {b: i // 2 for i, n in enumerate(names) for b in n}
    home = {b: b for own in blocks for b in own}
    reserved = [{p for pages in r.freed.values() for p in pages} for r in reports]
    split = plan_split(heads_per_page, member_heads, plan.units, [pool.free for pool in pools], target, home,
                       reserved)
    sent = [(m, units[m.src][m.src_unit].clone()) for m in [*split.moves, *split.copies]]
    for m, data in sent:
        units[m.dst][m.dst_unit] = data
    for rank, e in enumerate(engines):
        written = become_whole(e.model, e.arena, e.variants, reports[rank])
        assert written > 0
        after = set(split.pages[rank].values())
        for page in after - before[rank]:
            e.arena.ledger.claim(page)
        for page in before[rank] - after:
            e.arena.ledger.decref(page)
    for i, s in enumerate(seqs):
        s.block_table = [split.pages[i // 2][b] for b in names[i]]
    assert len(split.moves) > 0 and all(split.pages[b[0]][b] == b[1] for b in home if b[1] not in reserved[b[0]])

    # Each engine goes on alone, with its own scheduler, from the tokens it has.
    while any(e.has_unfinished() for e in engines):
        for e in engines:
            e.step()
    assert [s.output_ids for s in seqs] == expected
    for e in engines:
        e.arena.ledger.check_consistency()
