"""The default model: Qwen2.5-Coder-0.5B-Instruct, assembled once from its chunk packages, checked before use, and
right on the prompts `make run` asks."""

from __future__ import annotations

import logging
import re

import pytest

from pagedllm.model import embedded
from pagedllm.model.embedded import DEFAULT_MODEL, EMBEDDED, PackagedModel, embedded_model_path


def _fake_chunked(tmp_path, monkeypatch, pieces: list[bytes], size: int, sha256: str) -> str:
    """A chunked model of fake packages (one data/*.bin piece each), registered under a name of its own."""
    packages = []
    for i, data in enumerate(pieces):
        (tmp_path / f"pkg{i}" / "data").mkdir(parents=True)
        (tmp_path / f"pkg{i}" / "data" / f"part{i:02d}.bin").write_bytes(data)
        packages.append(f"pkg{i}")
    monkeypatch.setattr(embedded, "_package_dir", lambda package, model: tmp_path / package)
    monkeypatch.setitem(EMBEDDED, "fake", PackagedModel(tuple(packages), "fake-part1 fake-part2", "fake.gguf",
                                                        size, sha256))
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    return "fake"


def test_chunks_are_assembled_once_and_checked(tmp_path, monkeypatch, caplog):
    import hashlib

    pieces = [bytes(range(256)) * 3, b"GGUF tail"]
    whole = b"".join(pieces)
    name = _fake_chunked(tmp_path, monkeypatch, pieces, len(whole), hashlib.sha256(whole).hexdigest())
    with caplog.at_level(logging.WARNING, logger=embedded.__name__):
        path = embedded_model_path(name)
    assert open(path, "rb").read() == whole
    assert any("assembling fake.gguf" in r.message for r in caplog.records)
    caplog.clear()
    mtime = (tmp_path / "cache" / "models" / "fake.gguf").stat().st_mtime_ns
    with caplog.at_level(logging.WARNING, logger=embedded.__name__):
        assert embedded_model_path(name) == path  # the second use reuses the file, silently
    assert not caplog.records and (tmp_path / "cache" / "models" / "fake.gguf").stat().st_mtime_ns == mtime


def test_a_file_that_is_not_the_promised_one_is_one_line_and_not_kept(tmp_path, monkeypatch):
    name = _fake_chunked(tmp_path, monkeypatch, [b"abc", b"def"], 6, "0" * 64)
    with pytest.raises(embedded.ModelFileMismatch) as e:
        embedded_model_path(name)
    assert "\n" not in str(e.value) and "expected 6 bytes with sha256 " + "0" * 64 in str(e.value)
    assert not list((tmp_path / "cache" / "models").iterdir())  # neither the file nor a partial one


def test_a_damaged_cached_file_is_assembled_again(tmp_path, monkeypatch):
    import hashlib

    whole = b"0123456789"
    name = _fake_chunked(tmp_path, monkeypatch, [whole[:4], whole[4:]], 10, hashlib.sha256(whole).hexdigest())
    path = embedded_model_path(name)
    with open(path, "r+b") as f:  # same size, other bytes, stamp now stale
        f.write(b"X")
    assert open(embedded_model_path(name), "rb").read() == whole


def test_missing_packages_name_what_to_install(monkeypatch):
    monkeypatch.setitem(EMBEDDED, "absent", PackagedModel(("no_such_package_x1", "no_such_package_x2"),
                                                          "absent-part1 absent-part2", "absent.gguf", 1, "0"))
    with pytest.raises(FileNotFoundError, match="absent-part1 absent-part2"):
        embedded_model_path("absent")


def _primes_above_ten(text: str) -> tuple[list[int], list[int]]:
    """(the primes above 10 in `text`, every number in it but 10)"""
    numbers = [int(n) for n in re.findall(r"\d+", text) if int(n) != 10]  # 10: the prompt's own number
    return [n for n in numbers if n > 10 and all(n % d for d in range(2, int(n ** 0.5) + 1))], numbers


@pytest.mark.slow
def test_make_run_answers_right():
    """What `make run` asks the default model (the real file, from its packages, as stored), greedy."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.cli import DEFAULT_PROMPTS

    path = embedded_model_path(DEFAULT_MODEL)
    llm = LLM(path, max_model_len=512)
    prompts = [p for p in DEFAULT_PROMPTS if "France" in p or "prime" in p]
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], SamplingParams(temperature=0, max_tokens=64))
    france, primes = (o.outputs[0].text for o in outs)
    assert "Paris" in france, france
    found, numbers = _primes_above_ten(primes)
    assert len(set(found)) >= 3 and found == numbers, primes  # three primes above 10, and no other number
