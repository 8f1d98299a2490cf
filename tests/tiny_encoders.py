"""Tiny random encoder checkpoints (BERT, XLM-RoBERTa, NomicBERT; embedders and cross-encoders) saved as real HF
directories with a trained WordPiece or Unigram tokenizer, and llama.cpp's converter run on them."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import CORPUS

from pagedllm.testing.random_weights import randomize

BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
XLMR_SPECIAL = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # XLM-R's order: pad id 1, so positions start at 2

ENCODERS = {  # kind -> (config class, model class, tokenizer kind)
    "bert": ("BertConfig", "BertModel", "wordpiece"),
    "bert-cls": ("BertConfig", "BertForSequenceClassification", "wordpiece"),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", "unigram"),
    "xlm-roberta-cls": ("XLMRobertaConfig", "XLMRobertaForSequenceClassification", "unigram"),
}


def wordpiece_tokenizer(vocab_size: int = 200):
    """A lower-casing BERT WordPiece tokenizer trained on the shared corpus: [CLS] A [SEP] (B [SEP], type 1)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator([CORPUS], trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=BERT_SPECIAL))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                             sep_token="[SEP]", mask_token="[MASK]")


def unigram_tokenizer(vocab_size: int = 200):
    """A SentencePiece-style Unigram tokenizer as XLM-R's: <s> A </s> (</s> B </s>), token types all 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([CORPUS], trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=XLMR_SPECIAL,
                                                               unk_token="<unk>"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", cls_token="<s>", sep_token="</s>", mask_token="<mask>")


def make_encoder(path: Path, kind: str = "bert", seed: int = 0, **overrides) -> Path:
    """A random tiny transformers encoder of `kind` (ENCODERS) with its tokenizer, saved into `path`."""
    import transformers

    cfg_name, model_name, tok_kind = ENCODERS[kind]
    tokenizer = wordpiece_tokenizer() if tok_kind == "wordpiece" else unigram_tokenizer()
    kw = dict(vocab_size=len(tokenizer), hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=96, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
              type_vocab_size=2 if tok_kind == "wordpiece" else 1)
    if kind.endswith("-cls"):
        kw["num_labels"] = 1
    kw.update(overrides)
    model = randomize(getattr(transformers, model_name)(getattr(transformers, cfg_name)(**kw)), seed)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return Path(path)


# ---- NomicBERT: the hub's checkpoints are remote code's (GPT-2 config names: n_embd, ...); transformers 5 has a class of
# its own, which reads the hub's tensor names but BERT's config names: the tiny config carries both, as one shape
NOMIC_CONFIG = {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", "activation_function": "swiglu",
                "causal": False, "prenorm": False, "qkv_proj_bias": False, "mlp_fc1_bias": False,
                "mlp_fc2_bias": False, "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
                "rotary_emb_scale_base": None, "rotary_emb_base": 1000, "n_positions": 8192,
                "max_trained_positions": 2048, "layer_norm_epsilon": 1e-12, "type_vocab_size": 2,
                "n_embd": 48, "n_head": 4, "n_layer": 2, "n_inner": 96, "pad_token_id": 0,
                "hidden_size": 48, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96,
                "layer_norm_eps": 1e-12, "max_position_embeddings": 2048,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}


def make_nomic(path: Path, seed: int = 0) -> Path:
    """A random NomicBERT checkpoint in the hub's layout (tensor names of nomic-embed-text)."""
    from safetensors.torch import save_file

    tokenizer = wordpiece_tokenizer()
    cfg = {**NOMIC_CONFIG, "vocab_size": len(tokenizer)}
    h, ff = cfg["n_embd"], cfg["n_inner"]
    torch.manual_seed(seed)
    shapes = {"embeddings.word_embeddings.weight": (cfg["vocab_size"], h),
              "embeddings.token_type_embeddings.weight": (2, h), "emb_ln.weight": (h,), "emb_ln.bias": (h,)}
    for i in range(cfg["n_layer"]):
        p = f"encoder.layers.{i}."
        shapes |= {p + "attn.Wqkv.weight": (3 * h, h), p + "attn.out_proj.weight": (h, h),
                   p + "mlp.fc11.weight": (ff, h), p + "mlp.fc12.weight": (ff, h), p + "mlp.fc2.weight": (h, ff),
                   p + "norm1.weight": (h,), p + "norm1.bias": (h,), p + "norm2.weight": (h,), p + "norm2.bias": (h,)}
    weights = {}
    for name, shape in shapes.items():
        if len(shape) > 1:
            weights[name] = torch.randn(shape) / shape[-1] ** 0.5
        else:
            weights[name] = 0.1 * torch.randn(shape) if name.endswith("bias") else 1.0 + 0.2 * torch.randn(shape)
    os.makedirs(path, exist_ok=True)
    save_file(weights, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    tokenizer.save_pretrained(path)
    return Path(path)


# ---- llama.cpp's converter ------------------------------------------------------------------------------------
_CONVERT = """
import runpy, sys
sys.path.insert(0, {root!r})
import conversion.base as base
# a freshly trained vocabulary has no registered pre-tokenizer hash: WordPiece has no BPE pre-tokenizer to name
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
for args in {jobs!r}:
    sys.argv = [{script!r}, *args]
    runpy.run_path({script!r}, run_name="__main__")
"""


def llama_cpp_convert_encoders(jobs: list[tuple[Path, Path]], outtype: str = "f32") -> list[str]:
    """Each (HF directory, GGUF path) converted by llama.cpp's own convert_hf_to_gguf.py, all in one process (its
    start-up is most of the time), the vocabulary's pre-tokenizer check skipped (it knows only published
    vocabularies); skips where `make bench-setup` did not build it."""
    found = glob.glob(os.path.join(sys.prefix, "bench-build", "**", "convert_hf_to_gguf.py"), recursive=True)
    if not found:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is not built here (make bench-setup)")
    script = found[0]
    args = [[str(src), "--outfile", str(out), "--outtype", outtype] for src, out in jobs]
    code = _CONVERT.format(root=os.path.dirname(script), script=script, jobs=args)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return [str(out) for _, out in jobs]
