"""Chat templates cannot take the process down: the denial-of-service cases of issue 31 fail fast with
TemplateLimitError (a ValueError: the server's 400), the renderer comes back for the next request, offline chat
checks the rendered prompt's length before the Rust tokenizer sees it, and hypothesis-generated templates either
render or fail with a ValueError, within the limits."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagedllm_bench.fuzz import TEMPLATE_PIECES, TEMPLATE_SIZES, check_template, template_of
from tiny_models import make_tiny_model

from pagedllm.engine.prompt_limits import PromptTooLongError
from pagedllm.templating.render import TemplateLimitError
from pagedllm.templating.sandbox import TemplateSandbox, render_chat_template

MESSAGES = [{"role": "user", "content": "hello there"}]
NORMAL = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}{{ bos_token }}"


class _Tok:
    chat_template = NORMAL
    special_tokens_map = {"bos_token": "<s>"}


@pytest.fixture(scope="module")
def sandbox():
    sb = TemplateSandbox(timeout=1.0, max_chars=1 << 20)
    yield sb
    sb.close()


def _render(sandbox, template: str, messages=MESSAGES) -> str:
    return render_chat_template(_Tok(), messages, chat_template=template, sandbox=sandbox)


@pytest.mark.parametrize("template,reason", [
    ("{{ 10**(10**10) }}", "bits"),  # folded at compile time, holding the GIL, without the checked **
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "time limit"),
    ("{% for c in messages[0].content * 1000 %}{% for d in messages[0].content * 1000 %}{% endfor %}"
     "{% endfor %}", "time limit"),
    ("{{ 'a' * 10**8 }}", "repeats"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "limit"),  # a gigabyte by doubling
    ("{{ '%01000000000d' % 1 }}", "memory"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "characters"),  # the output limit
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed"),
])
def test_denial_of_service_templates_fail_fast(sandbox, template, reason):
    with pytest.raises(ValueError, match=reason):
        _render(sandbox, template)
    assert _render(sandbox, NORMAL) == "<|user|>hello there<s>"  # the renderer is back for the next request


def test_limit_errors_are_template_limit_errors(sandbox):
    with pytest.raises(TemplateLimitError):
        _render(sandbox, "{{ 7 ** 100000 }}")
    assert _render(sandbox, "{{ 2 ** 10 }}|{{ 'ab' * 3 }}|{{ [1] * 2 }}") == "1024|ababab|[1, 1]"


def test_sandbox_still_refuses_internals(sandbox):
    with pytest.raises(ValueError, match="sandbox"):
        _render(sandbox, "{{ ''.__class__.__base__.__subclasses__() }}")


def test_offline_chat_checks_length_before_tokenizing(tmp_path):
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(make_tiny_model(tmp_path / "m", "llama", seed=1)), dtype="float32", num_kv_blocks=32,
              max_model_len=256, attention_backend="reference")
    huge = "{% for i in range(1000) %}{{ 'word ' * 3000 }}{% endfor %}"  # 15 M characters, under the output limit
    with pytest.raises(PromptTooLongError, match="characters"):
        llm.chat(MESSAGES, SamplingParams(max_tokens=1), chat_template=huge, use_tqdm=False)
    with pytest.raises(PromptTooLongError):
        llm.generate("x " * 10_000_000, SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert out[0].error is None and len(out[0].outputs[0].token_ids) == 2


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(pieces=st.lists(st.sampled_from(TEMPLATE_PIECES), max_size=10), n=st.sampled_from(TEMPLATE_SIZES[0]),
       k=st.sampled_from(TEMPLATE_SIZES[1]))
def test_fuzzed_templates_render_or_fail_cleanly(sandbox, pieces, n, k):
    assert check_template(sandbox, template_of(pieces, n, k)) in ("rendered", "refused")
