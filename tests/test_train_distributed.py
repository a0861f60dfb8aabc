"""Data-parallel training under MLX distributed (ring backend, two processes on 127.0.0.1): two ranks train
exactly as one process on the whole batch, a lost rank ends the other with a clear error and the run resumes
from the checkpoint before it, and a world size that does not split the batch is refused before any work.

Every distributed run is a subprocess with a timeout; each asserts that its group has two members (a group of
one makes every collective a no-op and would pass the numbers while testing nothing)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import make_target, save_target, start_ring, stop

from dflash2_mlx.decode import plain_steps
from dflash2_mlx.loading import load_target
from dflash2_mlx.process_group import WATCHDOG_EXIT
from dflash2_mlx.sampling import SamplingParams
from dflash2_mlx.target import Target
from dflash2_mlx.train.data import Sample, read_shards, write_shard
from dflash2_mlx.train.settings import TrainSettings, check_world_size
from dflash2_mlx.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # every test here starts ranks, each one process loading MLX and a target
RUN_TIMEOUT = 180  # seconds any one distributed run may take before the test fails
TRAIN = [
    "--steps",
    "3",
    "--sequences-per-step",
    "4",
    "--anchors-per-sequence",
    "8",
    "--block-size",
    "4",
    "--eval-every",
    "100",
    "--checkpoint-every",
    "100",
    "--selector-rank",
    "16",
    "--lr",
    "3e-3",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny target saved as mlx-lm saves one, and its greedy continuations of random prompts in three
    data shards (one sample in eight held out)."""
    root = tmp_path_factory.mktemp("dp")
    save_target(root / "target", seed=3)
    model = make_target("qwen3", seed=3)
    rng = np.random.default_rng(0)
    samples = []
    for i in range(24):
        prompt = [int(t) for t in rng.integers(6, 250, size=rng.integers(3, 12))]
        response = []
        for step in plain_steps(Target(model), mx.array(prompt), SamplingParams()):
            response += step.tokens
            if len(response) >= 24:
                break
        samples.append(Sample(str(i), np.array(prompt + response, np.int32), len(prompt), i % 8 == 0))
    (root / "data").mkdir()
    for k in range(3):
        write_shard(root / "data" / f"shard-{k:05d}.npz", samples[8 * k : 8 * k + 8])
    # `dflash2_apps` is the checkout's apps/ folder (an installed copy could be another checkout's)
    (root / "path").mkdir()
    (root / "path" / "dflash2_apps").symlink_to(REPO / "apps")
    return root


def _env(root: Path, **extra) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "path"), str(REPO)]), **extra)


def _driver(root: Path) -> Path:
    """`dflash2 train` as a rank runs it, where rank KILL_RANK sends itself KILL_SIGNAL before step KILL_AT + 1
    (SIGKILL: it dies; SIGSTOP: it hangs without closing its connections)."""
    path = root / "rank.py"
    path.write_text(
        "import os, signal, sys\n"
        "from dflash2_mlx.train.trainer import Trainer\n"
        "real = Trainer.train_step\n"
        "def train_step(self):\n"
        "    killed = os.environ.get('MLX_RANK') == os.environ.get('KILL_RANK')\n"
        "    if killed and self.step == int(os.environ['KILL_AT']):\n"
        "        os.kill(os.getpid(), getattr(signal, os.environ['KILL_SIGNAL']))\n"
        "    return real(self)\n"
        "Trainer.train_step = train_step\n"
        "from dflash2_apps.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return path


def _ranks(root: Path, folder: Path, args_of, env: dict | None = None, wait_for: int | None = None):
    """Two ranks started by hand (MLX_RANK and MLX_HOSTFILE, what `mlx.launch` sets): [(returncode, output)] per
    rank. `args_of(rank)`: its command line after the python executable. `wait_for`: the rank whose end ends the
    wait (the other, if still running then, is killed and reported with returncode None). `root`: where they run,
    `folder`: the module's fixture folder."""
    logs = Path(tempfile.mkdtemp(prefix="ranks-", dir=root))  # the ranks' output, and nothing else

    def start(ports, logs):
        hostfile = root / f"hosts-{logs.name}.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports]))
        procs = []
        for rank in range(2):
            with open(logs / f"rank{rank}.txt", "w") as out:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, *args_of(rank)],
                        cwd=root,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        env=_env(folder, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile), **(env or {})),
                    )
                )
        return procs

    ready = None if wait_for is None else lambda procs: procs[wait_for].poll() is not None
    procs = start_ring(start, logs, RUN_TIMEOUT, ready)
    results = [(proc.poll(), (logs / f"rank{rank}.txt").read_text()) for rank, proc in enumerate(procs)]
    stop(procs)  # the one still running, where `wait_for` ended the wait
    return results


def _cli(root: Path, out: Path, *extra, data: Path | None = None) -> list[str]:
    return [
        "-m",
        "dflash2_apps.cli",
        "train",
        "--model",
        str(root / "target"),
        "--data",
        str(data or root / "data"),
        "--out",
        str(out),
        *TRAIN,
        *extra,
    ]


def _one_process(root: Path, out: Path, run_dir: Path, steps: int) -> Trainer:
    """The same run in this process, one rank: the checkpoint's settings (its data folder), the whole batch of
    every step."""
    state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    settings = TrainSettings(**{**state["settings"], "steps": steps})
    model, _ = load_target(str(root / "target"))
    trainer = Trainer(model, out, settings)
    trainer.run(progress=False)
    return trainer


def _relative_differences(got: dict, want: dict) -> dict[str, float]:
    """Per tensor ||got - want|| / ||want||, in float64."""
    assert got.keys() == want.keys()
    out = {}
    for k in want:
        a, b = np.array(got[k], np.float64), np.array(want[k], np.float64)
        out[k] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    return out


def test_two_ranks_train_as_one_process_on_the_whole_batch(tmp_path, folder):
    """`mlx.launch -n 2` of `dflash2 train`: after 3 steps the weights, the optimizer state and the moving average
    equal one process's on the whole batch within 1e-5 (relative, per tensor); the ranks computed the feature
    cache's shards between them, and rank 0 alone wrote the run."""
    data = tmp_path / "data"  # a copy without a feature cache
    shutil.copytree(folder / "data", data, ignore=shutil.ignore_patterns("features-*"))
    run, logs = tmp_path / "two", tmp_path / "launch"

    def start(ports, logs):
        cmd = [
            sys.executable,
            "-c",
            "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())",
            "-n",
            "2",
            "--starting-port",
            str(ports[0]),
            sys.executable,
            *_cli(folder, run, data=data),
        ]  # what `mlx.launch -n 2 python -m ...` runs
        with open(logs / "out.txt", "w") as out, open(logs / "err.txt", "w") as err:
            return [subprocess.Popen(cmd, cwd=folder, stdout=out, stderr=err, env=_env(folder), start_new_session=True)]

    [done] = start_ring(start, logs, RUN_TIMEOUT)
    out = (logs / "out.txt").read_text() + (logs / "err.txt").read_text()
    assert done.returncode == 0, out
    assert "rank 0 of 2" in out and "rank 1 of 2" in out, out  # a group of two, not two groups of one
    card = json.loads((run / "drafter" / "card.json").read_text())
    assert card["processes"] == 2 and card["steps"] == 3
    assert out.count("held-out tau") == 1  # rank 0 alone exported
    # the feature cache: each rank computed the features of its own shards, together all of them
    done_by = {rank: set() for rank in (0, 1)}
    for line in out.splitlines():
        if "the features of" in line and "its shards" in line:
            rank = int(line.split("rank ")[1].split(":")[0])
            done_by[rank] |= set(line.rsplit(": ", 1)[1].rstrip(")").split(", "))
    assert done_by == {0: {"shard-00000", "shard-00002"}, 1: {"shard-00001"}}, out
    assert "the other ranks' shards" not in out  # one disk: nothing left to compute twice
    # one process on the whole batch (the same feature cache, now full: it computes nothing)
    one = _one_process(folder, tmp_path / "one", run, steps=3)
    two = {
        name: mx.load(str(run / "checkpoint" / f"{name}.safetensors")) for name in ("drafter", "optimizer", "average")
    }
    from mlx.utils import tree_flatten

    want = {
        "drafter": dict(tree_flatten(one.drafter.parameters())),
        "optimizer": dict(tree_flatten(one.optimizer.state)),
        "average": one.average,
    }
    worst = {name: max(_relative_differences(two[name], want[name]).values()) for name in want}
    assert all(v < 1e-5 for v in worst.values()), worst
    # ... which is a test: 3 steps moved every trained tensor far beyond that
    init = Trainer(load_target(str(folder / "target"))[0], tmp_path / "init", one.settings)
    moved = _relative_differences(dict(tree_flatten(init.drafter.parameters())), want["drafter"])
    assert min(moved.values()) > 1e-3, moved
    two_log = json.loads((run / "checkpoint" / "state.json").read_text())["log"]
    np.testing.assert_allclose([e["loss"] for e in two_log], [e["loss"] for e in one.log], rtol=1e-5)
    assert two_log[-1]["tau"] == one.log[-1]["tau"] and two_log[-1]["by_position"] == one.log[-1]["by_position"]


def test_a_lost_rank_ends_the_other_and_the_run_resumes_from_the_checkpoint_before(tmp_path, folder):
    """Rank 1 killed before step 4: rank 0 ends at once with an error naming what it waited for and the checkpoint
    (step 2) it can continue from; the same command continues from there, and its weights after 6 steps are one
    process's (with a draft vocabulary and distillation). Rank 1 writes nothing (its --out stays absent): it
    takes rank 0's checkpoint over the wire."""
    run, elsewhere = tmp_path / "run", tmp_path / "rank1-out"
    driver = _driver(tmp_path)
    # a draft vocabulary (labels outside it weigh nothing) and distillation (the target's top-k, cached per rank)
    extra = ["--steps", "6", "--checkpoint-every", "2", "--draft-vocab", "40", "--distill", "0.5"]

    def args_of(rank):
        return [str(driver), *_cli(folder, run if rank == 0 else elsewhere, *extra)[2:]]

    (rc0, out0), (rc1, out1) = _ranks(
        tmp_path, folder, args_of, dict(KILL_RANK="1", KILL_AT="3", KILL_SIGNAL="SIGKILL"), wait_for=0
    )
    assert "rank 0 of 2" in out0 and "rank 1 of 2" in out1
    assert rc1 in (-signal.SIGKILL, None), out1
    assert rc0 == 1, out0
    assert "PeerLost" in out0 and "step 4's gradient sum" in out0 and "(step 2)" in out0, out0
    assert json.loads((run / "checkpoint" / "state.json").read_text())["step"] == 2
    (rc0, out0), (rc1, out1) = _ranks(
        tmp_path, folder, args_of, dict(KILL_RANK="none", KILL_AT="0", KILL_SIGNAL="SIGKILL")
    )
    assert (rc0, rc1) == (0, 0), out0 + out1
    assert "rank 1 of 2" in out1 and not elsewhere.exists()
    state = json.loads((run / "checkpoint" / "state.json").read_text())
    assert state["step"] == 6 and [e["step"] for e in state["log"]] == [1, 2, 3, 4, 5, 6]
    one = _one_process(folder, tmp_path / "one", run, steps=6)
    from mlx.utils import tree_flatten

    worst = max(
        _relative_differences(
            mx.load(str(run / "checkpoint" / "drafter.safetensors")), dict(tree_flatten(one.drafter.parameters()))
        ).values()
    )
    assert worst < 1e-5
    # the losses too (Adam and clipping are blind to a gradient scaled by the same factor on every rank)
    np.testing.assert_allclose([e["loss"] for e in state["log"]], [e["loss"] for e in one.log], rtol=1e-5)


def test_a_rank_that_stops_answering_ends_the_other_within_its_timeout(tmp_path, folder):
    """Rank 1 hangs (SIGSTOP: its connections stay open) before step 4: rank 0's watchdog ends it after
    --peer-timeout seconds with an error naming what it waited for and the checkpoint to continue from.
    Rank 1 has a data folder of its own (another disk, another path): it computes its shard's features, then
    the other ranks' ones, and its folder's cache is whole."""
    own = tmp_path / "own-data"
    shutil.copytree(folder / "data", own, ignore=shutil.ignore_patterns("features-*"))
    driver = _driver(tmp_path)
    extra = ["--steps", "6", "--checkpoint-every", "2", "--peer-timeout", "8"]

    def args_of(rank):
        return [str(driver), *_cli(folder, tmp_path / f"run{rank}", *extra, data=own if rank else None)[2:]]

    (rc0, out0), (_, out1) = _ranks(
        tmp_path, folder, args_of, dict(KILL_RANK="1", KILL_AT="3", KILL_SIGNAL="SIGSTOP"), wait_for=0
    )
    assert rc0 == WATCHDOG_EXIT, out0
    assert "no answer from the other ranks for 8 s during step 4's gradient sum" in out0, out0
    assert "(step 2)" in out0
    assert "rank 1 of 2" in out1 and "rank 1: the features of 7 train samples (its shards: shard-00001)" in out1
    assert "rank 1: the features of 14 train samples (the other ranks' shards: shard-00000, shard-00002)" in out1
    marks = [json.loads(p.read_text()) for p in own.glob("features-*/shard-*.json")]
    assert len(marks) == 3 and sum(len(m["done"]) for m in marks) == 24


def test_a_world_size_that_does_not_split_the_batch_is_refused_before_any_work(tmp_path, folder):
    with pytest.raises(
        ValueError,
        match="--sequences-per-step 3 does not split over 2 ranks .* give "
        "--sequences-per-step 2 or --sequences-per-step 4",
    ):
        check_world_size(TrainSettings(data="d", sequences_per_step=3), 2)
    check_world_size(TrainSettings(data="d", sequences_per_step=6), 3)
    before = {p.name for p in (folder / "data").iterdir()}
    results = _ranks(tmp_path, folder, lambda rank: _cli(folder, tmp_path / "run", "--sequences-per-step", "3"))
    for rc, out in results:
        assert rc == 2 and "--sequences-per-step 3 does not split over 2 ranks" in out, out
        assert "joining" not in out  # refused before the ranks even met
    assert not (tmp_path / "run").exists() and {p.name for p in (folder / "data").iterdir()} == before
    assert len(read_shards(folder / "data")) == 24


def test_a_rank_whose_peers_never_answer_ends_after_its_timeout(tmp_path, folder):
    """Rank 0 started alone (its peer never joins): it ends after --peer-timeout seconds instead of waiting."""
    hostfile, logs = tmp_path / "hosts.json", tmp_path / "launch"

    def start(ports, logs):  # rank 0 of two; rank 1 never starts
        hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports]))
        with open(logs / "out.txt", "w") as out, open(logs / "err.txt", "w") as err:
            return [
                subprocess.Popen(
                    [sys.executable, *_cli(folder, tmp_path / "run", "--peer-timeout", "3")],
                    cwd=tmp_path,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                    env=_env(folder, MLX_RANK="0", MLX_HOSTFILE=str(hostfile)),
                )
            ]

    [done] = start_ring(start, logs, RUN_TIMEOUT)
    stderr = (logs / "err.txt").read_text()
    assert done.returncode != 0, stderr
    assert "if one does not answer within 3 s, this process ends" in stderr
    assert "got no answer from the other processes within 3 s (hostfile: " in stderr, stderr
    assert not (tmp_path / "run").exists()


def test_ranks_given_different_settings_are_refused(tmp_path, folder):
    """Ranks whose gradients would not add up to one process's (here: another --seed on rank 1) all stop with
    one clear error before computing anything."""
    results = _ranks(tmp_path, folder, lambda rank: _cli(folder, tmp_path / "run", "--seed", str(rank)))
    for rc, out in results:
        assert rc == 2 and "the ranks were given different settings, targets or data" in out, out
    assert "rank 1 of 2" in results[1][1] and "the features of" not in results[0][1] + results[1][1]
    assert not (tmp_path / "run").exists()
