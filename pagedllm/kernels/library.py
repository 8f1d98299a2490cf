"""Loads the C++ kernels (csrc/) as torch.ops.pagedllm_cpu: the build variant for this CPU, compiled when the
package was installed (setup.py), so running the engine never invokes a compiler.

The variant is the best one /proc/cpuinfo allows (variants.py), or $PAGEDLLM_KERNEL_VARIANT. Its library is
pagedllm/kernels/_pagedllm_cpu_<variant>_<digest>.<suffix>, named by the digest of the sources it was built from;
one with another digest (kernels edited after `pip install -e .`) is stale.
A missing or stale library is one clear error naming the variant and how to build it, unless
$PAGEDLLM_BUILD_KERNELS=1 asks for the first-use build (first_use_build.py; kernel development). Callers that
cannot do without the kernels (the "cpu" attention backend) see the error; the others (dispatch.kernel_op) get None
and keep a torch path.
"""

from __future__ import annotations

import importlib.machinery
import logging
import os
import threading
from pathlib import Path

import torch

from pagedllm.kernels.variants import (
    BUILD_ENV,
    INSTALL_VARIANTS_ENV,
    LIBRARY_PREFIX,
    MATRIX_ENGINE_ENV,
    VARIANT_ENV,
    build_variant,
    library_stem,
)

logger = logging.getLogger(__name__)

LIBRARY_DIR = Path(__file__).parent
_lock = threading.Lock()
_ops = None
_load_error: Exception | None = None


class KernelsNotBuilt(RuntimeError):
    """The installed package has no up-to-date library for this CPU's variant."""


def native_bf16() -> bool:
    """Whether the kernels this process loads compute bf16 in hardware (else bf16 is converted in software)."""
    return "bf16" in build_variant(forced=os.environ.get(VARIANT_ENV))[0]


def installed_library(variant: str) -> Path | None:
    """The library `pip install` built for `variant` from the sources as they are now, if there is one."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = LIBRARY_DIR / f"{library_stem(variant)}{suffix}"
        if path.exists():
            return path
    return None


def _stale_library(variant: str) -> Path | None:
    """A library built for `variant` from other sources than csrc/ holds now (kernels edited since the install)."""
    return next(iter(sorted(LIBRARY_DIR.glob(f"{LIBRARY_PREFIX}{variant}_*"))), None)


def _wants_first_use_build() -> bool:
    return os.environ.get(BUILD_ENV, "").lower() in ("1", "true", "yes", "on")


def library_for(variant: str) -> Path:
    """The library to load for `variant`: the installed one where it is up to date; else, with
    $PAGEDLLM_BUILD_KERNELS=1, one built now; else KernelsNotBuilt, in one line."""
    library = installed_library(variant)
    if library is not None:
        return library
    if _wants_first_use_build():
        from pagedllm.kernels.first_use_build import first_use_build

        return first_use_build(variant)
    state = "were built from other sources than csrc/ holds now" if _stale_library(variant) else "are not built"
    raise KernelsNotBuilt(
        f"pagedllm's C++ kernels for this CPU (variant {variant}) {state}: reinstall the package (`make install`, or "
        f"`pip install -e .` in the source tree; {INSTALL_VARIANTS_ENV}=all builds every variant), "
        f"or set {BUILD_ENV}=1 to build them at first use")


def load_ops():
    """Load the kernels once per process; returns the torch.ops namespace. Raises if they cannot be loaded (and
    again on later calls, without retrying)."""
    global _ops, _load_error
    with _lock:
        if _ops is not None:
            return _ops
        if _load_error is not None:
            raise RuntimeError(f"the C++ kernels failed to load earlier: {_load_error}") from _load_error
        try:
            variant, _isa = build_variant(forced=os.environ.get(VARIANT_ENV) or None)
            library = library_for(variant)
            torch.ops.load_library(str(library))
            _ops = torch.ops.pagedllm_cpu
            if os.environ.get(MATRIX_ENGINE_ENV) == "0":
                _ops.set_matrix_engine(False)
            logger.info("C++ kernels loaded (%s, %s)", variant, library)
            return _ops
        except Exception as e:  # not built, stale, a first-use build that failed, a library that does not load
            _load_error = e
            raise
