"""The KV cache manager's errors. Every one is raised before any change: the pool is unchanged."""

from __future__ import annotations


class KVCacheManagerError(Exception):
    """Base of the manager's errors. Every one is raised before any change: the pool is unchanged."""


class UnknownRequestError(KVCacheManagerError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DoubleFreeError(UnknownRequestError):
    """free() of a request that was already freed."""


class RequestExistsError(KVCacheManagerError, ValueError):
    """fork() into a request id that already holds blocks."""


class NegativeTokenCountError(KVCacheManagerError, ValueError):
    pass


class ContextTooLongError(KVCacheManagerError, ValueError):
    """The contiguous layout cannot hold more than its max_model_len reservation."""


class InvalidComputedBlocksError(KVCacheManagerError, ValueError):
    """new_computed_blocks that do not match the request's prefix (stale lookup, wrong request...)."""


class InconsistentRequestError(KVCacheManagerError, ValueError):
    """request.num_computed_tokens does not fit the request's block table."""
