"""The encoders (model/bert.py) against transformers on the same weights: BERT, XLM-RoBERTa (positions from
padding_idx + 1) and NomicBERT (rotary, SwiGLU, no biases) from HF directories, BERT and NomicBERT from the GGUF
files llama.cpp's own converter writes (with the WordPiece tokenizer rebuilt from the GGUF vocabulary)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_encoders import llama_cpp_convert_encoders, make_encoder, make_nomic
from tiny_models import add_sentence_transformers_files

from pagedllm.model.encoder_config import config_from_hf, is_encoder
from pagedllm.model.encoder_loader import load_encoder
from pagedllm.model.errors import InvalidModelError
from pagedllm.model.pooling_config import PoolingConfig, resolve_pooling_config

TEXTS = ["Paged attention stores keys and values in blocks.", "Héllo wörld, the quick brown fox!", "a",
         "Copy on write keeps shared prefixes intact. " * 3]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    # the BERT as a sentence-transformers model (mean pooling): llama.cpp's converter writes it as pooling_type
    return {"bert": add_sentence_transformers_files(make_encoder(root / "bert", "bert"), "mean_tokens"),
            "xlm-roberta": make_encoder(root / "xlmr", "xlm-roberta"), "nomic": make_nomic(root / "nomic")}


def _hidden(loaded, ids: list[list[int]]) -> list[torch.Tensor]:
    """One flat batch of every sequence, split back per sequence."""
    flat = torch.tensor([t for s in ids for t in s])
    pos = torch.tensor([p for s in ids for p in loaded.model.positions(s)])
    h = loaded.model(flat, pos, torch.zeros_like(flat), [len(s) for s in ids])
    return list(h.split([len(s) for s in ids]))


def _compare(loaded, hf_dir) -> None:
    import transformers

    ref = transformers.AutoModel.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    ids = [loaded.tokenizer.encode(t) for t in TEXTS]
    assert ids == [hf_tok(t)["input_ids"] for t in TEXTS]
    for i, (got, seq) in enumerate(zip(_hidden(loaded, ids), ids, strict=True)):
        with torch.no_grad():
            want = ref(torch.tensor([seq])).last_hidden_state[0]
        assert torch.allclose(got, want, atol=1e-4), (i, (got - want).abs().max())


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "nomic"])
def test_hf_directory_matches_transformers(checkpoints, kind):
    assert is_encoder(str(checkpoints[kind]))
    _compare(load_encoder(str(checkpoints[kind]), "float32"), checkpoints[kind])


@pytest.fixture(scope="module")
def ggufs(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("encoder_ggufs")
    kinds = ("bert", "nomic")
    paths = llama_cpp_convert_encoders([(checkpoints[k], root / f"{k}.gguf") for k in kinds])
    return dict(zip(kinds, paths, strict=True))


@pytest.mark.parametrize("kind", ["bert", "nomic"])
def test_llama_cpp_gguf_matches_transformers(checkpoints, ggufs, kind):
    gguf = ggufs[kind]
    assert is_encoder(gguf)
    loaded = load_encoder(gguf, "float32")
    assert loaded.config.architecture == ("nomic-bert" if kind == "nomic" else "bert")
    if kind == "bert":
        assert resolve_pooling_config(gguf) == PoolingConfig("MEAN", True)
    _compare(loaded, checkpoints[kind])


def test_one_row_one_answer(checkpoints):
    """A sequence's rows are the same alone and batched with others (per-sequence attention, invariant GEMMs)."""
    loaded = load_encoder(str(checkpoints["bert"]), "float32")
    ids = [loaded.tokenizer.encode(t) for t in TEXTS]
    batched = _hidden(loaded, ids)
    for seq, got in zip(ids, batched, strict=True):
        assert torch.equal(_hidden(loaded, [seq])[0], got)


def test_nomic_hub_config_names(checkpoints):
    """The hub's NomicBERT config (GPT-2 names only) reads as the same shape."""
    raw = json.loads((checkpoints["nomic"] / "config.json").read_text())
    hub = {k: v for k, v in raw.items() if k not in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                                                      "intermediate_size", "layer_norm_eps", "rope_parameters",
                                                      "max_position_embeddings")}
    assert config_from_hf(hub) == config_from_hf(raw)
    with pytest.raises(InvalidModelError, match="prenorm"):
        config_from_hf({**hub, "prenorm": True})
