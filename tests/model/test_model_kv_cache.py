"""KV pool sizing from a byte budget, allocation shapes, the start-up log line, config parsing details."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedllm.model import ModelConfig, allocate_kv_caches, kv_bytes_per_block, num_blocks_for_budget
from pagedllm.model.config import UnsupportedModelError, check_token_ids, config_from_hf

CFG = ModelConfig(architecture="llama", num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
                  num_kv_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192)


def test_bytes_per_block_formula():
    # 2 (K,V) x layers x B x kv_heads x head_dim x dtype size
    assert kv_bytes_per_block(CFG, 16, torch.bfloat16) == 2 * 30 * 16 * 3 * 64 * 2
    assert kv_bytes_per_block(CFG, 32, torch.float32) == 2 * 30 * 32 * 3 * 64 * 4


def test_blocks_from_budget():
    per = kv_bytes_per_block(CFG, 16, torch.bfloat16)
    assert num_blocks_for_budget(CFG, 16, torch.bfloat16, 2 * 2**30) == 2 * 2**30 // per
    assert num_blocks_for_budget(CFG, 16, torch.bfloat16, per) == 1
    with pytest.raises(ValueError, match="smaller than one KV block"):
        num_blocks_for_budget(CFG, 16, torch.bfloat16, per - 1)


def test_allocate_shapes_views_and_log(caplog):
    small = ModelConfig(architecture="llama", num_layers=3, hidden_size=32, intermediate_size=64, num_heads=4,
                        num_kv_heads=2, head_dim=8, vocab_size=10, max_position_embeddings=64)
    with caplog.at_level(logging.INFO, logger="pagedllm.model.kv_cache"):
        caches = allocate_kv_caches(small, 16, torch.bfloat16, budget_bytes=10 * kv_bytes_per_block(
            small, 16, torch.bfloat16) + 5)
    assert len(caches) == 3
    for k, v in caches:
        assert k.shape == v.shape == (10, 16, 2, 8) and k.dtype == torch.bfloat16
        assert k.is_contiguous() and not k.any()
    caches[0][0].fill_(1)  # layers do not alias each other
    assert not caches[0][1].any() and not caches[1][0].any()
    assert any("10 blocks of 16 tokens = 160 tokens" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError):
        allocate_kv_caches(small, 16, torch.float32)


def test_hybrid_layout_shares_one_pool_by_position_in_group():
    """Gemma 3's 5 local : 1 global pattern over 12 layers: gcd(2, 10) = 2 layers per group,
    1 full group (layers 5, 11) and 5 sliding groups; layer l uses pool[its position in its group]."""
    from pagedllm.core.kv_groups import plan_kv_groups

    cfg = ModelConfig(architecture="gemma3", num_layers=12, hidden_size=32, intermediate_size=64, num_heads=4,
                      num_kv_heads=1, head_dim=8, vocab_size=10, max_position_embeddings=4096, sliding_window=64,
                      layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(12)])
    layout = plan_kv_groups([cfg.layer_window(i) for i in range(12)], 4096)
    assert [(g.layers, g.window) for g in layout.groups] == [((5, 11), None), ((0, 1), 64), ((2, 3), 64),
                                                              ((4, 6), 64), ((7, 8), 64), ((9, 10), 64)]
    assert kv_bytes_per_block(cfg, 16, torch.float32, layout.group_size) * 6 == kv_bytes_per_block(
        cfg, 16, torch.float32)
    caches = allocate_kv_caches(cfg, 16, torch.float32, num_blocks=7, layout=layout)
    assert caches.pool.shape == (2, 2, 7, 16, 1, 8) and caches.layer_group == [1, 1, 2, 2, 3, 0, 3, 4, 4, 5, 5, 0]
    assert caches[0][0].data_ptr() == caches[2][0].data_ptr() == caches[5][0].data_ptr()  # position 0
    assert caches[1][0].data_ptr() == caches[11][0].data_ptr() != caches[0][0].data_ptr()  # position 1
    assert plan_kv_groups([cfg.layer_window(i) for i in range(12)], 64).num_groups == 1  # window >= context
    assert plan_kv_groups([None, 8, 8, 8, None]).windows == [None]  # 2 vs 3 layers: one full group
    assert plan_kv_groups([8, 8, 8]).windows == [8]  # all sliding (Mistral): one sliding group
    assert plan_kv_groups([None, 8, 8], hybrid=False).windows == [None]


def test_config_from_hf_variants():
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96,
            "vocab_size": 100}
    c = config_from_hf({**base, "architectures": ["LlamaForCausalLM"], "rope_theta": 5e5,
                        "rope_scaling": {"type": "linear", "factor": 4.0}, "eos_token_id": [1, 2]})
    assert c.rope_theta == 5e5 and c.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert c.num_kv_heads == 4 and c.head_dim == 16 and c.eos_token_ids == [1, 2]
    c = config_from_hf({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 256,
                        "max_position_embeddings": 4096}, {"eos_token_id": 7})
    assert c.max_position_embeddings == 4096 and c.eos_token_ids == [7]  # the window is attended, not capped
    assert [c.layer_window(i) for i in range(2)] == [256, 256]
    c = config_from_hf({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 256,
                        "use_sliding_window": True, "max_window_layers": 1, "max_position_embeddings": 4096})
    assert [c.layer_window(i) for i in range(2)] == [None, 256]  # Qwen: layers from max_window_layers on slide
    c = config_from_hf({**base, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 7, "sliding_window": 8,
                        "rope_theta": 1e6, "rope_local_base_freq": 1e4, "max_position_embeddings": 64})
    assert c.layer_types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]  # transformers 4
    assert c.rope_local_theta == 1e4 and c.rope_theta == 1e6
    with pytest.raises(UnsupportedModelError, match="softcapping"):
        config_from_hf({**base, "architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": 50.0})
    c = config_from_hf({**base, "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
                        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}})
    assert c.rope_scaling["original_max_position_embeddings"] == 4096  # as transformers fills it in
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        config_from_hf({**base, "architectures": ["LlamaForCausalLM"],
                        "rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}})
    with pytest.raises(UnsupportedModelError, match="supported: LlamaForCausalLM"):
        config_from_hf({**base, "architectures": ["FalconForCausalLM"]})


def test_check_token_ids():
    check_token_ids([0, 99], 100)
    with pytest.raises(ValueError, match="100"):
        check_token_ids([5, 100], 100)
    with pytest.raises(ValueError):
        check_token_ids([1, "a"], 100)  # type: ignore[list-item]
