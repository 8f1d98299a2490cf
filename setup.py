"""Builds the C++ kernels when the package is installed (`pip install .`, `pip install -e .`, `pip wheel .`).

One extension per build variant (pagedllm/kernels/variants.py), each from all of csrc/ with that variant's ISA flags,
with torch's BuildExtension (ninja, torch's headers and ABI flags). Which variants: $PAGEDLLM_KERNEL_VARIANTS, else
the best one this CPU runs plus avx2 and portable. Everything else is in pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("_variants", ROOT / "pagedllm" / "kernels" / "variants.py")
variants = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(variants)


class BuildVariants(BuildExtension):
    """BuildExtension with one object directory per variant, build/kernels/<variant> in this tree (every variant
    compiles the same sources, whose objects would otherwise overwrite each other's; kept between builds, so that
    `pip install -e .` after an edit of csrc/ recompiles only what changed, and `pip wheel .` after it only
    packs), and only the compiler flags a first-use build has: Python's own CFLAGS add -g (debug information: more
    compiling, a larger library), -DNDEBUG and -fwrapv."""

    def build_extensions(self) -> None:
        self.compiler.set_executable("compiler_so", [self.compiler.compiler_so[0], "-fPIC"])
        super().build_extensions()

    def build_extension(self, ext) -> None:
        shared_temp = self.build_temp
        variant = ext.name.rsplit(".", 1)[-1].removeprefix(variants.LIBRARY_PREFIX).rsplit("_", 1)[0]
        self.build_temp = str(ROOT / "build" / "kernels" / variant)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = shared_temp


def extensions() -> list[CppExtension]:
    """One extension per variant to build, named by its sources' digest (variants.library_stem): the run time tells
    an up-to-date library from a stale one by its name. The stale ones an editable tree holds are removed."""
    names = variants.install_variants(variants.cpu_flags(), os.environ.get(variants.INSTALL_VARIANTS_ENV))
    current = {variants.library_stem(name) for name in variants.VARIANT_NAMES}
    for built in variants.CSRC.parent.glob(variants.LIBRARY_PREFIX + "*"):
        if built.name.split(".", 1)[0] not in current:
            built.unlink()
    sources = [str(p.relative_to(ROOT)) for p in variants.cpp_sources()]
    return [CppExtension(f"pagedllm.kernels.{variants.library_stem(name)}", sources,
                         extra_compile_args=[*variants.CXX_FLAGS, *variants.isa_flags(name)],
                         extra_link_args=variants.LD_FLAGS, py_limited_api=False)
            for name in names]


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildVariants})
