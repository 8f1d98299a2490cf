"""The llama.cpp-family peers the benches drive: how each is built for the CPU (the CMake flags from the cpuinfo
flags) and where each one's binaries are looked up (ik_llama.cpp only in the bench build, never a PATH llama.cpp)."""

from __future__ import annotations

import os
import stat
import sys

from pagedllm_bench import common
from pagedllm_bench.llama_build import cmake_flags
from pagedllm_bench.serving import PEER_SERVERS, LlamaServer

SPR = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512dq", "avx512vl",
       "avx512cd", "avx512vbmi", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"}


def test_each_instruction_set_the_cpu_has_is_named_and_amx_stays_off():
    flags = cmake_flags(SPR)
    assert "-DGGML_NATIVE=OFF" in flags
    for opt in ("AVX2", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI"):
        assert f"-DGGML_{opt}=ON" in flags, opt  # avx512vbmi: cpuinfo's spelling has no underscore
    assert "-DGGML_AMX_INT8=OFF" in flags and "-DGGML_AMX_TILE=OFF" in flags
    zen3 = cmake_flags({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
    assert "-DGGML_AVX2=ON" in zen3 and "-DGGML_AVX512=OFF" in zen3 and "-DGGML_AVX512_VNNI=OFF" in zen3
    assert cmake_flags(SPR, native=True)[0] == "-DGGML_NATIVE=ON"  # ik_llama.cpp: native plus each option


def _fake_tool(directory, name: str) -> str:
    path = os.path.join(directory, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write("#!/bin/sh\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path


def test_peer_binaries_are_found_by_prefix_and_ik_never_falls_back_to_path(tmp_path, monkeypatch):
    bin_dir = tmp_path / "venv-bin"
    bin_dir.mkdir()
    path_dir = tmp_path / "on-path"
    path_dir.mkdir()
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", str(path_dir))
    on_path = _fake_tool(path_dir, "llama-server")
    assert common.LLAMA_CPP.tool("llama-server") == on_path
    assert common.IK_LLAMA.tool("llama-server") is None  # a PATH llama-server is llama.cpp's, not ik's
    ours = _fake_tool(bin_dir, "llama-server")
    ik = _fake_tool(bin_dir, "ik-llama-server")
    assert common.LLAMA_CPP.tool("llama-server") == ours
    assert common.IK_LLAMA.tool("llama-server") == ik == common.IK_LLAMA_RTR.tool("llama-server")
    (bin_dir / "ik-llama.commit").write_text("8337e4cd3861406fc04e0854b1409cd1b027fbc9\n")
    assert common.IK_LLAMA.version() == "8337e4cd3861406fc04e0854b1409cd1b027fbc9"


def test_each_peer_server_runs_its_own_binary_with_its_own_arguments(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    for name in ("llama-server", "ik-llama-server"):
        _fake_tool(bin_dir, name)
    cmds = {system: LlamaServer("m.gguf", 2, 4, 512, ["--extra"], peer=peer).command()
            for system, peer in PEER_SERVERS.items()}
    assert cmds["llama-server"][0].endswith("/llama-server") and "--no-webui" in cmds["llama-server"]
    for system in ("ik-llama-server", "ik-llama-server-rtr"):
        assert cmds[system][0].endswith("/ik-llama-server") and "--no-webui" not in cmds[system]
        assert cmds[system][cmds[system].index("--webui") + 1] == "none"
    assert "-rtr" in cmds["ik-llama-server-rtr"] and "-rtr" not in cmds["ik-llama-server"]
    for cmd in cmds.values():
        assert cmd[-1] == "--extra" and cmd[cmd.index("-c") + 1] == str(4 * 512)


def test_both_peers_final_perplexity_lines_are_read():
    from pagedllm_bench.perplexity import _FINAL

    llama = "Final estimate: PPL = 24.7532 +/- 1.20111"
    ik = "Final estimate: PPL over 8 chunks for n_ctx=512 = 24.1234 +/- 0.50000"
    assert [float(_FINAL.search(t).group(1)) for t in (llama, ik)] == [24.7532, 24.1234]
