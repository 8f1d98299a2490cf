"""Incremental detokenisation equals decoding the whole sequence (byte-level BPE and SentencePiece spacing),
and stop strings are found across token boundaries."""

from __future__ import annotations

import pytest
from tiny_models import CORPUS, make_tokenizer

from pagedllm.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Héllo wörld, naïve café!", " Emoji: 🙂🚀 and 日本語のテキスト.", "The quick brown fox jumps.",
         "  leading spaces and\nnew lines\n"]


def sentencepiece_tokenizer():
    from tokenizers import SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast

    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator([CORPUS], vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=sp._tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module", params=["byte_level_bpe", "sentencepiece"])
def tokenizer(request):
    return make_tokenizer() if request.param == "byte_level_bpe" else sentencepiece_tokenizer()


@pytest.mark.parametrize("prompt,completion", [(a, b) for a in TEXTS[:2] for b in TEXTS])
def test_stream_equals_whole_decode(tokenizer, prompt, completion):
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(completion, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=[])
    for t in ids:
        assert detok.add_token(t) is None
    expected = tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)[
        len(tokenizer.decode(prompt_ids, skip_special_tokens=True)):]
    assert detok.text == expected


def test_stop_string_across_tokens_is_cut():
    tok = make_tokenizer()
    prompt_ids = tok.encode("Paged attention", add_special_tokens=False)
    ids = tok.encode(" stores keys and values in blocks.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["and val", "zzz"])
    hit = None
    for t in ids:
        hit = detok.add_token(t)
        if hit:
            break
    assert hit == "and val"
    assert detok.text == " stores keys "


def test_earliest_stop_string_wins():
    tok = make_tokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=["dog", "lazy"])
    for t in tok.encode("over the lazy dog", add_special_tokens=False):
        if detok.add_token(t):
            break
    assert detok.text == "over the "
