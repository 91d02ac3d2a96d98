"""What the running sequences will still take of the KV cache: the telemetry's `pages_growth`, which the
controller's quantize and CoCoServe rungs read as memory that is as good as used (policies/morph.py,
cocoserve.py). Here, beside the block tables it reads, so that the executor and the simulator count alike."""

from collections.abc import Iterable

from shared.core.memory.block_manager import BlockManager
from shared.core.scheduling.sequence import Sequence


def kv_tokens_at_end(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """Tokens whose KV a sequence holds once it ends at `max_tokens` (None: it may grow to max_model_len): all of them
    but the last, which is sampled and never written to the cache."""
    return min(prompt_tokens + (max_model_len if max_tokens is None else max_tokens), max_model_len) - 1


def blocks_at_end(prompt_tokens: int, max_tokens: int | None, max_model_len: int, block_size: int) -> int:
    """KV blocks a sequence holds once it ends. The engine admits by it, and so does the simulator."""
    return -(-kv_tokens_at_end(prompt_tokens, max_tokens, max_model_len) // block_size)


def pages_growth(running: Iterable[Sequence], blocks: BlockManager, max_model_len: int) -> int:
    """KV pages the running sequences still take before they end at their max_tokens (or max_model_len).

    A sequence's last token is sampled but never written to the cache, so it ends holding the KV of all
    its tokens but one. One still to fork into n (its prompt not all computed) becomes n sequences sharing
    the prompt's pages, each then taking its own pages past the prompt. Sequences writing next into a
    shared, partly filled block copy it first (copy on write), all but the last of them: one page each.
    """
    size = blocks.block_size
    growth = 0
    shared: dict[int, int] = {}  # page -> holders, for shared partly filled blocks the next write goes into
    for seq in running:
        prompt = len(seq.prompt_ids)
        kv_end = kv_tokens_at_end(prompt, seq.params.max_tokens or None, max_model_len)
        end_blocks = -(-kv_end // size)
        if seq.fork_into > 1:
            prompt_blocks = -(-prompt // size)
            growth += max(0, prompt_blocks - len(seq.block_table))
            growth += seq.fork_into * max(0, end_blocks - prompt_blocks)
            if kv_end > prompt and prompt % size:
                growth += seq.fork_into - 1
            continue
        growth += max(0, end_blocks - len(seq.block_table))
        write_block = seq.num_computed // size
        if seq.num_computed % size and write_block < len(seq.block_table) and kv_end > seq.num_computed:
            page = seq.block_table[write_block]
            if (holders := blocks.ledger.refcount(page)) > 1:
                shared[page] = holders
    return growth + sum(holders - 1 for holders in shared.values())
