"""How big an engine's adapter pool is (multilora.config.lora_pool_size): slots (adapters in a
batch) and rank rows (each adapter takes as many as its rank), sized by a memory budget unless a
count is given; plain arithmetic, no jax."""

from __future__ import annotations

import pytest

from multilora.config import EngineConfig, LoRAConfig, lora_pool_size

MB = 2**20
GB = 2**30
ROW = int(1.25 * MB)  # one rank row of SmolLM2-135M at float32, roughly


def test_by_memory_rows_at_true_rank_and_slots_up_to_max_num_seqs():
    # 2 GB hold 1638 rows; 64 slots at rank 16 need only 1024: the rows stop there.
    assert lora_pool_size(None, False, 2 * GB, ROW, 16, 64) == (64, 1024)
    # max rank 128: 64 slots would need 8192 rows, the budget holds 1632 in whole pages of 8
    # (12 rank-128 adapters, or 64 of rank 16: the slots are not padded to the max).
    assert lora_pool_size(None, False, 2 * GB, ROW, 128, 64) == (64, 1632)
    # never more slots than pages: 816 rows are 102 pages
    assert lora_pool_size(None, True, 1 * GB, ROW, 64, 256) == (102, 816)


def test_a_given_count_is_kept_and_a_given_budget_bounds_its_rows():
    assert lora_pool_size(8, False, 2 * GB, ROW, 64, 64) == (8, 512)        # alone: every slot at max rank
    assert lora_pool_size(200, False, 2 * GB, ROW, 64, 64) == (200, 12800)  # the count alone is obeyed
    assert lora_pool_size(200, True, 2 * GB, ROW, 64, 64) == (200, 1632)    # both: the budget bounds the rows
    assert lora_pool_size(0, True, 2 * GB, ROW, 64, 64) == (0, 0)           # 0 still disables LoRA
    assert lora_pool_size(100, True, int(0.1 * GB), ROW, 64, 64) == (10, 80)  # never more slots than pages
    assert lora_pool_size(4, False, 2 * GB, ROW, 12, 64) == (4, 64)         # rank 12 slots: whole pages, 16


def test_a_budget_below_one_adapter_of_max_rank_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"lora_memory_gb=0\.01 cannot hold one adapter of rank "
                                         r"max_lora_rank=64 \(80\.0 MB"):
        lora_pool_size(None, True, int(0.01 * GB), ROW, 64, 64)
    with pytest.raises(ValueError, match="cannot hold one adapter"):
        lora_pool_size(4, True, int(0.01 * GB), ROW, 64, 64)


def test_lora_config_rows():
    assert LoRAConfig(max_loras_per_batch=4, max_lora_rank=16).num_rows == 4 * 16 + 8  # + the zero page
    assert LoRAConfig(max_loras_per_batch=4, max_lora_rank=16, pool_rows=40).num_rows == 48
    assert LoRAConfig(max_loras_per_batch=4, max_lora_rank=12).table_width == 16       # whole pages


@pytest.mark.parametrize("field,value", [("lora_memory_gb", 0), ("lora_memory_gb", -1.0), ("lora_memory_gb", "2"),
                                         ("lora_host_memory_gb", 0), ("max_loras_per_batch", -1),
                                         ("max_loras_per_batch", True)])
def test_bad_lora_memory_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})
