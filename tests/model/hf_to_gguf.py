"""A transformers checkpoint written to GGUF the way llama.cpp's converter lays it out (names, Q/K rows permuted for
the Llama-arch families, experts stacked per layer [E, rows, cols], Granite's multipliers as its scales): the tests'
own writer, next to llama.cpp's `convert_hf_to_gguf.py` where `make bench-setup` built it."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagedllm.attention import build_attention_metadata
from pagedllm.model import allocate_kv_caches

PERMUTED = ("llama", "granite")  # the GGUF architectures whose Q/K rows llama.cpp's converter interleaves


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rope pairs of Llama-arch Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
          "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
          "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
          "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
          "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
          "mlp.gate.weight": "ffn_gate_inp", "block_sparse_moe.gate.weight": "ffn_gate_inp"}
_EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
           "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def write_hf_as_gguf(hf: torch.nn.Module, garch: str, path: str, matrix_type: Q = Q.F32, **metadata_overrides) -> None:
    """The checkpoint under GGUF architecture `garch`, matrices in `matrix_type` (norms and routers stay F32, as
    llama-quantize leaves them); `metadata_overrides` replace (None: drop) `{garch}.KEY` entries."""
    c = hf.config
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    meta = {"block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
            "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
            "attention.key_length": head_dim, "attention.value_length": head_dim,
            "rope.freq_base": float(c.rope_parameters["rope_theta"]),
            "attention.layer_norm_rms_epsilon": c.rms_norm_eps, "vocab_size": c.vocab_size}
    if experts:
        meta |= {"expert_count": experts, "expert_used_count": c.num_experts_per_tok}
    if getattr(c, "moe_intermediate_size", None):
        meta["expert_feed_forward_length"] = c.moe_intermediate_size
    if garch == "granite":
        meta |= {"embedding_scale": c.embedding_multiplier, "residual_scale": c.residual_multiplier,
                 "logit_scale": c.logits_scaling, "attention.scale": c.attention_multiplier}
    meta |= metadata_overrides
    w = gguf.GGUFWriter(path, garch)
    for key, value in meta.items():
        if value is not None:
            w.add_key_value(f"{garch}.{key}", value, gguf.GGUFValueType.FLOAT32 if isinstance(value, float)
                            else gguf.GGUFValueType.UINT32)

    def add(name: str, arr: np.ndarray) -> None:
        if arr.ndim == 1 or "ffn_gate_inp" in name or matrix_type == Q.F32:
            w.add_tensor(name, arr.astype(np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), matrix_type), raw_dtype=matrix_type)

    stacks: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, arr in _checkpoint(hf, path + ".hf").items():
        if name in _GLOBAL:
            add(_GLOBAL[name], arr)
            continue
        parts = name.split(".")
        i, rest = parts[2], ".".join(parts[3:])
        if ".experts." in rest:  # model.layers.i.(mlp|block_sparse_moe).experts.e.w.weight
            stacks.setdefault((i, _EXPERT[parts[6]]), {})[int(parts[5])] = arr
            continue
        if garch in PERMUTED and rest == "self_attn.q_proj.weight":
            arr = _permute(arr, c.num_attention_heads)
        elif garch in PERMUTED and rest == "self_attn.k_proj.weight":
            arr = _permute(arr, c.num_key_value_heads)
        add(f"blk.{i}.{_LAYER[rest]}.weight", arr)
    for (i, kind), by_expert in stacks.items():
        add(f"blk.{i}.{kind}.weight", np.stack([by_expert[e] for e in range(len(by_expert))]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def _checkpoint(hf: torch.nn.Module, directory: str) -> dict[str, np.ndarray]:
    """The tensors as a checkpoint stores them (one per expert: transformers 5 fuses them in memory)."""
    from safetensors.numpy import load_file

    hf.save_pretrained(directory)
    return load_file(os.path.join(directory, "model.safetensors"))




def random_hf_model(cfg) -> torch.nn.Module:
    """A transformers model of `cfg` with O(1) activations (seed 0): norms near 1, matrices scaled by their width."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape) if p.dim() == 1 else torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return model


def paged_logits(loaded, tokens: list[int], steps: list[int] | None = None) -> torch.Tensor:
    """A loaded model's logits for one prompt, computed over scattered 16-token blocks in one paged step, or in
    steps of these many tokens (a prefill, then one-token decode steps: [n, 1, 1, ...])."""
    bs = 16
    steps = steps or [len(tokens)]
    assert sum(steps) == len(tokens)
    blocks = [5, 2, 7, 0, 9, 3, 8, 1, 6, 4][: -(-len(tokens) // bs)]
    kv = allocate_kv_caches(loaded.config, bs, loaded.dtype, num_blocks=10)
    out, done = [], 0
    for n in steps:
        meta = build_attention_metadata([blocks], [done], [n], bs)
        hidden = loaded.model(torch.tensor(tokens[done:done + n]), torch.arange(done, done + n), kv, meta)
        out.append(loaded.model.compute_logits(hidden))
        done += n
    return torch.cat(out)


def llama_cpp_convert(make_hf, directory, tokenizer_class: str | None = None,
                      outtype: str = "f32") -> tuple[str, torch.nn.Module, int]:
    """(GGUF path, the transformers model, its vocabulary size): `make_hf(vocab)` saved with the embedded SmolLM2's
    tokenizer (llama.cpp's converter refuses pre-tokenizers it does not know), its tokenizer_config naming
    `tokenizer_class` where given (Phi-4-mini's "GPT2Tokenizer" takes the converter's BPE path), and converted by
    llama.cpp's own convert_hf_to_gguf.py (matrices as `outtype`). Skips where `make bench-setup` did not build it."""
    found = glob.glob(os.path.join(sys.prefix, "bench-build", "**", "convert_hf_to_gguf.py"), recursive=True)
    if not found:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is not built here (make bench-setup)")
    import transformers

    from pagedllm.model.loader import default_model_path

    gguf_path = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                                           gguf_file=os.path.basename(gguf_path))
    hf = make_hf(len(tokenizer))
    hf.save_pretrained(os.path.join(directory, "hf"))
    tokenizer.save_pretrained(os.path.join(directory, "hf"))
    if tokenizer_class:
        config_path = os.path.join(directory, "hf", "tokenizer_config.json")
        with open(config_path) as f:
            config = json.load(f)
        with open(config_path, "w") as f:
            json.dump({**config, "tokenizer_class": tokenizer_class, "add_prefix_space": False}, f)
    out = os.path.join(directory, "converted.gguf")
    done = subprocess.run([sys.executable, found[0], os.path.join(directory, "hf"), "--outfile", out, "--outtype",
                           outtype], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return out, hf, len(tokenizer)
