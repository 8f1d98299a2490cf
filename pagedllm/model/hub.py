"""Model names as users give them: a path, None (the default), an embedded model's name (embedded.py), or a
Hugging Face hub id that is already in the local HF cache (no download is ever attempted)."""

from __future__ import annotations

import os

from pagedllm.model.embedded import EMBEDDED, default_model_path, embedded_model_path


def resolve_model_path(model: str | None) -> str:
    if model is None:
        return default_model_path()
    if model in EMBEDDED:
        return embedded_model_path(model)
    path = os.path.expanduser(model)
    if os.path.exists(path) or model.count("/") != 1 or model.startswith((".", "/", "~")):
        return path  # a path (the loader reports a missing one)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(model, local_files_only=True)
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(f"model {model!r} is neither a path nor a hub id in the local Hugging Face cache "
                                f"({os.environ.get('HF_HUB_CACHE') or '~/.cache/huggingface/hub'}); nothing is "
                                f"downloaded: pass a local directory or .gguf file") from e
