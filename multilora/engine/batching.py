"""Host side of a step: the scheduled sequence chunks -> one padded Batch of numpy arrays.

Pure numpy, no device work: the runner pads to a compiled bucket and hands the arrays to jit.
Padding tokens write their K/V into page 0, which is reserved and never holds a sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from multilora.lora.batch import make_lora_batch_info
from multilora.model.llama import Batch

TRASH_PAGE = 0
PAD_SEQ = -1  # seq_idx of padding tokens: no page carries it


@dataclasses.dataclass
class SeqChunk:
    token_ids: Sequence[int]   # the tokens computed this step
    start_pos: int             # tokens of the sequence already in the cache
    block_table: Sequence[int] # the sequence's pages, enough for start_pos + len(token_ids)
    slot: int                  # adapter slot (0: base model)


def build_batch(chunks: Sequence[SeqChunk], *, mode: str, num_tokens: int, num_seqs: int,
                num_pages: int, page_size: int, scalings_S: np.ndarray, ranks_S: np.ndarray,
                all_logits: bool = False) -> Batch:
    """Pad the chunks to a bucket. num_pages is pages per sequence for decode (C) and the total
    pages of the step for prefill (X)."""
    total = sum(len(c.token_ids) for c in chunks)
    if total > num_tokens or len(chunks) > num_seqs:
        raise ValueError(f"{len(chunks)} sequences / {total} tokens exceed the bucket "
                         f"({num_seqs} sequences / {num_tokens} tokens)")
    decode = mode == "decode"
    if decode and (num_tokens != num_seqs or any(len(c.token_ids) != 1 for c in chunks)):
        raise ValueError("a decode batch has exactly one token per sequence")
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    seq_idx = np.full(num_tokens, PAD_SEQ, np.int32)
    slot_mapping = np.zeros(num_tokens, np.int32)  # TRASH_PAGE, offset 0
    slot_T = np.zeros(num_tokens, np.int32)
    block_tables = np.full((num_seqs, num_pages) if decode else (0, 0), TRASH_PAGE, np.int32)
    context_lens = np.zeros(num_seqs if decode else 0, np.int32)
    kv_pages = np.full(0 if decode else num_pages, TRASH_PAGE, np.int32)
    kv_page_seq = np.full(0 if decode else num_pages, num_seqs, np.int32)
    last_idx = np.zeros(num_seqs, np.int32)
    t = x = 0
    for b, c in enumerate(chunks):
        n = len(c.token_ids)
        end = c.start_pos + n
        need = -(-end // page_size)
        if need > len(c.block_table):
            raise ValueError(f"sequence {b} needs {need} pages for {end} tokens, has {len(c.block_table)}")
        pages = np.asarray(c.block_table, np.int32)
        if decode:
            if need > num_pages:
                raise ValueError(f"sequence {b} needs {need} pages, the bucket holds {num_pages}")
            block_tables[b, :need] = pages[:need]
            context_lens[b] = end
        else:
            if x + need > num_pages:
                raise ValueError(f"the step needs more than the bucket's {num_pages} pages")
            kv_pages[x:x + need] = pages[:need]
            kv_page_seq[x:x + need] = b
            x += need
        pos = np.arange(c.start_pos, end)
        token_ids[t:t + n] = c.token_ids
        positions[t:t + n] = pos
        seq_idx[t:t + n] = b
        slot_mapping[t:t + n] = pages[pos // page_size] * page_size + pos % page_size
        slot_T[t:t + n] = c.slot
        last_idx[b] = t + n - 1
        t += n
    logits_idx = np.arange(num_tokens, dtype=np.int32) if all_logits else last_idx
    return Batch(token_ids_T=token_ids, positions_T=positions, seq_idx_T=seq_idx,
                 slot_mapping_T=slot_mapping, block_tables_BC=block_tables,
                 context_lens_B=context_lens, kv_pages_X=kv_pages, kv_page_seq_X=kv_page_seq,
                 logits_idx_Q=logits_idx, lora=make_lora_batch_info(slot_T, scalings_S, ranks_S),
                 mode=mode)
