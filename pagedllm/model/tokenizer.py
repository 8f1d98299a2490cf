"""The engine's tokenizer: a Hugging Face `tokenizer.json` run by the Rust `tokenizers` library, with the special
tokens and chat template of its `tokenizer_config.json`.

Why not transformers' own tokenizer class: importing transformers costs ~1.5 s and building its tokenizer ~0.4 s
more, three times the time it takes to load a 1B GGUF model; this class loads in ~0.25 s (mostly parsing the JSON)
and computes the same ids and text (tests/model/test_tokenizer.py checks it against transformers on every tokenizer the
tests have). It offers the part of the transformers API that the engine, its tests and its users call; `.hf` builds
the transformers tokenizer from the same files for anything else (e.g. xgrammar's tokenizer info).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from functools import cached_property
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

from pagedllm.paths import cache_dir

logger = logging.getLogger(__name__)

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken-like dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _chat_template(directory: str, config: dict) -> str | None:
    """The default chat template: chat_template.jinja, else the config's (a string, or a list of named ones)."""
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template") or _read_json(os.path.join(directory, "chat_template.json")).get(
        "chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class Tokenizer:
    """A fast tokenizer with transformers' calling conventions (encode, decode, __call__, apply_chat_template)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.backend_tokenizer = RustTokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        _release_free_heap()
        config = _read_json(os.path.join(directory, "special_tokens_map.json"))
        config.update(_read_json(os.path.join(directory, "tokenizer_config.json")))
        self.special_tokens_map = {name: text for name in SPECIAL_TOKEN_NAMES
                                   if (text := _token_text(config.get(name))) is not None}
        missing = [t for t in self.special_tokens_map.values() if self.backend_tokenizer.token_to_id(t) is None]
        if missing:  # as transformers does: a named special token the vocabulary lacks is added
            self.backend_tokenizer.add_special_tokens([AddedToken(t, special=True) for t in missing])
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.chat_template = _chat_template(directory, config)
        self.name_or_path = directory

    # ---- special tokens --------------------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """bos_token, eos_token_id, ...: the named special tokens and their ids (None when the model has none)."""
        base = name.removesuffix("_id")
        if base in SPECIAL_TOKEN_NAMES:
            token = self.__dict__.get("special_tokens_map", {}).get(base)
            if name == base or token is None:
                return token
            return self.backend_tokenizer.token_to_id(token)
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self.backend_tokenizer.get_added_tokens_decoder()

    @property
    def all_special_ids(self) -> list[int]:
        """The named special tokens' ids and those of the added tokens marked special."""
        named = (self.backend_tokenizer.token_to_id(t) for t in self.special_tokens_map.values())
        added = (i for i, t in self.added_tokens_decoder.items() if t.special)
        return sorted({i for i in (*named, *added) if i is not None})

    # ---- vocabulary ------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str | None] | None:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    # ---- text <-> ids ----------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, text: str, text_pair: str, max_length: int | None = None) -> tuple[list[int], list[int]]:
        """A cross-encoder's input: both texts in the tokenizer's pair template (BERT: [CLS] a [SEP] b [SEP]) and
        each id's token type (BERT: 1 for the second text). max_length: the longer text loses its last tokens first
        until the pair fits (transformers' truncation="longest_first")."""
        rust = self.backend_tokenizer
        if max_length is None:
            enc = rust.encode(text, text_pair)
            return enc.ids, enc.type_ids
        a, b = rust.encode(text, add_special_tokens=False), rust.encode(text_pair, add_special_tokens=False)
        room = max_length - rust.num_special_tokens_to_add(is_pair=True)
        if room < 2:
            raise ValueError(f"truncate_prompt_tokens={max_length} leaves no room for a pair of texts")
        la, lb = len(a.ids), len(b.ids)
        while la + lb > room:
            if la > lb:
                la -= 1
            else:
                lb -= 1
        a.truncate(la)
        b.truncate(lb)
        enc = rust.post_process(a, b, add_special_tokens=True)
        return enc.ids, enc.type_ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict[str, Any]:
        """{"input_ids": ids} for a string, a list of id lists for a list of strings."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        batch = self.backend_tokenizer.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in batch]}

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode([ids] if isinstance(ids, int) else list(ids),
                                             skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces and type(self.backend_tokenizer.model).__name__ != "BPE":
            text = _clean_up_tokenization(text)  # transformers skips this for BPE models: it would corrupt them
        return text

    def apply_chat_template(self, conversation: list[dict], *, tokenize: bool = True, return_dict: bool = True,
                            **kwargs: Any) -> str | list[int] | dict[str, list[int]]:
        """The conversation rendered by the chat template (templating/render.py), tokenized by default
        (without adding special tokens: the template writes them), as transformers does."""
        from pagedllm.templating.render import apply_template

        text = apply_template(self, conversation, **kwargs)
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids} if return_dict else ids

    @cached_property
    def hf(self) -> Any:
        """The transformers tokenizer of the same files (imports transformers: ~1.5 s)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.directory)

    def __repr__(self) -> str:
        return f"Tokenizer({self.directory!r}, vocab={len(self)})"


def _release_free_heap() -> None:
    """Give the heap that parsing freed back to the OS. Parsing a large tokenizer.json (Gemma 3's: 262k tokens,
    515k merges) frees most of what it allocates, and glibc keeps the freed heap mapped, in the process's RSS for
    good (BENCHMARKS.md, issue 29). A no-op where the C library has no malloc_trim."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of WordPiece spacing before punctuation and English contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


# ---- loading -----------------------------------------------------------------------------------------------------
def load_tokenizer(path: str, gguf: Any = None) -> Tokenizer:
    """A model's tokenizer: a Hugging Face directory's tokenizer.json as it is. A GGUF file's vocabulary (or a
    directory with only a SentencePiece model) is converted by transformers once, and the result is kept on disk,
    compacted, keyed by the source's path, size and mtime, so later loads only parse it. `gguf`: the file already
    parsed and validated (model/gguf_reader.py), if the caller has it."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return Tokenizer(path)
    target = os.path.join(cache_dir(), "tokenizers", _source_key(path))
    if os.path.isdir(target):
        try:
            return Tokenizer(target)
        except Exception as e:  # a damaged cache entry: rebuild it
            logger.warning("tokenizer cache %s unreadable (%s); rebuilding", target, e)
            shutil.rmtree(target, ignore_errors=True)
    t0 = time.perf_counter()
    converted = _convert_with_transformers(path, gguf)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".tmp-")
        _save_converted(converted, tmp)
        try:
            os.rename(tmp, target)  # atomic: concurrent loaders never see a half-written cache
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # someone else won the race
    except OSError as e:
        logger.warning("could not cache the tokenizer under %s: %s", target, e)
        target = tempfile.mkdtemp(prefix="pagedllm-tokenizer-")
        _save_converted(converted, target)
    logger.info("built the tokenizer in %.1f s (cached for next time)", time.perf_counter() - t0)
    return Tokenizer(target)


def _source_key(path: str) -> str:
    """Identifies a GGUF file or a tokenizer directory's files by path, size and mtime, and the cache's format."""
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path) if f.startswith(("tokenizer", "special_tokens", "vocab")))
    ident = "|".join(f"{os.path.realpath(f)}|{(st := os.stat(f)).st_size}|{st.st_mtime_ns}" for f in files)
    return hashlib.sha256(f"{_CACHE_FORMAT}|{ident}".encode()).hexdigest()[:32]


_CACHE_FORMAT = 2  # 2: tokenizer.json compacted (_compact_tokenizer_json)


def _save_converted(converted: Any, directory: str) -> None:
    converted.save_pretrained(directory)
    _compact_tokenizer_json(os.path.join(directory, "tokenizer.json"))


def _compact_tokenizer_json(path: str) -> None:
    """Rewrites a converted tokenizer.json in the form `tokenizers` parses fastest, which is most of a warm load of a
    large vocabulary (Gemma 3: 262k tokens, 515k merges; BENCHMARKS.md): no indentation, UTF-8 as it is, and a BPE
    model's merges as "a b" strings instead of pairs, where no merged token holds a space (that form splits on it).
    The tokenizer it describes is the same."""
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    model = spec.get("model") or {}
    merges = model.get("merges")
    if model.get("type") == "BPE" and merges and all(isinstance(m, list) and len(m) == 2 for m in merges) \
            and not any(" " in a or " " in b for a, b in merges):
        model["merges"] = [f"{a} {b}" for a, b in merges]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False, separators=(",", ":"))


def _convert_with_transformers(path: str, gguf: Any) -> Any:
    from transformers import AutoTokenizer

    if os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path)
    from pagedllm.faults import is_request_fault
    from pagedllm.model.errors import InvalidModelError

    if gguf is None:
        from pagedllm.model.gguf_reader import read_gguf

        gguf = read_gguf(path)
    # The tokenizer class AutoTokenizer would pick for the architecture, called directly (AutoTokenizer parses the
    # whole file only to learn it), on a vocabulary-only copy of the file: transformers' reader sees only the
    # entries our reader validated, and not the tensors.
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    arch = gguf.architecture
    model_type = "gemma3_text" if arch == "gemma3" else arch  # transformers' name for a text-only Gemma 3
    cls = tokenizer_class_from_name(TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend")
    with tempfile.TemporaryDirectory(prefix="pagedllm-vocab-") as tmp:
        gguf.write_vocabulary_copy(os.path.join(tmp, "vocab.gguf"))
        try:
            return cls.from_pretrained(tmp, gguf_file="vocab.gguf")
        except BaseException as e:
            if not is_request_fault(e):
                raise
            raise InvalidModelError(f"transformers could not build the tokenizer: {type(e).__name__}: {e}",
                                    path=path, field="tokenizer.ggml.*") from e
