"""How a checkpoint says it pools: sentence-transformers' modules, a GGUF's pooling_type, else last + normalise."""

from __future__ import annotations

import json

import pytest
from tiny_models import add_sentence_transformers_files

from pagedllm.model.pooling_config import PoolingConfig, resolve_pooling_config


@pytest.mark.parametrize(("pooling", "normalize", "want"), [
    ("lasttoken", True, PoolingConfig("LAST", True)), ("mean_tokens", False, PoolingConfig("MEAN", False)),
    ("cls_token", True, PoolingConfig("CLS", True)), (None, False, PoolingConfig("LAST", False))])
def test_sentence_transformers_modules(tmp_path, pooling, normalize, want):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    assert resolve_pooling_config(str(add_sentence_transformers_files(tmp_path, pooling, normalize))) == want


def test_two_pooling_modes_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    add_sentence_transformers_files(tmp_path, "mean_tokens")
    config = json.loads((tmp_path / "1_Pooling" / "config.json").read_text())
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({**config, "pooling_mode_cls_token": True}))
    with pytest.raises(ValueError, match="exactly one"):
        resolve_pooling_config(str(tmp_path))


def test_no_modules_is_last_token_normalised(tmp_path):
    assert resolve_pooling_config(str(tmp_path)) == PoolingConfig("LAST", True)


@pytest.mark.parametrize(("value", "want"), [(None, "LAST"), (0, "LAST"), (1, "MEAN"), (2, "CLS"), (3, "LAST")])
def test_gguf_pooling_type(tmp_path, value, want):
    gguf = pytest.importorskip("gguf")
    path = str(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(path, "qwen3")
    if value is not None:
        writer.add_pooling_type(gguf.PoolingType(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert resolve_pooling_config(path) == PoolingConfig(want, True)
