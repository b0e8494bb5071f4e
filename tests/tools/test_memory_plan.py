"""The released configuration's memory plan (meta device) against the known parameter counts and cache rules."""

from __future__ import annotations

import json

import pytest

from modeling_deepseek_v41 import DeepseekV41Config
from modeling_deepseek_v41.tools.memory_plan import memory_plan
from reference_cases import FIXTURES


@pytest.fixture(scope="module")
def plan():
    return memory_plan(DeepseekV41Config(**json.loads((FIXTURES / "spec" / "official_config.json").read_text())))


def test_parameters_match_the_structure_tests(plan):
    counts = {k: v / 1e9 for k, v in plan["parameters"].items()}
    assert counts["routed_experts"] == pytest.approx(543.6, abs=0.05)
    assert counts["engram_tables"] == pytest.approx(196.6, abs=0.05)
    assert counts["dspark"] == pytest.approx(14, abs=0.5) and counts["backbone"] == pytest.approx(552, abs=0.5)


def test_bytes_follow_the_storage_formats(plan):
    """FP4 experts: half a byte per weight plus one E8M0 byte per 32; FP8 tables: a byte plus one per 32."""
    components, counts = plan["components"], plan["parameters"]
    assert components["routed_experts"] == counts["routed_experts"] // 2 + counts["routed_experts"] // 32
    assert components["engram_tables"] == counts["engram_tables"] + counts["engram_tables"] // 32
    assert plan["total_bytes"] == sum(t.nbytes for t in plan["model"].state_dict().values())
    assert plan["total_bytes"] - plan["engram_table_bytes"] == pytest.approx(309.0e9, rel=1e-3)


def test_cache_at_128k_and_1m(plan):
    for tokens, cache in plan["cache"].items():
        assert cache["global_per_token"] == 890
        assert cache["global"] == 890 * tokens
        assert cache["window"] == 43 * (128 + 64) * 528  # 40 layers + 3 drafter stages, 192 slots of 528 bytes


def test_tensor_parallel_rank_share(plan):
    """Experts, Engram rows, head rows and the sharded attention parts are split 8 ways; the rest replicated."""
    assert plan["tp8_per_rank"] == pytest.approx(70.1e9, rel=2e-3)
    assert plan["tp8_per_rank_tables_off_device"] == pytest.approx(plan["tp8_per_rank"] - plan["engram_table_bytes"] / 8,
                                                                   rel=1e-6)
