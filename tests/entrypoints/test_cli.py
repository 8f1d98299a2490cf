"""The CLI: generate prints outputs and a summary; chat streams and keeps the conversation."""

from __future__ import annotations

import io

from tiny_models import make_llm, make_tiny_model

from pagedllm.cli import main
from pagedllm.entrypoints.chat_session import run_chat
from pagedllm.sampling_params import SamplingParams


def test_generate_prints_outputs_and_summary(tmp_path, capsys):
    model = make_tiny_model(tmp_path / "m")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\nPaged attention\n", encoding="utf-8")
    rc = main(["generate", "--model", str(model), "--file", str(prompts), "Copy on write", "--dtype", "float32",
               "--max-tokens", "8", "--ignore-eos", "--num-kv-blocks", "64", "--block-size", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    for p in ("The quick brown fox", "Paged attention", "Copy on write"):
        assert f"### Prompt: {p!r}" in out
    assert out.count("(8 tokens, finish_reason=length)") == 3
    assert "output tok/s" in out and "KV blocks:" in out and "preemptions 0" in out
    assert "mean slot utilisation 0.0%" not in out  # sampled while requests ran, not after they finished


def test_chat_keeps_the_conversation(tmp_path):
    llm = make_llm(make_tiny_model(tmp_path / "m"))
    seen: list[list[dict]] = []
    original = llm.engine.apply_chat_template

    def spy(messages):
        seen.append([dict(m) for m in messages])
        return original(messages)

    llm.engine.apply_chat_template = spy
    stdin = io.StringIO("Hello there\nAnd again\n\n")
    out = io.StringIO()
    assert run_chat(llm.engine, SamplingParams(temperature=0, max_tokens=6), system="Be brief", stdin=stdin,
                    out=out) == 0
    assert [m["role"] for m in seen[1]] == ["system", "user", "assistant", "user"]
    assert seen[1][1]["content"] == "Hello there" and seen[1][3]["content"] == "And again"
    assert seen[1][2]["content"] in out.getvalue()  # the first reply was streamed to the terminal
    stats = llm.kv_cache_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_serve_flags_as_vllm():
    """`pagedllm serve MODEL` with vLLM's flag spellings; the old spellings still parse; every flag has help."""
    import argparse

    from pagedllm.cli import build_parser
    from pagedllm.engine.args import EngineArgs
    from pagedllm.entrypoints.openai.server import read_chat_template

    parser = build_parser()
    a = parser.parse_args(["serve", "some/model", "--no-enable-prefix-caching", "--enable-chunked-prefill",
                           "--api-key", "k1", "--api-key", "k2", "--served-model-name", "a", "b",
                           "--allowed-origins", '["http://x.test", "http://y.test"]', "--threads", "1",
                           "--enable-log-requests", "--chat-template", "{{ messages }}"])
    args = EngineArgs.from_cli_args(a)
    assert (args.model, args.enable_prefix_caching, args.enable_chunked_prefill) == ("some/model", False, True)
    assert a.api_key == ["k1", "k2"] and a.served_model_name == ["a", "b"] and a.enable_log_requests
    assert [o for g in a.allowed_origins for o in g] == ["http://x.test", "http://y.test"]
    assert read_chat_template(a.chat_template) == "{{ messages }}"
    import torch

    assert torch.get_num_threads() == 1
    old = parser.parse_args(["serve", "--model", "m", "--no-prefix-caching", "--no-chunked-prefill"])
    args = EngineArgs.from_cli_args(old)
    assert (args.model, args.enable_prefix_caching, args.enable_chunked_prefill) == ("m", False, False)
    assert parser.parse_args(["serve"]).log_level is None  # serve then logs at INFO (main picks the level)
    sub = next(x for x in parser._actions if isinstance(x, argparse._SubParsersAction))
    for name in ("serve", "generate", "chat"):
        for action in sub.choices[name]._actions:
            if action.option_strings and action.help != argparse.SUPPRESS and "-h" not in action.option_strings:
                assert action.help, f"{name} {action.option_strings} has no help"


def test_chat_line_editing_keeps_history(tmp_path, monkeypatch):
    """On a terminal, `pagedllm chat` reads lines through readline and keeps its history across sessions."""
    readline = __import__("pytest").importorskip("readline")
    import sys

    from pagedllm.entrypoints.chat_session import line_editing

    history = str(tmp_path / "hist")
    monkeypatch.setattr(sys, "stdin", io.StringIO())
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)
    with line_editing(history) as editing:
        assert not editing  # piped input: plain reads
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    readline.clear_history()
    with line_editing(history) as editing:
        assert editing
        readline.add_history("what is paging?")
    readline.clear_history()
    with line_editing(history):
        assert readline.get_history_item(readline.get_current_history_length()) == "what is paging?"


def test_bench_blocks_quick_runs_through_the_cli(capsys):
    # README documents `pagedllm bench <name> --quick` for every bench, blocks included
    assert main(["bench", "blocks", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "| 1,000 blocks | 10,000 blocks |" in out and "| decode step (per call) |" in out
