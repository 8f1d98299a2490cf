"""Helpers for tests and `pagedllm bench make-model`: random-weight GGUF files of any shape and type."""
