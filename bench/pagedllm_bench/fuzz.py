"""Fuzz soak: hostile GGUF variants and chat templates for N minutes (`pagedllm bench fuzz --minutes 10`).

The oracles are the test suite's (tests/model/test_fuzz_gguf.py, tests/templating/test_hostile_templates.py),
run longer and with fresh seeds: each GGUF variant loads as the original or raises InvalidModelError naming
the file within 2 s of CPU and 200 MB; each template renders or fails with a ValueError within the sandbox's
limits. A failing case is saved (the variant file, or the template text) under --out with its seed, to become
a regression test. Exit status 1 when any case failed."""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import tempfile
import time

from pagedllm_bench.fuzz_gguf import (
    MUTATIONS,
    OracleFailure,
    check_variant,
    load_summary,
    mutate,
    write_tiny_gguf,
)

# fragments hostile templates are made of (tests/templating/test_hostile_templates.py draws them too)
TEMPLATE_PIECES = [
    "{{ m['content'] }}", "{{ x }}", "{{ 'ab' * n }}", "{{ n ** k }}", "{% for i in range(n) %}", "{% endfor %}",
    "{% for c in m['content'] %}", "{% set x = x ~ x %}", "{{ raise_exception('no') }}", "{{ ''.__class__ }}",
    "{{ x|center(n) }}", "{{ '%*d' % (n, 1) }}", "{% macro f(a) %}{{ f(a) }}{% endmacro %}", "{{ f(1) }}",
    "{% if n > k %}", "{% endif %}", "{{ messages|tojson }}", "{{ k / 0 }}", "{{ namespace(_a=1) }}", "text",
    "{{ n * k }}", "{{ messages|length }}", "{{ m.__dict__ }}", "{{ x|upper|replace('A', 'BB') }}",
    "{{ (n|string) * k }}", "{% for m in messages %}", "{{ bos_token }}", "{{ {}[x] }}", "{{ m|items|list }}",
]
TEMPLATE_SIZES = ([0, 3, 10**5, 10**9], [1, 7, 10**6])  # the values of n and k


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=1.0, help="how long to run")
    p.add_argument("--seed", type=int, default=None, help="first seed (default: random, printed)")
    p.add_argument("--out", default=None, help="directory for failing cases (default: a new temp directory)")
    p.add_argument("--template-share", type=float, default=0.1, help="fraction of cases that are templates")


def template_of(pieces: list[str], n: int, k: int) -> str:
    """A template running `pieces` once per message, with n, k and x set."""
    return f"{{% set n = {n} %}}{{% set k = {k} %}}{{% set x = 'ab' %}}{{% for m in messages %}}{''.join(pieces)}" \
           "{% endfor %}"


def random_template(rng: random.Random) -> str:
    pieces = [rng.choice(TEMPLATE_PIECES) for _ in range(rng.randint(0, 10))]
    return template_of(pieces, rng.choice(TEMPLATE_SIZES[0]), rng.choice(TEMPLATE_SIZES[1]))


def check_template(sandbox, template: str) -> str:
    from pagedllm.templating.sandbox import render_chat_template

    class _Tok:
        special_tokens_map = {"bos_token": "<s>"}
        chat_template = template

    try:
        text = render_chat_template(_Tok(), [{"role": "user", "content": "hello"}], sandbox=sandbox)
    except ValueError:
        return "refused"
    except Exception as e:
        raise OracleFailure(f"not a ValueError: {type(e).__name__}: {e}") from e
    if len(text) > sandbox.max_chars:
        raise OracleFailure(f"output of {len(text)} characters passed the limit")
    return "rendered"


def run(args: argparse.Namespace) -> None:
    import torch

    from pagedllm.templating.sandbox import TemplateSandbox

    torch.set_num_threads(1)  # the CPU bound is the loading thread's
    seed = args.seed if args.seed is not None else random.randrange(1 << 62)
    out = args.out or tempfile.mkdtemp(prefix="pagedllm-fuzz-")
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="pagedllm-fuzz-work-")
    original = os.path.join(work, "original.gguf")
    write_tiny_gguf(original, seed=seed % 1000)
    with open(original, "rb") as f:
        data = f.read()
    ref = load_summary(original)
    sandbox = TemplateSandbox(timeout=1.0, max_chars=1 << 20)
    tally: collections.Counter = collections.Counter()
    failures = 0
    print(f"fuzz: seed {seed}, {args.minutes:g} min, failing cases go to {out}")
    end = time.monotonic() + 60 * args.minutes
    i = 0
    variant_path = os.path.join(work, "variant.gguf")
    try:
        while time.monotonic() < end:
            case_seed, i = seed + i, i + 1
            rng = random.Random(case_seed)
            case: bytes | str = b""
            try:
                if rng.random() < args.template_share:
                    case = random_template(rng)
                    tally[("template", check_template(sandbox, case))] += 1
                else:
                    kind = rng.choice(MUTATIONS)
                    case, _ = mutate(data, rng, kind)
                    with open(variant_path, "wb") as f:
                        f.write(case)
                    tally[(kind, check_variant(variant_path, ref).result)] += 1
            except OracleFailure as e:
                failures += 1
                saved = os.path.join(out, f"case-{case_seed}")
                with open(saved + (".jinja" if isinstance(case, str) else ".gguf"), "wb") as f:
                    f.write(case.encode() if isinstance(case, str) else case)
                with open(saved + ".json", "w") as f:
                    json.dump({"seed": case_seed, "error": str(e)}, f)
                print(f"FAIL seed {case_seed}: {e}")
    finally:
        sandbox.close()
    print(f"{i} cases: " + ", ".join(f"{k}/{r} {n}" for (k, r), n in sorted(tally.items())))
    print(f"{failures} failures")
    if failures:
        raise SystemExit(1)
