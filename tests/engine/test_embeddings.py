"""The pooling runner (LLM(runner="pooling").embed) against transformers: the final-normed last hidden state,
pooled as the checkpoint's sentence-transformers modules say, normalised; batched, chunked, truncated."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_models import (
    add_sentence_transformers_files,
    assert_no_leaks,
    fresh_seed,
    make_llm,
    make_tiny_model,
    random_prompts,
)

from pagedllm import BeamSearchParams, PoolingParams, SamplingParams


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_embed"), "qwen3")


def _checkpoint(src, tmp_path, pooling: str, normalize: bool = True):
    """A copy of the tiny Qwen3 with sentence-transformers' files for `pooling`."""
    import shutil

    dst = tmp_path / f"st_{pooling}"
    shutil.copytree(src, dst)
    return add_sentence_transformers_files(dst, pooling, normalize)


def _oracle(path, prompts: list[list[int]], pooling: str, normalize: bool = True) -> list[torch.Tensor]:
    """transformers: the base model's last hidden state (after the final norm), pooled, L2-normalised."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            h = model.model(torch.tensor([ids])).last_hidden_state[0]
            v = {"lasttoken": h[-1], "mean_tokens": h.mean(0), "cls_token": h[0]}[pooling]
            out.append(F.normalize(v, dim=-1) if normalize else v)
    return out


def _assert_close(got: list, want: list[torch.Tensor]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g = torch.tensor(g.outputs.embedding)
        cos = F.cosine_similarity(g, w, dim=0).item()
        assert cos >= 0.9999, f"prompt {i}: cosine {cos}"
        assert math.isclose(g.norm().item(), w.norm().item(), rel_tol=1e-3), i


@pytest.mark.parametrize("pooling", ["lasttoken", "mean_tokens", "cls_token"])
def test_embed_matches_transformers_batched_and_chunked(qwen3_dir, tmp_path, pooling):
    path = _checkpoint(qwen3_dir, tmp_path, pooling)
    prompts = random_prompts(6, fresh_seed(), lo=1, hi=70)
    want = _oracle(path, prompts, pooling)
    # every prompt in one batch, then chunks of 16 tokens shared between them (several steps per prompt)
    for budget in (2048, 16):
        llm = make_llm(path, runner="pooling", max_num_batched_tokens=budget)
        outs = llm.embed(prompts, use_tqdm=False)
        _assert_close(outs, want)
        assert [o.prompt_token_ids for o in outs] == prompts and all(o.finished for o in outs)
        assert_no_leaks(llm)


def test_mean_pooling_is_not_fooled_by_the_prefix_cache(qwen3_dir, tmp_path):
    """Mean pooling reads every prompt row: a prompt whose prefix another computed is still pooled whole."""
    path = _checkpoint(qwen3_dir, tmp_path, "mean_tokens")
    base = random_prompts(1, fresh_seed(), lo=40, hi=40)[0]
    prompts = [base, base + [7, 8, 9]]
    llm = make_llm(path, runner="pooling")
    first = llm.embed(prompts[:1], use_tqdm=False)
    second = llm.embed(prompts[1:], use_tqdm=False)
    _assert_close(first + second, _oracle(path, prompts, "mean_tokens"))


def test_decoder_default_is_last_token_normalised(qwen3_dir):
    """No sentence-transformers files: last token + L2 normalisation (vLLM's default for decoders)."""
    prompts = random_prompts(3, fresh_seed(), lo=2, hi=30)
    llm = make_llm(qwen3_dir, runner="pooling")
    _assert_close(llm.embed(prompts, use_tqdm=False), _oracle(qwen3_dir, prompts, "lasttoken"))


def test_dimensions_truncate_then_renormalise(qwen3_dir, tmp_path):
    path = _checkpoint(qwen3_dir, tmp_path, "lasttoken")
    prompts = random_prompts(2, fresh_seed(), lo=3, hi=20)
    llm = make_llm(path, runner="pooling")
    full = llm.embed(prompts, use_tqdm=False)
    short = llm.embed(prompts, PoolingParams(dimensions=16), use_tqdm=False)
    for f, s in zip(full, short, strict=True):
        want = F.normalize(torch.tensor(f.outputs.embedding[:16]), dim=-1)
        assert len(s.outputs.embedding) == 16
        assert torch.allclose(torch.tensor(s.outputs.embedding), want, atol=1e-5)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(prompts, PoolingParams(dimensions=65), use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_last_tokens(qwen3_dir, tmp_path):
    path = _checkpoint(qwen3_dir, tmp_path, "mean_tokens")
    prompt = random_prompts(1, fresh_seed(), lo=50, hi=50)[0]
    llm = make_llm(path, runner="pooling", max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len=32"):
        llm.embed([prompt], use_tqdm=False)
    out = llm.embed([prompt], use_tqdm=False, truncate_prompt_tokens=20)[0]
    assert out.prompt_token_ids == prompt[-20:]
    _assert_close([out], _oracle(path, [prompt[-20:]], "mean_tokens"))
    whole = llm.embed([prompt[:32]], PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert len(whole.prompt_token_ids) == 32  # a prompt may fill the whole context: nothing is generated
    assert_no_leaks(llm)


def test_runner_mismatch_is_refused(qwen3_dir):
    pooling = make_llm(qwen3_dir, runner="pooling")
    with pytest.raises(ValueError, match="'pooling' runner"):
        pooling.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="'pooling' runner"):
        pooling.beam_search(["hello"], BeamSearchParams(beam_width=2, max_tokens=2))
    generating = make_llm(qwen3_dir)
    with pytest.raises(ValueError, match="'generate' runner"):
        generating.embed(["hello"], use_tqdm=False)


def test_sentence_transformers_oracle(qwen3_dir, tmp_path):
    """sentence-transformers itself, where installed, reads the same files the engine does."""
    st = pytest.importorskip("sentence_transformers")
    path = _checkpoint(qwen3_dir, tmp_path, "lasttoken")
    texts = ["The quick brown fox", "Paged attention stores keys and values in blocks.", "Héllo"]
    model = st.SentenceTransformer(str(path), device="cpu")
    model.tokenizer.pad_token = model.tokenizer.eos_token  # (the tiny tokenizer has none; ST pads every call)
    want = [model.encode(t, convert_to_tensor=True) for t in texts]  # one at a time: no padding in the oracle
    llm = make_llm(path, runner="pooling")
    _assert_close(llm.embed(texts, use_tqdm=False), want)

