"""EncoderConfig: the shape of a bidirectional encoder (BERT, XLM-RoBERTa, NomicBERT; embedders and cross-encoders),
read from a Hugging Face config.json or a GGUF file's metadata. Pure Python: the engine asks `is_encoder` before
it decides which engine to build."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from pagedllm.model.errors import InvalidModelError, UnsupportedModelError

# config.json "architectures" -> (family, has a classification head)
HF_ENCODERS = {
    "BertModel": ("bert", False), "BertForMaskedLM": ("bert", False),
    "BertForSequenceClassification": ("bert", True),
    "XLMRobertaModel": ("xlm-roberta", False), "XLMRobertaForMaskedLM": ("xlm-roberta", False),
    "XLMRobertaForSequenceClassification": ("xlm-roberta", True),
    "RobertaModel": ("xlm-roberta", False), "RobertaForSequenceClassification": ("xlm-roberta", True),
    "NomicBertModel": ("nomic-bert", False),
}
GGUF_ENCODERS = ("bert", "nomic-bert")  # general.architecture values
GGUF_RANK_POOLING = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK: the file is a cross-encoder
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swiglu")


@dataclass
class EncoderConfig:
    architecture: str  # "bert" | "xlm-roberta" | "nomic-bert"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int  # rows of the position table (rotary: the trained context)
    type_vocab_size: int = 0  # 0: no token-type table
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"  # the MLP's; "swiglu": silu(gate) * up (NomicBERT)
    bias: bool = True  # NomicBERT's projections have none
    rotary_base: float | None = None  # rotary positions (NomicBERT) instead of a position table
    position_offset: int = 0  # XLM-R in HF form: positions start at padding_idx + 1
    pad_token_id: int | None = None
    num_labels: int = 0  # a cross-encoder's classifier outputs (0: an embedder)
    classifier_dense: bool = False  # a dense + tanh before the classifier (BERT's pooler, RoBERTa's head)
    sigmoid: bool = True  # a one-label classifier's score as sentence-transformers' CrossEncoder computes it

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidModelError(f"must be a positive integer, got {value!r}", field=name)
        if self.hidden_size % self.num_heads:
            raise InvalidModelError(f"hidden size {self.hidden_size} is not a multiple of the {self.num_heads} "
                                    f"heads", field="num_attention_heads")
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}",
                                        field="hidden_act")
        if self.num_labels > 1:
            raise UnsupportedModelError(f"a classifier with {self.num_labels} labels: scoring needs one "
                                        f"(a relevance logit)", field="num_labels")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def gated(self) -> bool:
        return self.hidden_act == "swiglu"

    @property
    def is_cross_encoder(self) -> bool:
        return self.num_labels > 0

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings - self.position_offset


def is_encoder(path: str) -> bool:
    """Whether the checkpoint at `path` (HF directory or .gguf) is one of the encoders above."""
    if os.path.isdir(path):
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            return False
        with open(cfg_path) as f:
            raw = json.load(f)
        return any(a in HF_ENCODERS for a in raw.get("architectures") or [])
    if os.path.isfile(path):
        from pagedllm.model.gguf_reader import read_gguf

        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return False
        gguf = read_gguf(path)
        try:
            return gguf.architecture in GGUF_ENCODERS
        finally:
            gguf.close()
    return False


def _first(raw: dict, *keys: str, default: Any = None) -> Any:
    """The first of `keys` the config sets: NomicBERT's hub configs use GPT-2's names (n_embd, ...), transformers'
    own NomicBertConfig BERT's."""
    for k in keys:
        if raw.get(k) is not None:
            return raw[k]
    if default is None:
        raise InvalidModelError(f"none of {', '.join(keys)} is set", field=keys[0])
    return default


def config_from_hf(raw: dict) -> EncoderConfig:
    archs = [a for a in raw.get("architectures") or [] if a in HF_ENCODERS]
    if not archs:
        raise UnsupportedModelError(f"not an encoder: {raw.get('architectures')!r}; supported: "
                                    f"{', '.join(HF_ENCODERS)}", field="architectures")
    family, classifier = HF_ENCODERS[archs[0]]
    common = dict(vocab_size=raw.get("vocab_size"), pad_token_id=raw.get("pad_token_id"))
    if classifier:
        labels = raw.get("num_labels") or len(raw.get("id2label") or {}) or 2
        common |= dict(num_labels=labels, classifier_dense=True, sigmoid=_sigmoid(raw))
    if family == "nomic-bert":
        return _nomic_from_hf(raw, common)
    pad = raw.get("pad_token_id")
    offset = (pad + 1) if family == "xlm-roberta" and pad is not None else 0
    return EncoderConfig(family, hidden_size=raw.get("hidden_size"), num_layers=raw.get("num_hidden_layers"),
                         num_heads=raw.get("num_attention_heads"), intermediate_size=raw.get("intermediate_size"),
                         max_position_embeddings=raw.get("max_position_embeddings"),
                         type_vocab_size=raw.get("type_vocab_size", 2), layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
                         hidden_act=raw.get("hidden_act", "gelu"), position_offset=offset, **common)


def _nomic_from_hf(raw: dict, common: dict) -> EncoderConfig:
    for key, want in (("prenorm", False), ("rotary_emb_fraction", 1.0), ("rotary_emb_interleaved", False),
                      ("qkv_proj_bias", False), ("mlp_fc1_bias", False), ("mlp_fc2_bias", False)):
        if key in raw and raw[key] != want:
            raise UnsupportedModelError(f"NomicBERT with {key}={raw[key]!r} (supported: {want!r})", field=key)
    act = raw.get("activation_function", "swiglu")
    if act != "swiglu":
        raise UnsupportedModelError(f"NomicBERT with activation {act!r} (supported: swiglu)",
                                    field="activation_function")
    rope = raw.get("rope_parameters") or {}
    # nomic-embed-text v1/v1.5 are trained for 2048 positions (n_positions says 8192), as llama.cpp's converter reads
    positions = _first(raw, "max_trained_positions", "max_position_embeddings", "n_positions")
    return EncoderConfig("nomic-bert", hidden_size=_first(raw, "n_embd", "hidden_size"),
                         num_layers=_first(raw, "n_layer", "num_hidden_layers"),
                         num_heads=_first(raw, "n_head", "num_attention_heads"),
                         intermediate_size=_first(raw, "n_inner", "intermediate_size"),
                         max_position_embeddings=positions, type_vocab_size=raw.get("type_vocab_size", 2),
                         layer_norm_eps=_first(raw, "layer_norm_epsilon", "layer_norm_eps", default=1e-12),
                         hidden_act="swiglu", bias=False,
                         rotary_base=float(_first(raw, "rotary_emb_base", default=rope.get("rope_theta", 1000.0))),
                         **common)


def _sigmoid(raw: dict) -> bool:
    """sentence-transformers' CrossEncoder: sigmoid for one label unless the checkpoint names another activation
    (its config.json's sentence_transformers.activation_fn, or the older sbert_ce_default_activation_function)."""
    named = (raw.get("sentence_transformers") or {}).get("activation_fn") or \
        raw.get("sbert_ce_default_activation_function")
    return named is None or named.endswith("Sigmoid")


def config_from_gguf(f) -> EncoderConfig:
    """From the metadata llama.cpp's converter writes for `bert` and `nomic-bert` (position tables are stored
    without XLM-R's offset rows: positions start at 0)."""
    arch, m = f.architecture, f.metadata
    if arch not in GGUF_ENCODERS:
        raise UnsupportedModelError(f"not an encoder architecture: {arch!r}", path=f.path,
                                    field="general.architecture")

    def get(key: str, default: Any = None) -> Any:
        value = m.get(f"{arch}.{key}", default)
        if value is None:
            raise InvalidModelError("missing", path=f.path, field=f"{arch}.{key}")
        return value

    if m.get(f"{arch}.attention.causal", False):
        raise UnsupportedModelError("causal attention in an encoder", path=f.path, field=f"{arch}.attention.causal")
    rows = f.tensors.get("token_embd.weight")
    if rows is None:
        raise InvalidModelError("missing", path=f.path, field="tensor 'token_embd.weight'")
    types = f.tensors.get("token_types.weight")
    cls_out = f.tensors.get("cls.output.weight")
    rank = m.get(f"{arch}.pooling_type") == GGUF_RANK_POOLING or cls_out is not None
    nomic = arch == "nomic-bert"
    return EncoderConfig(
        arch, vocab_size=rows.shape[0], hidden_size=get("embedding_length"), num_layers=get("block_count"),
        num_heads=get("attention.head_count"), intermediate_size=get("feed_forward_length"),
        max_position_embeddings=get("context_length"), type_vocab_size=types.shape[0] if types is not None else 0,
        layer_norm_eps=float(get("attention.layer_norm_epsilon", 1e-12)),
        hidden_act="swiglu" if nomic else "gelu", bias=not nomic,
        rotary_base=float(get("rope.freq_base", 1000.0)) if nomic else None,
        pad_token_id=m.get("tokenizer.ggml.padding_token_id"),
        num_labels=(cls_out.shape[0] if cls_out is not None else 1) if rank else 0,
        classifier_dense="cls.weight" in f.tensors)
