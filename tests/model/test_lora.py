"""LoRA adapters (pagedllm/lora/) against transformers + peft on tiny random checkpoints: greedy tokens per adapter in
batches that mix adapters and the base model (more adapters than slots), a row's result independent of its batch,
prefix-cache blocks never shared across adapters, GGUF LoRA files (ours with llama.cpp's layout, and llama.cpp's own
converter where built), adapters over weights run as stored, and what an adapter may not be."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny_models import assert_no_leaks, fresh_seed, make_llm, make_tiny_model, random_prompts

from pagedllm import LoRARequest, SamplingParams
from pagedllm.model.errors import InvalidModelError

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 10


def make_adapter(base: Path, path: Path, seed: int, targets, r: int = 8, **config) -> str:
    """A PEFT LoRA adapter of `base` with fresh random A and B (B is zero after peft's own init)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=config.pop("lora_alpha", 16),
                                                    target_modules=targets, **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    pm.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Qwen3 (q/k norms), three adapters of different targets, ranks and scalings, and the prompts."""
    root = tmp_path_factory.mktemp("lora")
    seed = fresh_seed()
    base = make_tiny_model(root / "base", "qwen3", seed=seed)
    adapters = {
        "all": make_adapter(base, root / "all", seed + 1, ALL_TARGETS),
        "qv": make_adapter(base, root / "qv", seed + 2, ["q_proj", "v_proj"], r=4, use_rslora=True,
                           alpha_pattern={"v_proj": 2}),
        "mlp": make_adapter(base, root / "mlp", seed + 3, ["gate_proj", "down_proj"], r=16, lora_alpha=8),
    }
    loras = {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(adapters.items(), 1)}
    return base, loras, random_prompts(8, seed, lo=4, hi=30)


def hf_greedy(base: Path, lora: LoRARequest | None, prompt: list[int], steps: int = STEPS) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if lora is not None:
        model = peft.PeftModel.from_pretrained(model, lora.lora_path).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


GREEDY = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=1)


def test_greedy_equals_peft_per_adapter_in_mixed_batches(setup):
    """Three adapters and the base model in one batch with two slots: each request's tokens are transformers +
    peft's with its adapter (the third adapter waits for a slot, and takes one an adapter left)."""
    base, loras, prompts = setup
    llm = make_llm(base, enable_lora=True, max_loras=2, quantization="none")
    choice = [None, *loras.values()]
    which = [choice[i % len(choice)] for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=which, use_tqdm=False)
    for o, p, lora in zip(outs, prompts, which, strict=True):
        assert list(o.outputs[0].token_ids) == hf_greedy(base, lora, p), lora
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:4]}) > 1  # adapters change the answer
    assert_no_leaks(llm)


def test_a_rows_result_does_not_depend_on_its_batch(setup):
    """With the C++ kernels (batch-invariant mode): a request's tokens and logprobs alone equal those it gets in a
    batch of other adapters' and base-model requests, whichever slot its adapter lands in."""
    base, loras, prompts = setup
    llm = make_llm(base, enable_lora=True, max_loras=3, quantization="none", attention_backend="auto")
    choice = [loras["mlp"], None, loras["all"], loras["qv"]]
    which = [choice[i % len(choice)] for i in range(len(prompts))]
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=which, use_tqdm=False)
    for i in (0, 3, 2, 1):  # alone, in another order: the adapters take other slots
        alone = llm.generate([{"prompt_token_ids": prompts[i]}], GREEDY, lora_request=which[i], use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == batched[i].outputs[0].token_ids
        assert alone.outputs[0].logprobs == batched[i].outputs[0].logprobs


def test_prefix_cache_blocks_are_keyed_by_adapter(setup):
    base, loras, _ = setup
    llm = make_llm(base, enable_lora=True, quantization="none")
    prompt = {"prompt_token_ids": list(range(3, 43))}  # 5 blocks of 8
    one = SamplingParams(max_tokens=1, temperature=0)

    def cached(lora) -> int:
        return llm.generate([prompt], one, lora_request=lora, use_tqdm=False)[0].num_cached_tokens

    assert cached(loras["all"]) == 0
    assert cached(loras["qv"]) == 0  # the same tokens under another adapter: its own KV
    assert cached(None) == 0
    assert cached(loras["all"]) == 32 and cached(None) == 32  # each hits its own blocks


def _lora_gguf(peft_dir: str, cfg, path: str) -> str:
    """A PEFT adapter as llama.cpp's convert_lora_to_gguf.py writes it: `blk.N.<tensor>.weight.lora_a/_b`, alpha in
    the metadata, q/k's B rows in the converter's interleaved rope order (the base's `llama` layout)."""
    import json

    from safetensors.torch import load_file

    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    alpha = json.load(open(os.path.join(peft_dir, "adapter_config.json")))["lora_alpha"]
    w = gguf.GGUFWriter(path, "llama")
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(alpha))
    for key, t in load_file(os.path.join(peft_dir, "adapter_model.safetensors")).items():
        parts = key.split(".")  # base_model.model.model.layers.I.(self_attn|mlp).X.lora_A.weight
        layer, module, half = parts[4], parts[6], parts[7][-1].lower()
        arr = t.float().numpy()
        if half == "b" and module in ("q_proj", "k_proj"):
            heads = cfg.num_attention_heads if module == "q_proj" else cfg.num_key_value_heads
            arr = arr.reshape(heads, 2, arr.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(arr.shape)
        w.add_tensor(f"blk.{layer}.{names[module]}.weight.lora_{half}", np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def llama_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_llama")
    seed = fresh_seed()
    base = make_tiny_model(root / "base", "llama", seed=seed)
    return root, base, make_adapter(base, root / "all", seed + 1, ALL_TARGETS)


def test_gguf_lora_file_equals_its_peft_directory(llama_setup):
    root, base, peft_dir = llama_setup
    cfg = transformers.AutoConfig.from_pretrained(base)
    gguf_path = _lora_gguf(peft_dir, cfg, str(root / "all.gguf"))
    llm = make_llm(base, enable_lora=True, max_loras=2, quantization="none")
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, 7, lo=5, hi=20)]
    want = hf_greedy(base, LoRARequest("p", 1, peft_dir), prompts[0]["prompt_token_ids"])
    for lora in (LoRARequest("peft", 1, peft_dir), LoRARequest("gguf", 2, gguf_path)):
        outs = llm.generate(prompts, GREEDY, lora_request=lora, use_tqdm=False)
        assert list(outs[0].outputs[0].token_ids) == want, lora.lora_name


def test_llama_cpp_converted_lora(llama_setup):
    """The file llama.cpp's own convert_lora_to_gguf.py writes (where `make bench-setup` built it)."""
    found = glob.glob(os.path.join(sys.prefix, "bench-build", "**", "convert_lora_to_gguf.py"), recursive=True)
    if not found:
        pytest.skip("llama.cpp's convert_lora_to_gguf.py is not built here (make bench-setup)")
    root, base, peft_dir = llama_setup
    out = str(root / "converted.gguf")
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(found[0]), "gguf-py")}
    subprocess.run([sys.executable, found[0], "--base", str(base), "--outfile", out, "--outtype", "f32", peft_dir],
                   check=True, capture_output=True, env=env, timeout=300)
    llm = make_llm(base, enable_lora=True, quantization="none")
    prompt = random_prompts(1, 11, lo=5, hi=20)[0]
    got = llm.generate([{"prompt_token_ids": prompt}], GREEDY, lora_request=LoRARequest("c", 1, out),
                       use_tqdm=False)[0]
    assert list(got.outputs[0].token_ids) == hf_greedy(base, LoRARequest("p", 1, peft_dir), prompt)


def test_adapter_over_quantized_weights(llama_setup):
    """An adapter over base weights in int8 blocks (the quantized GEMM, as GGUF weights run as stored): its
    logprobs within quantization noise of the same adapter on the dense weights, and away from the base model's."""
    _, base, peft_dir = llama_setup
    prompt = {"prompt_token_ids": random_prompts(1, 5, lo=8, hi=20)[0]}
    lora = LoRARequest("all", 1, peft_dir)
    one = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    first = {}
    for quant in ("int8", "none"):
        llm = make_llm(base, enable_lora=True, quantization=quant)
        first[quant] = llm.generate([prompt], one, lora_request=lora, use_tqdm=False)[0].outputs[0].logprobs[0]
        first[quant + "-base"] = llm.generate([prompt], one, use_tqdm=False)[0].outputs[0].logprobs[0]
    common = first["int8"].keys() & first["none"].keys()  # (top-5: the last may swap with a near tie)
    assert len(common) >= 4
    for tok in common:
        assert abs(first["int8"][tok].logprob - first["none"][tok].logprob) < 0.05
    assert first["int8"].keys() != first["int8-base"].keys() or any(
        abs(first["int8"][t].logprob - first["int8-base"][t].logprob) > 0.1 for t in first["int8"])


def test_what_an_adapter_may_not_be(setup, tmp_path):
    base, loras, prompts = setup
    llm = make_llm(base, enable_lora=True, max_lora_rank=8, quantization="none")
    with pytest.raises(InvalidModelError, match="rank 16 .* max_lora_rank 8"):
        llm.generate([prompts[0]], GREEDY, lora_request=loras["mlp"], use_tqdm=False)
    head = make_adapter(base, tmp_path / "head", 5, ["q_proj", "lm_head"], r=4)
    with pytest.raises(InvalidModelError, match="lm_head"):
        llm.generate([prompts[0]], GREEDY, lora_request=LoRARequest("head", 9, head), use_tqdm=False)
    dora = make_adapter(base, tmp_path / "dora", 6, ["q_proj"], r=4, use_dora=True)
    with pytest.raises(InvalidModelError, match="use_dora"):
        llm.generate([prompts[0]], GREEDY, lora_request=LoRARequest("dora", 10, dora), use_tqdm=False)
    with pytest.raises(InvalidModelError, match="no LoRA adapter here"):
        llm.generate([prompts[0]], GREEDY, lora_request=LoRARequest("gone", 11, str(tmp_path / "nothing")),
                     use_tqdm=False)
    llm.generate([prompts[0]], GREEDY, lora_request=loras["qv"], use_tqdm=False)
    with pytest.raises(ValueError, match="is loaded with id"):  # one name, another adapter
        llm.generate([prompts[0]], GREEDY, lora_request=LoRARequest("qv", 12, loras["all"].lora_path),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id 2 is already adapter 'qv'"):
        llm.generate([prompts[0]], GREEDY, lora_request=LoRARequest("other", 2, loras["all"].lora_path),
                     use_tqdm=False)
    assert_no_leaks(llm)  # nothing of the refused requests stayed
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        make_llm(base, quantization="none").generate([prompts[0]], GREEDY, lora_request=loras["qv"], use_tqdm=False)


def test_unloaded_adapter_finishes_its_running_requests(setup):
    base, loras, prompts = setup
    llm = make_llm(base, quantization="none", enable_lora=True)
    engine = llm.engine
    engine.add_request("r", prompts[0], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                       lora_request=loras["all"])
    engine.step()
    assert engine.remove_lora("all") and not engine.remove_lora("all")
    assert engine.list_loras() == []
    outs = []
    while engine.scheduler.running or engine.scheduler.waiting:
        outs += engine.step()
    want = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=6, temperature=0,
                        ignore_eos=True), lora_request=loras["all"], use_tqdm=False)[0]  # loaded afresh
    assert outs[-1].outputs[0].token_ids == want.outputs[0].token_ids
