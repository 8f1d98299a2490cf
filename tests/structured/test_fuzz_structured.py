"""Hostile and random constraints for structured outputs: every JSON schema, regex and grammar either compiles
or raises GrammarError (a ValueError naming the field) within a CPU-time bound; none escapes as another
exception or a native panic (the manager's compile is the request boundary)."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import make_tokenizer

from pagedllm.structured import GrammarError, StructuredOutputsParams
from pagedllm.structured.manager import StructuredOutputManager

CPU_LIMIT_S = 5.0


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    from pagedllm.model.tokenizer import Tokenizer

    directory = tmp_path_factory.mktemp("tok")
    make_tokenizer().save_pretrained(str(directory))
    tok = Tokenizer(str(directory))
    return StructuredOutputManager(tok, len(tok), [tok.eos_token_id], "llguidance")


def _compile_within_limits(manager, params: StructuredOutputsParams | dict) -> None:
    t0 = time.process_time()
    try:
        manager.compile(params if isinstance(params, StructuredOutputsParams) else StructuredOutputsParams(**params))
    except GrammarError as e:
        assert e.field and str(e).startswith(e.field), str(e)
    assert time.process_time() - t0 < CPU_LIMIT_S, params


_KEYWORDS = st.sampled_from(["type", "properties", "items", "required", "enum", "const", "pattern", "minLength",
                             "maxLength", "minItems", "maxItems", "anyOf", "allOf", "oneOf", "not", "$ref", "$defs",
                             "additionalProperties", "format", "minimum", "maximum", "prefixItems", "if", "then"])
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=8), st.sampled_from(["object", "string", "integer", "array", "#/$defs/a",
                                                          "#", "(a|a)*b", "date-time", 10**6]))
_SCHEMAS = st.recursive(_VALUES, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(_KEYWORDS | st.text(max_size=4), inner,
                                                                         max_size=5)), max_leaves=25)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(schema=_SCHEMAS)
def test_fuzzed_json_schemas(manager, schema):
    _compile_within_limits(manager, {"json": schema if isinstance(schema, dict) else json.dumps(schema)})


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(regex=st.text(alphabet="ab(|)*+?{}[]^$\\.0123456789,-", max_size=30))
def test_fuzzed_regexes(manager, regex):
    _compile_within_limits(manager, {"regex": regex})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(grammar=st.text(alphabet="start:=|\"ab()*+?;\n x", max_size=40))
def test_fuzzed_grammars(manager, grammar):
    _compile_within_limits(manager, {"grammar": grammar})


@pytest.mark.parametrize("params", [
    StructuredOutputsParams(json=json.loads('{"type": "array", "items": ' * 300 + "{}" + "}" * 300)),
    StructuredOutputsParams(json={"type": "string", "pattern": "(a{1000}){1000}"}),
    StructuredOutputsParams(json={"type": "array", "minItems": 10**9, "items": {"type": "integer"}}),
    StructuredOutputsParams(json={"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)},
                                  "required": [f"p{i}" for i in range(3000)]}),
    StructuredOutputsParams(json={"$ref": "#"}),
    StructuredOutputsParams(regex="((a|b)*)*c{1000}"),
    StructuredOutputsParams(choice=["x" * 10000] * 50),
])
def test_hostile_constraints(manager, params):
    _compile_within_limits(manager, params)
