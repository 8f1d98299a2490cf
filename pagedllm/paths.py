"""Where pagedllm keeps files between runs (built kernels, GGUF tokenizers): one directory per user."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$PAGEDLLM_CACHE_DIR, else ~/.cache/pagedllm."""
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")
    return Path(root)
