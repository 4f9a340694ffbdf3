"""How many device slots an engine gets (multilora.config.lora_slot_count): sized by a
memory budget unless a count is given; plain arithmetic, no jax."""

from __future__ import annotations

import pytest

from multilora.config import EngineConfig, lora_slot_count

MB = 2**20
GB = 2**30


def test_by_memory_capped_at_max_num_seqs():
    assert lora_slot_count(None, False, 2 * GB, 20 * MB, 64) == 64      # 102 fit, 64 sequences
    assert lora_slot_count(None, False, 2 * GB, 80 * MB, 64) == 25      # rank 64: 25 fit
    assert lora_slot_count(None, True, 1 * GB, 20 * MB, 256) == 51


def test_a_given_count_is_kept_and_a_given_budget_caps_it():
    assert lora_slot_count(8, False, 2 * GB, 80 * MB, 64) == 8
    assert lora_slot_count(200, False, 2 * GB, 80 * MB, 64) == 200     # the count alone is obeyed
    assert lora_slot_count(200, True, 2 * GB, 80 * MB, 64) == 25       # both: the budget caps it
    assert lora_slot_count(0, True, 2 * GB, 80 * MB, 64) == 0          # 0 still disables LoRA


def test_a_budget_below_one_slot_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"lora_memory_gb=0\.01 cannot hold one adapter slot \(80\.0 MB"):
        lora_slot_count(None, True, int(0.01 * GB), 80 * MB, 64)
    with pytest.raises(ValueError, match="cannot hold one adapter slot"):
        lora_slot_count(4, True, int(0.01 * GB), 80 * MB, 64)


@pytest.mark.parametrize("field,value", [("lora_memory_gb", 0), ("lora_memory_gb", -1.0), ("lora_memory_gb", "2"),
                                         ("lora_host_memory_gb", 0), ("max_loras_per_batch", -1),
                                         ("max_loras_per_batch", True)])
def test_bad_lora_memory_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})
