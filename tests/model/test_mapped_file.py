"""A weight file truncated or rewritten under a running engine: the engine owns every weight once loaded (the
matrices it repacks and the ones it keeps as stored alike), so it keeps generating the same tokens instead of
dying of SIGBUS on its next step. Run in a child process: a regression would kill the test process otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from tiny_models import fresh_seed

from pagedllm.quantization.tensor import kernel_available
from pagedllm.testing.gguf_writer import ModelShape, write_random_gguf

CHILD = textwrap.dedent("""
    import os, random, sys
    from pagedllm import LLM, SamplingParams
    path, how, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=16, quantization="auto")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    if how == "truncate":
        os.truncate(path, 0)
    else:  # the same size, other bytes
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.write(random.Random(seed).randbytes(size))
    after = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    print("SAME" if after == before else f"DIFFERENT {before} {after}")
""")


@pytest.mark.skipif(not kernel_available(), reason="the quantized kernel (as-stored weights) is not built here")
@pytest.mark.parametrize("how", ["truncate", "rewrite"])
def test_engine_survives_its_file_changing(tmp_path, how):
    path = str(tmp_path / "m.gguf")
    # Q6_K matrices run as stored, never repacked: the case that read the mapping at every step
    write_random_gguf(path, ModelShape("llama", 2, 256, 512, 4, 2, 64, context=256), "Q6_K")
    r = subprocess.run([sys.executable, "-c", CHILD, path, how, str(fresh_seed())], capture_output=True,
                       text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.strip().endswith("SAME"), r.stdout
