"""How a checkpoint says it pools: sentence-transformers' modules, a GGUF's pooling_type, else last + normalise."""

from __future__ import annotations

import json

import pytest

from pagedllm.model.pooling_config import PoolingConfig, resolve_pooling_config


def _st_dir(tmp_path, pooling: str | None, normalize: bool):
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
             "pooling_mode_lasttoken": pooling == "last"}))
    if normalize:
        modules.append({"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    return str(tmp_path)


@pytest.mark.parametrize(("pooling", "normalize", "want"), [
    ("last", True, PoolingConfig("LAST", True)), ("mean", False, PoolingConfig("MEAN", False)),
    ("cls", True, PoolingConfig("CLS", True)), (None, False, PoolingConfig("LAST", False))])
def test_sentence_transformers_modules(tmp_path, pooling, normalize, want):
    assert resolve_pooling_config(_st_dir(tmp_path, pooling, normalize)) == want


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
