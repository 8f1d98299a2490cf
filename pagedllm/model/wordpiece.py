"""The WordPiece tokenizer of a BERT-family GGUF file (tokenizer.ggml.model "bert"), rebuilt for the `tokenizers`
library. llama.cpp's converter stores the vocabulary in "phantom space" form: a word-initial piece as "▁piece", a
continuation ("##piece" in BERT's vocab.txt) as "piece", control tokens ([CLS], [SEP], ...) as they are. This undoes
that, and adds BERT's normaliser, pre-tokenizer and [CLS] A [SEP] (B [SEP]) template. Built once per file and kept
in the tokenizer cache (model/tokenizer.py), as the other GGUF vocabularies are."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from pagedllm.model.errors import UnsupportedModelError
from pagedllm.model.tokenizer import Tokenizer, _source_key
from pagedllm.paths import cache_dir

PHANTOM = "\u2581"
CONTROL = 3  # llama.cpp's token type of [CLS], [SEP], [PAD], [MASK], [UNK]
_SPECIAL = {"cls_token": "cls_token_id", "sep_token": "seperator_token_id", "pad_token": "padding_token_id",
            "unk_token": "unknown_token_id", "mask_token": "mask_token_id"}  # (llama.cpp's spelling: seperator)


def wordpiece_vocab(tokens: list[str], types: list[int]) -> list[str]:
    """BERT's vocab.txt order and spelling from the converter's phantom-space tokens."""
    out = []
    for tok, kind in zip(tokens, types, strict=True):
        if kind == CONTROL:
            out.append(tok)
        elif tok.startswith(PHANTOM):
            out.append(tok[len(PHANTOM):])
        else:
            out.append("##" + tok)
    return out


def build_wordpiece(metadata: dict):
    """The `tokenizers` Tokenizer and its special tokens ({"cls_token": "[CLS]", ...}) of a GGUF's metadata."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = metadata.get("tokenizer.ggml.token_type")
    types = [1] * len(tokens) if types is None else [int(t) for t in types]
    vocab = wordpiece_vocab(tokens, types)
    ids = {name: metadata.get(f"tokenizer.ggml.{key}") for name, key in _SPECIAL.items()}
    ids["cls_token"] = ids["cls_token"] if ids["cls_token"] is not None else metadata.get("tokenizer.ggml.bos_token_id")
    ids["sep_token"] = ids["sep_token"] if ids["sep_token"] is not None else metadata.get("tokenizer.ggml.eos_token_id")
    special = {name: vocab[i] for name, i in ids.items() if i is not None and 0 <= i < len(vocab)}
    if "cls_token" not in special or "sep_token" not in special or "unk_token" not in special:
        raise UnsupportedModelError("a WordPiece vocabulary needs [CLS], [SEP] and [UNK] token ids",
                                    field="tokenizer.ggml.*_token_id")
    tok = RustTokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token=special["unk_token"]))
    # llama.cpp's WordPiece lower-cases unless the file says otherwise (older converters wrote no key)
    tok.normalizer = normalizers.BertNormalizer(lowercase=bool(metadata.get("tokenizer.ggml.normalizer.lowercase",
                                                                            True)))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    cls, sep = special["cls_token"], special["sep_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, ids["cls_token"]), (sep, ids["sep_token"])])
    tok.add_special_tokens(list(special.values()))
    return tok, special


def load_gguf_wordpiece(path: str, gguf) -> Tokenizer:
    """The engine's Tokenizer of a `bert` GGUF vocabulary, from the cache when this file was seen before."""
    model = gguf.metadata.get("tokenizer.ggml.model")
    if model != "bert":
        raise UnsupportedModelError(f"tokenizer.ggml.model {model!r}; encoders read WordPiece ('bert') "
                                    f"vocabularies", path=path, field="tokenizer.ggml.model")
    target = os.path.join(cache_dir(), "tokenizers", "wordpiece-" + _source_key(path))
    if not os.path.isfile(os.path.join(target, "tokenizer.json")):
        tok, special = build_wordpiece(gguf.metadata)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".tmp-")
        tok.save(os.path.join(tmp, "tokenizer.json"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump(special, f)
        try:
            os.rename(tmp, target)  # atomic: a concurrent loader sees all of it or none
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    return Tokenizer(target)
