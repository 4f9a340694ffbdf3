"""Host side of a step: the scheduled sequence chunks -> one padded Batch of numpy arrays.

Pure numpy, no device work: the runner pads to a compiled bucket and hands the arrays to jit.
A step mixes decode rows (sequences with one token this step, listed first) and prefill chunks
in one packed token axis, over one flat list of the step's pages. Padding tokens write their K/V
into page 0, which is reserved and never holds a sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import numpy as np

from multilora.lora.batch import LoRABatchInfo
from multilora.model.llama import Batch

TRASH_PAGE = 0
PAD_SEQ = -1  # seq_idx of padding tokens: no page carries it


@dataclasses.dataclass
class SeqChunk:
    token_ids: Sequence[int]   # the tokens computed this step
    start_pos: int             # tokens of the sequence already in the cache
    block_table: Sequence[int] # the sequence's pages, enough for start_pos + len(token_ids)
    slot: int                  # adapter slot (0: base model)
    num_logits: int = 1        # its last this many tokens give logits rows (speculative drafts: 1 + drafts)

    @property
    def num_pages(self) -> int:
        return len(self.block_table)


def pages_needed(chunk: SeqChunk, page_size: int) -> int:
    return -(-(chunk.start_pos + len(chunk.token_ids)) // page_size)


def decode_first(chunks: Sequence[SeqChunk]) -> list[int]:
    """The order build_batch wants: single-token chunks first, each group in its given order."""
    return sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) > 1)


def build_batch(chunks: Sequence[SeqChunk], *, num_tokens: int, num_pages: int, num_logits: int,
                page_size: int, prepare_lora: Optional[Callable[[np.ndarray], LoRABatchInfo]] = None,
                all_logits: bool = False) -> Batch:
    """Pad the chunks (single-token ones first, see decode_first) to a (num_tokens, num_pages)
    bucket. Logits rows: each chunk's last num_logits tokens (one: its last token), in order, or
    every token with all_logits."""
    total = sum(len(c.token_ids) for c in chunks)
    if total > num_tokens:
        raise ValueError(f"{len(chunks)} sequences / {total} tokens exceed the bucket's {num_tokens} tokens")
    rows = sum(c.num_logits for c in chunks)
    if rows > num_logits and not all_logits:
        raise ValueError(f"{len(chunks)} sequences' {rows} logits rows exceed the bucket's {num_logits}")
    lens = [len(c.token_ids) for c in chunks]
    if any(n < 1 for n in lens) or any(not 1 <= c.num_logits <= n for c, n in zip(chunks, lens)):
        raise ValueError("every chunk computes at least one token, and 1 to all of its tokens give logits")
    num_decode = next((i for i, n in enumerate(lens) if n > 1), len(lens))
    if any(n == 1 for n in lens[num_decode:]):
        raise ValueError("single-token chunks must come first (see decode_first)")
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    seq_idx = np.full(num_tokens, PAD_SEQ, np.int32)
    slot_mapping = np.zeros(num_tokens, np.int32)  # TRASH_PAGE, offset 0
    slot_T = np.zeros(num_tokens, np.int32)
    kv_pages = np.full(num_pages, TRASH_PAGE, np.int32)
    kv_page_seq = np.full(num_pages, num_tokens, np.int32)
    # logits rows past the chunks' point past the tokens (padding; forward counts the rows before)
    last_idx = np.full(num_tokens if all_logits else num_logits, num_tokens, np.int32)
    t = x = q = 0
    for b, c in enumerate(chunks):
        n = lens[b]
        end = c.start_pos + n
        need = -(-end // page_size)
        if need > len(c.block_table):
            raise ValueError(f"sequence {b} needs {need} pages for {end} tokens, has {len(c.block_table)}")
        if x + need > num_pages:
            raise ValueError(f"the step needs more than the bucket's {num_pages} pages")
        pages = np.asarray(c.block_table[:need], np.int32)
        kv_pages[x:x + need] = pages
        kv_page_seq[x:x + need] = b
        x += need
        pos = np.arange(c.start_pos, end)
        token_ids[t:t + n] = c.token_ids
        positions[t:t + n] = pos
        seq_idx[t:t + n] = b
        slot_mapping[t:t + n] = pages[pos // page_size] * page_size + pos % page_size
        slot_T[t:t + n] = c.slot
        if not all_logits:
            last_idx[q:q + c.num_logits] = np.arange(t + n - c.num_logits, t + n)
            q += c.num_logits
        t += n
    logits_idx = np.arange(num_tokens, dtype=np.int32) if all_logits else last_idx
    return Batch(token_ids_T=token_ids, positions_T=positions, seq_idx_T=seq_idx,
                 slot_mapping_T=slot_mapping, kv_pages_X=kv_pages, kv_page_seq_X=kv_page_seq,
                 num_decode=np.int32(num_decode), logits_idx_Q=logits_idx,
                 lora=prepare_lora(slot_T) if prepare_lora is not None else None)
