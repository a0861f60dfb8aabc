"""Peer engines in `dflash2 bench --engines`: the same target, drafters and prompts through other MLX DFlash
engines, so a user sees on their own machine which engine is fastest, under the same lossless check.

- `dflash` (PyPI 0.1.0, the authors' reference, `dflash.model_mlx`): v1 and DFlash 2 drafters on any
  mlx-lm target. Its `load_draft` takes hub ids only: it is given one that resolves, offline, to a hub cache
  built here (HF_HUB_CACHE + HF_HUB_OFFLINE=1), so its own loader runs unmodified.
- `dflash-mlx` (PyPI 0.1.8, oMLX's engine, `dflash_mlx.runtime`): local folders; Qwen GatedDeltaNet and
  Gemma 4 targets only. A pair it cannot run gets a row with its reason.

Each engine runs in its own process per drafter (`peer_worker.py`): the authors' engine wraps the target's
layers for good, and a peer may live in another interpreter (`--peer-python`: a venv with its pinned
dependencies, away from the bench's). The workers stay up for the whole bench, so their runs interleave
with ours trial by trial, as every other method does.

What the peers load is written once into a temporary folder: the target as an mlx-lm folder (a GGUF target
is converted in the bench's dtype) and each drafter in the published layout, in float32 (what ours runs on
CPUs), with a factorised path selector's codebooks expanded exactly (target embedding x projection, the
V x R tables the published layout holds). Neither peer has a draft vocabulary: they draft over the whole
vocabulary, and their rows say so.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

from dflash2_mlx.assets import default_target
from dflash2_mlx.convert import dequantized
from dflash2_mlx.formats.gguf import convert_gguf
from dflash2_mlx.formats.weights import hf_names, write_weights
from dflash2_mlx.loading import resolve_path
from dflash2_mlx.target import Target

ENGINES = {  # name -> what to install, for the message when it is missing
    "dflash": "dflash==0.1.0",
    "dflash-mlx": "dflash-mlx==0.1.8",
}
MLX = "mlx-lm (and mlx[cpu] on Linux)"  # the authors' package does not pull MLX in on Linux
HUB_OWNER = "dflash2-bench"
_COMMIT = "0" * 40


class PeerError(RuntimeError):
    """A peer engine that cannot run (not installed, refuses the pair, or failed): the row's reason."""


def parse_engines(text: str | None) -> list[str]:
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        raise ValueError(f"unknown engine(s) {unknown} for --engines; choose among {', '.join(ENGINES)}")
    return names


def check_python(python: str) -> str:
    path = Path(python).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ValueError(
            f"--peer-python {python}: no such interpreter; pass the python of an environment that "
            f"has the peers (e.g. a venv with `pip install {' '.join(ENGINES.values())}` and {MLX})"
        )
    return str(path)


class PeerWorker:
    """One engine with one drafter, in its own process (see `peer_worker.py` for the requests)."""

    def __init__(self, engine: str, python: str, env: dict, log: Path):
        self.engine, self.python, self.log = engine, python, log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [python, str(Path(__file__).with_name("peer_worker.py")), engine],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                text=True,
            )

    def request(self, **request) -> dict:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            tail = self.log.read_text().strip().splitlines()[-3:]
            raise PeerError(f"{self.engine} worker ({self.python}) exited: " + (" | ".join(tail) or "no output"))
        reply = json.loads(line)
        if "missing" in reply:
            raise PeerError(
                f"{self.engine} is not installed in {self.python} (no module {reply['missing']!r}): "
                f"`{self.python} -m pip install {ENGINES[self.engine]}` with {MLX}, or pass --peer-python with an "
                "environment that has it"
            )
        if "error" in reply:
            reason = " ".join(reply["error"].split())  # one line, however the engine formats it
            raise PeerError(f"{self.engine} cannot run this pair: {reason[:400]}{' ...' if len(reason) > 400 else ''}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def target_folder(model_arg: str | None, dtype: str | None, folder: Path) -> tuple[str, str | None]:
    """(an mlx-lm folder of the bench's target, the dtype the peer should cast it to): a GGUF target is
    converted as `load_target` reads it (float32 on CPUs unless --dtype says otherwise)."""
    source = str(model_arg or default_target())
    if source.endswith(".gguf"):
        if dtype is None and not mx.metal.is_available():
            dtype = "float32"
        return str(convert_gguf(resolve_path(source), folder / "target", dtype)), None
    return str(resolve_path(source, allow_patterns=DEFAULT_ALLOW_PATTERNS)), dtype


def published_drafter(drafter, model, source: str, out: Path) -> str:
    """`drafter` (loaded from the folder `source` and bound to `model`) in the published layout, float32, into
    `out`; a factorised selector's codebooks are expanded to V x R tables (the target's embedding of every
    token times the projection: the very codes ours computes per token). Returns what the row should say."""
    weights = {k: v.astype(mx.float32) for k, v in dequantized(drafter).items()}
    config = json.loads((resolve_path(source) / "config.json").read_text())
    config.pop("mlx", None)
    config.pop("quantization", None)
    dflash = config.setdefault("dflash_config", {})
    target = Target(model)
    notes = ["float32"]
    if dflash.pop("selector_factorized", False):
        table = target.embed_tokens(mx.arange(target.vocab_size)).astype(mx.float32)  # [V, D]
        for side in ("predecessor", "successor"):
            projection = weights.pop(f"candidate_selector.{side}_projection.weight")  # [R, D]
            weights[f"candidate_selector.{side}_codebook.weight"] = table @ projection.T
        mx.eval(weights)
        notes.append("selector codebooks expanded from the factorised form")
    if drafter.draft_vocab is not None:
        notes.append(
            f"drafts over all {target.vocab_size:,} tokens (no draft vocabulary; ours: {len(drafter.draft_vocab):,})"
        )
    # dflash-mlx's config loader requires these two; the drafter never has an LM head of its own
    config.update(
        dtype="float32", vocab_size=target.vocab_size, tie_word_embeddings=False, block_size=drafter.config.block_size
    )
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_weights(out, hf_names(weights, drafter.config))
    return ", ".join(notes)


def hub_cache_entry(cache: Path, name: str) -> tuple[str, Path]:
    """(hub id, its snapshot folder) of a repository in a constructed hub cache, which `snapshot_download`
    resolves offline: models--OWNER--NAME/refs/main names a snapshot folder holding the files."""
    repo = cache / f"models--{HUB_OWNER}--{name}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(_COMMIT)
    return f"{HUB_OWNER}/{name}", repo / "snapshots" / _COMMIT


@dataclass
class Peer:
    engine: str
    drafter_label: str
    worker: PeerWorker | None
    note: str  # what differs from our rows, or why it cannot run


class PeerEngines:
    """The peer workers of one bench: start them with `start`, close them (and the folder) with `close`."""

    def __init__(self):
        self.folder = None
        self.peers: list[Peer] = []

    def start(
        self,
        engines: list[str],
        python: str,
        model_arg: str | None,
        dtype: str | None,
        model,
        drafters: list[tuple[str, object, str]],
    ) -> list[Peer]:
        """drafters: (label, loaded drafter, its folder or hub id)."""
        self.folder = tempfile.TemporaryDirectory(prefix="dflash2-peers-")
        root = Path(self.folder.name)
        target, cast = target_folder(model_arg, dtype, root)
        cache = root / "hub"
        env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
        for i, (label, drafter, source) in enumerate(drafters):
            hub_id, snapshot = hub_cache_entry(cache, f"drafter-{i}")
            note = published_drafter(drafter, model, source, snapshot)
            for engine in engines:
                where = hub_id if engine == "dflash" else str(snapshot)
                worker = PeerWorker(engine, python, env, root / f"{engine}-{i}.log")
                try:
                    version = worker.request(op="load", target=target, drafter=where, dtype=cast)["version"]
                    self.peers.append(Peer(engine, label, worker, f"{engine} {version}: {note}"))
                except PeerError as e:
                    worker.close()
                    self.peers.append(Peer(engine, label, None, str(e)))
        return self.peers

    def close(self) -> None:
        for p in self.peers:
            if p.worker is not None:
                p.worker.close()
        if self.folder is not None:
            self.folder.cleanup()
