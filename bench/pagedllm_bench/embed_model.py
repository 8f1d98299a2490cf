"""A random-weight BERT embedder of a real model's shape (bge-small-en-v1.5), written as a Hugging Face directory with
sentence-transformers pooling files and converted to GGUF by llama.cpp's own convert_hf_to_gguf.py, so that both
engines read the same file. Cached under <cache>/bench-models/ (written on first use)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

# BERT-base-uncased's id layout: [PAD] 0, [unused0..98] 1..99, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103
SPECIALS = ["[PAD]", *(f"[unused{i}]" for i in range(99)), "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CLS_ID, SEP_ID = 101, 102


@dataclass(frozen=True)
class EncoderShape:
    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    max_positions: int


BGE_SMALL = EncoderShape("bge-small-en-v1.5", layers=12, hidden=384, heads=12, ffn=1536, vocab=30522,
                         max_positions=512)


def wordpiece_vocab(size: int, seed: int = 0) -> list[str]:
    """`size` WordPiece entries: BERT's specials, single characters and their ## forms, then generated pieces
    (syllable strings, a third of them word-internal ##pieces): a vocabulary of the real one's size and kinds."""
    chars = [chr(c) for c in range(33, 127) if not chr(c).isupper()] + [chr(c) for c in range(0xE0, 0x100)]
    vocab = [*SPECIALS, *chars, *("##" + c for c in chars if c.isalnum())]
    seen = set(vocab)
    rng = np.random.default_rng(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "ch",
              "sh", "th", "st", "tr", "pr", "bl", "gr"]
    vowels = ["a", "e", "i", "o", "u", "y", "ai", "ea", "ou", "io"]
    codas = ["", "", "n", "s", "t", "r", "l", "m", "ng", "ck", "nd", "st"]
    while len(vocab) < size:
        word = "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                       for _ in range(int(rng.integers(1, 4))))
        piece = "##" + word if rng.random() < 1 / 3 else word
        if piece not in seen:
            seen.add(piece)
            vocab.append(piece)
    return vocab


def wordpiece_tokenizer(vocab: list[str], max_length: int):
    """BERT's uncased WordPiece tokenizer over `vocab`: [CLS] A [SEP] (B [SEP], token type 1)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", CLS_ID),
                                                                                   ("[SEP]", SEP_ID)])
    return BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                             sep_token="[SEP]", mask_token="[MASK]", model_max_length=max_length)


def write_hf(path: str, shape: EncoderShape, seed: int = 0) -> str:
    """The random BertModel (seeded; weights scaled for O(1) activations), its WordPiece tokenizer and the
    sentence-transformers files of a CLS-pooled, normalised embedder (as bge)."""
    import transformers

    from pagedllm.testing.random_weights import randomize

    os.makedirs(path, exist_ok=True)
    wordpiece_tokenizer(wordpiece_vocab(shape.vocab, seed), shape.max_positions).save_pretrained(path)
    cfg = transformers.BertConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                                  num_attention_heads=shape.heads, intermediate_size=shape.ffn,
                                  max_position_embeddings=shape.max_positions, type_vocab_size=2, pad_token_id=0)
    model = randomize(transformers.BertModel(cfg, add_pooling_layer=False), seed)
    model.save_pretrained(path, safe_serialization=True)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f, indent=1)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": shape.hidden, "pooling_mode_cls_token": True,
                   "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
                   "pooling_mode_mean_sqrt_len_tokens": False}, f, indent=1)
    with open(os.path.join(path, "bench_shape.json"), "w") as f:
        json.dump({**asdict(shape), "seed": seed}, f)
    return path


# run inside one child python: the converter is a script; a fresh vocabulary has no registered pre-tokenizer hash
# (WordPiece has no BPE pre-tokenizer to name), so its check is answered with "default"
_CONVERT = """
import runpy, sys
sys.path.insert(0, {root!r})
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = [{script!r}, {src!r}, "--outfile", {out!r}, "--outtype", {outtype!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def converter_script() -> str:
    found = glob.glob(os.path.join(sys.prefix, "bench-build", "**", "convert_hf_to_gguf.py"), recursive=True)
    if not found:
        raise FileNotFoundError("llama.cpp's convert_hf_to_gguf.py is not built here: run `make bench-setup`")
    return found[0]


def convert(src: str, out: str, outtype: str) -> str:
    script = converter_script()
    tmp = f"{out}.tmp-{os.getpid()}"
    code = _CONVERT.format(root=os.path.dirname(script), script=script, src=src, out=tmp, outtype=outtype)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    os.replace(tmp, out)  # never leave a half-written file under the final name
    return out


def cached_embedder(outtype: str = "f16", shape: EncoderShape = BGE_SMALL, seed: int = 0) -> str:
    """The GGUF (outtype f16 or f32) of the random `shape` embedder, written with its HF directory on first use."""
    from pagedllm.paths import cache_dir

    root = os.path.join(cache_dir(), "bench-models")
    stem = f"random-{shape.name}-v{shape.vocab}-s{seed}"
    gguf = os.path.join(root, f"{stem}.{outtype.upper()}.gguf")
    if os.path.isfile(gguf):
        return gguf
    hf = os.path.join(root, f"{stem}-hf")
    t0 = time.perf_counter()
    if not os.path.isfile(os.path.join(hf, "model.safetensors")):
        tmp_hf = f"{hf}.tmp-{os.getpid()}"
        write_hf(tmp_hf, shape, seed)
        shutil.rmtree(hf, ignore_errors=True)
        os.replace(tmp_hf, hf)
    convert(hf, gguf, outtype)
    print(f"wrote {gguf} ({os.path.getsize(gguf) / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return gguf


def normal_ids(vocab_size: int) -> np.ndarray:
    """Ids of ordinary pieces (after the specials)."""
    return np.arange(len(SPECIALS), vocab_size, dtype=np.int64)
