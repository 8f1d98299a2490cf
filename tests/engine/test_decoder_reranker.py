"""A causal LM as a reranker, as vLLM runs Qwen3-Reranker (hf_overrides classifier_from_token ["no", "yes"]): the pair
tokenized together, its score the softmax of the "yes" logit against the "no" logit at the last token, against
transformers on the same weights, in one step or in prefill chunks."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_llm, make_tiny_model

QUERY = "where are keys and values stored?"
DOCS = ["Paged attention stores keys and values in blocks.", "The lazy dog", "Copy on write keeps prefixes intact."]


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("reranker"), "qwen3")


def test_scores_match_transformers(reranker_dir):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(reranker_dir))
    no, yes = tok.convert_ids_to_tokens([100, 101])  # any two single tokens stand in for "no" and "yes"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(reranker_dir), dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for d in DOCS:
            logits = model(torch.tensor([tok(QUERY, d)["input_ids"]])).logits[0, -1]
            want.append(torch.sigmoid(logits[101] - logits[100]).item())
    overrides = {"classifier_from_token": [no, yes]}
    scores = {}
    for budget in (2048, 8):  # one step, and prefill chunks of 8 tokens
        llm = make_llm(reranker_dir, runner="pooling", hf_overrides=overrides, max_num_batched_tokens=budget)
        outs = llm.score(QUERY, DOCS, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == [tok(QUERY, d)["input_ids"] for d in DOCS]
        scores[budget] = [o.outputs.score for o in outs]
        assert max(abs(g - w) for g, w in zip(scores[budget], want, strict=True)) < 1e-4, (scores, want)
    assert max(abs(a - b) for a, b in zip(scores[2048], scores[8], strict=True)) < 1e-6
    with pytest.raises(ValueError, match="reranker"):
        llm.embed(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="classifier_from_token"):
        make_llm(reranker_dir, runner="pooling", hf_overrides={"classifier_from_token": ["no"]})
