"""gpt-oss (GptOssForCausalLM, GGUF `gpt-oss`) against transformers: what it adds to the MoE layer. test_model_hf
runs every paged-batch test on a tiny gpt-oss (sinks, alternating windows, YaRN, a SwiGLU clamp its activations
reach, biases); here YaRN's frequencies for every parameter set (Qwen3's long context too), the clamped SwiGLU, the
file llama.cpp's converter writes, and the refusals."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hf_to_gguf import llama_cpp_convert, paged_logits, random_hf_model

from pagedllm.model import load_model
from pagedllm.model.config import yarn_scaling
from pagedllm.model.errors import InvalidModelError
from pagedllm.model.layers import rope_inv_freq
from pagedllm.model.mlp import clamped_swiglu


def _gpt_oss_config(vocab: int = 128, **overrides):
    import transformers as tf

    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 128}
    return tf.GptOssConfig(**{**dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                     vocab_size=vocab, max_position_embeddings=512, sliding_window=8,
                                     rms_norm_eps=1e-5, rope_parameters=rope), **overrides})


@pytest.mark.parametrize("rope", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096,
     "rope_theta": 150000.0},  # gpt-oss-20b's
    {"factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6},  # Qwen3's long context
    {"factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0, "original_max_position_embeddings": 2048, "rope_theta": 1e4,
     "mscale": 0.7, "mscale_all_dim": 0.5},  # DeepSeek's attention factor
    {"factor": 2.0, "original_max_position_embeddings": 16, "rope_theta": 500.0, "attention_factor": 0.9},
])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_yarn_frequencies_and_scale_are_transformers(rope, head_dim):
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tf.GptOssConfig(head_dim=head_dim, hidden_size=256, num_attention_heads=4, max_position_embeddings=131072,
                          rope_parameters={"rope_type": "yarn", **rope})
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    scaling = yarn_scaling({k: v for k, v in rope.items() if k != "rope_theta"} | {"rope_type": "yarn"}, 131072)
    torch.testing.assert_close(rope_inv_freq(head_dim, rope["rope_theta"], scaling), want, rtol=0, atol=0)
    assert scaling["attention_factor"] == pytest.approx(factor, rel=1e-12)


def test_qwen3_with_yarn_matches_transformers(tmp_path):
    """`rope_scaling` of type yarn (Qwen3's long-context setting) on a dense model, past the original context."""
    import transformers as tf

    cfg = tf.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                          "original_max_position_embeddings": 64})
    hf = random_hf_model(cfg)
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), "float32", attention_backend="reference", load_tokenizer=False,
                      quantization="none")
    tokens = [random.Random(1).randrange(128) for _ in range(80)]
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(paged_logits(ours, tokens, [50] + [1] * 30), want, atol=1e-4, rtol=0)


def test_clamped_swiglu_is_transformers():
    """The gate clamped above, up on both sides, (up + 1) * gate * sigmoid(alpha * gate), as transformers'
    GptOssExperts computes it from its interleaved gate|up columns."""
    import transformers as tf
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(tf.GptOssConfig(swiglu_limit=1.5, swiglu_alpha=1.3))
    gate, up = torch.randn(64, 40) * 3, torch.randn(64, 40) * 3
    interleaved = torch.stack((gate, up), dim=-1).flatten(-2)
    torch.testing.assert_close(clamped_swiglu(1.5, 1.3)(gate, up), experts._apply_gate(interleaved))
    assert (gate > 1.5).any() and (up.abs() > 1.5).any()  # both clamps were reached


def test_llama_cpp_converted_file_matches_transformers(tmp_path):
    """The GGUF llama.cpp's convert_hf_to_gguf.py writes (experts split from the interleaved gate|up, transposed,
    biases, sinks, post_attention_norm, YaRN metadata) loads to transformers' logits. llama.cpp fixes the SwiGLU
    limit at 7 and rounds YaRN's ramp ends: the checkpoint uses those."""
    def make(vocab: int) -> torch.nn.Module:
        cfg = _gpt_oss_config(vocab, swiglu_limit=7.0)
        cfg.rope_parameters["truncate"] = True
        return random_hf_model(cfg)

    path, hf, vocab = llama_cpp_convert(make, tmp_path)
    ours = load_model(path, "float32", attention_backend="reference", load_tokenizer=False, quantization="none")
    c = ours.config
    assert (c.architecture, c.attention_sinks, c.moe_bias, c.swiglu_limit, c.layer_types) == (
        "gpt_oss", True, True, 7.0, ["sliding_attention", "full_attention"])
    tokens = [random.Random(2).randrange(vocab) for _ in range(40)]
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(paged_logits(ours, tokens, [24] + [1] * 16), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("bad,field", [
    ({"factor": "4"}, "rope_scaling.factor"),
    ({"factor": -2.0}, "rope_scaling.factor"),
    ({"beta_fast": math.inf}, "rope_scaling.beta_fast"),
    ({"original_max_position_embeddings": 0}, "rope_scaling.original_max_position_embeddings"),
])
def test_bad_yarn_parameters_are_refused(tmp_path, bad, field):
    import json

    hf = random_hf_model(_gpt_oss_config())
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] |= bad
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidModelError) as e:
        load_model(str(tmp_path), "float32", load_tokenizer=False, quantization="none")
    assert field.split(".")[-1] in str(e.value)


def _hf_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked matrices [E, out, in] as OpenAI's checkpoints store MXFP4: blocks [E, out, in / 32, 16] (element 2j
    in byte j's low nibble) and scales [E, out, in / 32], quantized as llama.cpp's reference quantizer does."""
    from pagedllm.testing.gguf_writer import quantize_mxfp4

    e, rows, cols = w.shape
    ggml = torch.from_numpy(quantize_mxfp4(w.numpy())).reshape(e, rows, cols // 32, 17)
    codes = torch.cat((ggml[..., 1:] & 0x0F, ggml[..., 1:] >> 4), dim=-1)  # elements 0..31 in order
    return codes[..., 0::2] | (codes[..., 1::2] << 4), ggml[..., 0].contiguous()


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """A tiny gpt-oss saved as OpenAI ships gpt-oss (MXFP4 experts, quantization_config mxfp4), and transformers'
    model with the experts its own MXFP4 decoder makes of those bytes (the oracle)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = random_hf_model(_gpt_oss_config(swiglu_limit=7.0))
    path = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    hf.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _hf_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())  # [E, out, in]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        hf.get_parameter(name).data = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "mxfp4"}}))
    return path, hf


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_openai_mxfp4_checkpoint_matches_transformers(mxfp4_checkpoint, quantization):
    """OpenAI's safetensors form: the experts' MXFP4 blocks (interleaved gate|up rows) reordered into ggml's
    blocks and run as stored ("auto", int8 activations: close) or dequantized ("none": transformers' values)."""
    path, hf = mxfp4_checkpoint
    ours = load_model(str(path), "float32", attention_backend="reference", load_tokenizer=False,
                      quantization=quantization)
    expert = ours.model.layers[0].mlp.experts[0].gate_up
    assert (quantization == "auto") == (type(expert.method).__name__ == "QuantizedLinearMethod")
    tokens = [random.Random(3).randrange(128) for _ in range(30)]
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
    got = paged_logits(ours, tokens, [20] + [1] * 10)
    if quantization == "none":
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    else:  # the activations rounded to int8 per block of 32
        assert (got - want).abs().max() < 0.05 * want.std()


def test_mxfp4_nan_scale_in_a_checkpoint_is_refused(mxfp4_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    path, _ = mxfp4_checkpoint
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.mlp.experts.down_proj_scales"][2, 5, 1] = 255
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(InvalidModelError, match="down_proj.*255|255.*down_proj"):
        load_model(str(tmp_path), "float32", load_tokenizer=False, quantization="none")
