"""The one exception a model file that cannot be used raises: the CLI and the server print it as one line."""

from __future__ import annotations


class InvalidModelError(ValueError):
    """A checkpoint that is damaged, hostile or inconsistent (or, as the subclass UnsupportedModelError, valid
    but beyond what pagedllm implements). The message names the file and the field at fault."""

    def __init__(self, detail: str, *, path: str | None = None, field: str | None = None) -> None:
        self.detail, self.path, self.field = detail, path, field
        super().__init__(self._message())

    def _message(self) -> str:
        return ": ".join(p for p in (self.path, self.field, self.detail) if p)

    def with_path(self, path: str) -> InvalidModelError:
        """This error naming `path` too (config parsing raises before it knows which file it reads)."""
        if self.path is None:
            self.path = path
            self.args = (self._message(),)
        return self

    def __str__(self) -> str:
        return self.args[0] if self.args else self._message()


class UnsupportedModelError(InvalidModelError):
    """The checkpoint is valid but uses an architecture or feature pagedllm does not implement."""
