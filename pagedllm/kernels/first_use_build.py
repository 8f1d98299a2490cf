"""The explicit fallback for a source tree with no up-to-date built kernels ($PAGEDLLM_BUILD_KERNELS=1, kernel
development): compile csrc/ at first use with torch.utils.cpp_extension, as setup.py would, into a cache directory.

The directory is keyed by the variant, the sources' digest and the source tree's path, so two checkouts never
build into (or rebuild) each other's directory. One builder at a time holds build_lock.py's lock, which dies with
its holder: a start after an interrupted one takes the build over, and while a live builder works the others say
every few seconds whom they wait for. $PAGEDLLM_KERNEL_DEV=1 keeps one directory per tree and variant, so that
ninja recompiles only the changed sources.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

from pagedllm.kernels.build_lock import build_lock
from pagedllm.kernels.variants import (
    BUILD_ENV,
    CSRC,
    CXX_FLAGS,
    LD_FLAGS,
    cpp_sources,
    isa_flags,
    source_digest,
)
from pagedllm.paths import cache_dir

logger = logging.getLogger(__name__)


def _build_dir(name: str) -> Path:
    build_dir = cache_dir() / "cpu_kernel" / name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError:  # read-only home (some CI runners): a per-user temp dir
        build_dir = Path(tempfile.gettempdir()) / f"pagedllm-{os.getuid()}" / "cpu_kernel" / name
        build_dir.mkdir(parents=True, exist_ok=True)
    return build_dir


def first_use_build(variant: str) -> Path:
    """Build variant `variant` from csrc/ (or find it built) and return its library's path."""
    from torch.utils import cpp_extension

    tree = hashlib.sha256(str(CSRC.resolve()).encode()).hexdigest()[:8]
    name = f"pagedllm_cpu_{variant}_" + ("dev" if os.environ.get("PAGEDLLM_KERNEL_DEV") else source_digest(variant))
    build_dir = _build_dir(f"{name}_{tree}")
    library = build_dir / f"{name}.so"
    with build_lock(build_dir / "builder.lock", f"the C++ kernels' build ({variant}) in {build_dir}"):
        # we hold the only lock that builds here: a torch lock file left in the directory is a dead builder's
        (build_dir / "lock").unlink(missing_ok=True)
        logger.warning("%s=1: building the C++ kernels (%s) from %s in %s (minutes on a small machine; ninja "
                       "skips what is up to date)", BUILD_ENV, variant, CSRC, build_dir)
        cpp_extension.load(name=name, sources=[str(p) for p in cpp_sources()],
                           build_directory=str(build_dir), is_python_module=False,
                           extra_cflags=[*CXX_FLAGS, *isa_flags(variant)], extra_ldflags=LD_FLAGS, verbose=False)
    return library
