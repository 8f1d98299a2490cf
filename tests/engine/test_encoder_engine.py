"""Encoders through the offline API (LLM(runner="pooling") runs them on the EncoderEngine, without a KV cache):
embeddings against sentence-transformers on the checkpoint's own pooling files, cross-encoder scores against
sentence-transformers' CrossEncoder and transformers, bi-encoder scores as cosines; batching never changes a result;
bad requests fail alone and clearly."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from tiny_encoders import make_encoder, make_nomic
from tiny_models import add_sentence_transformers_files

from pagedllm import LLM, PoolingParams, SamplingParams

st = pytest.importorskip("sentence_transformers")

TEXTS = ["Paged attention stores keys and values in blocks.", "Héllo wörld, the quick brown fox!", "a",
         "Copy on write keeps shared prefixes intact. A block table maps logical blocks to physical blocks.",
         "The lazy dog", "1234567890 emoji 🙂"]
QUERY = "where are keys and values stored?"


def _llm(path, **kw) -> LLM:
    return LLM(str(path), runner="pooling", dtype="float32", **kw)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("encoder_engine")


@pytest.fixture(scope="module")
def embedders(root):
    """kind -> (checkpoint with sentence-transformers files, its pooling, normalised)."""
    made = {"bert": (make_encoder(root / "bert", "bert"), "mean_tokens", True),
            "xlm-roberta": (make_encoder(root / "xlmr", "xlm-roberta", seed=1), "cls_token", False),
            "nomic": (make_nomic(root / "nomic", seed=2), "mean_tokens", True)}
    for path, pooling, normalize in made.values():
        add_sentence_transformers_files(path, pooling, normalize)
    return made


@pytest.fixture(scope="module")
def cross_encoders(root):
    return {"bert": make_encoder(root / "bert_ce", "bert-cls", seed=3),
            "xlm-roberta": make_encoder(root / "xlmr_ce", "xlm-roberta-cls", seed=4)}


def _assert_cosine(got: list, want, what: str = "") -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g, w = torch.tensor(g.outputs.embedding), torch.as_tensor(w, dtype=torch.float32)
        assert F.cosine_similarity(g, w, dim=0).item() >= 0.9999, (what, i)
        assert torch.allclose(g.norm(), w.norm(), rtol=1e-3), (what, i)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "nomic"])
def test_embed_matches_sentence_transformers(embedders, kind):
    path, pooling, normalize = embedders[kind]
    want = st.SentenceTransformer(str(path), device="cpu").encode(TEXTS, convert_to_tensor=True)
    big = _llm(path).embed(TEXTS, use_tqdm=False)
    _assert_cosine(big, want, kind)
    # one row, one answer: steps of 16 tokens (a prompt or a few per step) give the very same vectors
    small = _llm(path, max_num_batched_tokens=16).embed(TEXTS, use_tqdm=False)
    assert [o.outputs.embedding for o in small] == [o.outputs.embedding for o in big]


def test_batch_dependent_kernels_agree(embedders):
    """--no-batch-invariant runs each layer's GEMM once over the step's rows, not once per sequence: the same
    vectors to rounding."""
    path = embedders["bert"][0]
    invariant = _llm(path).embed(TEXTS, use_tqdm=False)
    _assert_cosine(_llm(path, batch_invariant=False).embed(TEXTS, use_tqdm=False),
                   [o.outputs.embedding for o in invariant], "batch-dependent")


def test_default_pooling_is_cls_normalised(embedders, root):
    """Without sentence-transformers files a BERT embeds as vLLM's: the [CLS] row, L2-normalised."""
    import transformers

    path = root / "bert_plain"
    shutil.copytree(embedders["bert"][0], path)
    for extra in ("modules.json", "1_Pooling", "2_Normalize"):
        p = path / extra
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    model = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = _llm(path)
    outs = llm.embed(TEXTS[:3], use_tqdm=False)
    with torch.no_grad():
        want = [F.normalize(model(torch.tensor([o.prompt_token_ids])).last_hidden_state[0, 0], dim=-1) for o in outs]
    _assert_cosine(outs, want)
    short = llm.embed(TEXTS[:1], PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.embedding
    assert torch.allclose(torch.tensor(short), F.normalize(want[0][:8], dim=-1), atol=1e-5)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_cross_encoder_scores_match(cross_encoders, kind):
    """LLM.score on a cross-encoder: sigmoid of the classifier on [CLS] of the pair, as sentence-transformers'
    CrossEncoder computes it (and transformers, with BERT's token types 0/1)."""
    import transformers

    path = cross_encoders[kind]
    docs = TEXTS[:5]
    want = st.CrossEncoder(str(path), device="cpu").predict([(QUERY, d) for d in docs])
    llm = _llm(path, max_num_batched_tokens=40)
    got = [o.outputs.score for o in llm.score(QUERY, docs, use_tqdm=False)]
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 1e-4, (got, want)
    assert sorted(range(5), key=got.__getitem__) == sorted(range(5), key=want.__getitem__)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.sigmoid(model(**tok([QUERY] * 5, docs, padding=True, return_tensors="pt")).logits[:, 0])
    assert torch.allclose(torch.tensor(got), ref, atol=1e-4)
    # N:N pairs score the same as 1:N
    pairs = llm.score([QUERY] * 2, docs[:2], use_tqdm=False)
    assert [o.outputs.score for o in pairs] == got[:2]


def test_bi_encoder_score_is_cosine(embedders):
    path = embedders["xlm-roberta"][0]  # not normalised: the cosine still is one
    llm = _llm(path)
    scores = llm.score(QUERY, TEXTS[:3], use_tqdm=False)
    q, *docs = llm.embed([QUERY, *TEXTS[:3]], use_tqdm=False)
    for s, d in zip(scores, docs, strict=True):
        want = F.cosine_similarity(torch.tensor(q.outputs.embedding), torch.tensor(d.outputs.embedding), dim=0)
        assert abs(s.outputs.score - want.item()) < 1e-5
        assert s.prompt_token_ids == q.prompt_token_ids + d.prompt_token_ids


def test_bad_requests_fail_clearly(embedders, cross_encoders):
    path = embedders["bert"][0]
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(str(path), dtype="float32")  # an encoder generates nothing
    llm = _llm(path, max_model_len=16)
    long = " ".join(TEXTS)
    with pytest.raises(ValueError, match="max_model_len=16"):
        llm.embed([long], use_tqdm=False)
    out = llm.embed([long], use_tqdm=False, truncate_prompt_tokens=16)[0]
    assert len(out.prompt_token_ids) == 16
    with pytest.raises(ValueError, match="'pooling' runner"):
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        llm.score(TEXTS[:2], TEXTS[:3], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    ce = _llm(cross_encoders["bert"], max_model_len=24)
    with pytest.raises(ValueError, match="cross-encoder"):
        ce.embed(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len=24"):
        ce.score(QUERY, [long], use_tqdm=False)
    (cut,) = ce.score(QUERY, [long], truncate_prompt_tokens=24, use_tqdm=False)
    assert len(cut.prompt_token_ids) == 24 and 0 < cut.outputs.score < 1
    with pytest.raises(ValueError, match="dimensions"):
        ce.score(QUERY, ["x"], pooling_params=PoolingParams(dimensions=4), use_tqdm=False)
