"""A target sharded over two processes on this machine (MLX distributed, ring backend on 127.0.0.1): pipeline
parallel (a tiny qwen2 and a tiny hybrid qwen3_5, pipelined by mlx-lm; a tiny qwen3 and a tiny llama with
sliding-window layers, pipelined by `patches.pipeline_stage`) and tensor parallel (a tiny qwen3; the hybrid too,
with a v1 drafter), each with a DFlash v1 and a DFlash 2 drafter, against the same target and drafter in one process
and against mlx-lm's own greedy decoding.

All the two-process generations run in one launch of `sharded_worker.py` (module fixture); every launch is
bounded by a timeout, and the group's size is checked (a group of one would make every collective a no-op)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    make_dflash2_drafter,
    make_drafter,
    make_hybrid,
    make_target,
    ring_ports,
    save_drafter,
    save_model,
    save_target,
    start_ring,
    target_config,
)
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from dflash2_mlx import PromptCache, generate, load, patches
from dflash2_mlx.distributed import MESSAGE_IDS, ShardedTarget, check_shardable
from dflash2_mlx.lookup import LookupConfig

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).parent / "sharded_worker.py"
LAUNCH_TIMEOUT = 300  # seconds for one two-process launch (the matrix takes ~30 s on 2 busy cores)
PROMPT = [1] + [6 + (10 + 7 * i) % 240 for i in range(79)]  # 80 ids: more than one announcement carries
TOKENS = 24
# case -> (target architecture, sharding, drafter); the hybrid tensor-parallel case: each process holds a slice of
# every recurrent state too, and rolls back its slice
# qwen3 and llama are pipelined by dflash2 (`patches.pipeline_stage`: mlx-lm has no pipeline for them); the llama
# target has sliding-window layers (a windowed mask and a rotating cache in each stage)
CASES = {
    f"{arch}-{mode}-{kind}": (arch, mode, kind)
    for arch, mode in (("qwen2", "pipeline"), ("qwen3_5", "pipeline"), ("qwen3", "pipeline"), ("qwen3", "tensor"))
    for kind in ("v1", "dflash2")
}
CASES["qwen3_5-tensor-v1"] = ("qwen3_5", "tensor", "v1")
CASES["llama_swa-pipeline-v1"] = ("llama_swa", "pipeline", "v1")
GREEDY = dict(max_tokens=TOKENS, verify_mode="dflash", block_size=4, eos_token_ids=[])
SAMPLED = dict(GREEDY, temp=2.0, seed=3)
# consecutive prompts through one prompt cache: the second shares 50 tokens with the first, whose caches are cut
# back to them (KV caches trimmed in every process; the hybrid and sliding-window targets start afresh)
CACHED = [PROMPT, PROMPT[:50] + [20, 21, 22, 23, 24]]
# `python -m dflash2_apps.cli` from this checkout's apps/ (an editable install may map the package elsewhere)
CLI = [
    sys.executable,
    "-c",
    "import importlib.util, sys; apps = sys.argv.pop(1); spec = importlib.util."
    "spec_from_file_location('dflash2_apps', apps + '/__init__.py', submodule_search_locations=[apps]); "
    "sys.modules['dflash2_apps'] = importlib.util.module_from_spec(spec); spec.loader.exec_module("
    "sys.modules['dflash2_apps']); from dflash2_apps.cli import main; sys.exit(main())",
    str(ROOT / "apps"),
]
# run by the qwen2 pipeline v1 case only: adaptive mode (its cost measurement, plain runs; a prefill in chunks)
# and plain decoding
EXTRA = [
    dict(max_tokens=TOKENS, verify_mode="adaptive", eos_token_ids=[], prefill_step_size=32),
    dict(max_tokens=TOKENS, verify_mode="off", eos_token_ids=[]),
]


def ring_env(folder: Path, ports: list[int], env: dict | None = None) -> dict:
    """The environment of a ring's processes: a hostfile of `ports` on 127.0.0.1 (in folder), this checkout on
    PYTHONPATH, and `env`."""
    hostfile = folder / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    return {
        **os.environ,
        **(env or {}),
        "MLX_HOSTFILE": str(hostfile),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }


def start_ranks(
    commands: list[list[str]],
    folder: Path,
    ranks=None,
    env: dict | None = None,
    ready=None,
    timeout: float = LAUNCH_TIMEOUT,
) -> list[subprocess.Popen]:
    """One process per command as ranks 0.. of a ring over 127.0.0.1, as `mlx.launch` starts them (only `ranks` of
    them, if given: the others never come; stdout and stderr in folder/outR.txt and errR.txt; `env`: more
    environment variables); returned as `start_ring` returns them."""

    def start(ports, folder):
        environ, procs = ring_env(folder, ports, env), []
        for rank, command in enumerate(commands):
            if ranks is None or rank in ranks:
                with open(folder / f"out{rank}.txt", "w") as out, open(folder / f"err{rank}.txt", "w") as err:
                    procs.append(
                        subprocess.Popen(
                            command,
                            env={**environ, "MLX_RANK": str(rank)},
                            stdout=out,
                            stderr=err,
                            cwd=ROOT,
                            start_new_session=True,
                        )
                    )
        return procs

    return start_ring(start, folder, timeout, ready)


def launch(commands: list[list[str]], folder: Path, timeout: float = LAUNCH_TIMEOUT, ranks=None) -> list[dict]:
    """Run one process per command as ranks 0.. of a ring over 127.0.0.1 (only `ranks` of them, if given: the
    others never come) to their end; returns each one's rank, returncode, stdout and stderr. Fails the test if any
    outlives `timeout`."""
    procs = start_ranks(commands, folder, ranks, timeout=timeout)
    started = [rank for rank in range(len(commands)) if ranks is None or rank in ranks]
    return [
        {
            "rank": rank,
            "returncode": proc.returncode,
            "stdout": (folder / f"out{rank}.txt").read_text(),
            "stderr": (folder / f"err{rank}.txt").read_text(),
        }
        for rank, proc in zip(started, procs)
    ]


def write_index(folder: Path) -> Path:
    """The weight index `sharded_load` reads for pipelines, for a folder's one model.safetensors."""
    weights = mx.load(str(folder / "model.safetensors"))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(weights, "model.safetensors")})
    )
    return folder


def save_indexed(folder: Path, model, config: dict) -> Path:
    """An mlx-lm model folder with the weight index `sharded_load` reads for pipelines."""
    folder.mkdir(parents=True)
    return write_index(save_model(folder, model, config))


def build_folders(root: Path) -> dict:
    """(target folder, drafter folder) of every (architecture, drafter kind)."""
    folders = {}
    for arch in sorted({arch for arch, _, _ in CASES.values()}):
        if arch == "qwen3_5":
            hybrid = make_hybrid("qwen3_5")
            target = save_indexed(root / arch, hybrid, hybrid.args_config)
        else:
            target = write_index(save_target(root / arch, arch))
        model, _ = load_model(target)
        for kind, make in (("v1", make_drafter), ("dflash2", make_dflash2_drafter)):
            drafter = make(model, block_size=8, mask_token_id=5)  # reads target layers 1 and 3 (of 0..3)
            folders[arch, kind] = (target, save_drafter(root / f"{arch}-{kind}", drafter))
    return folders


def greedy_sampler(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


def mlx_lm_greedy(target: Path) -> list[int]:
    """The target's greedy continuation of PROMPT by mlx-lm's own decoding loop."""
    model, _ = load_model(target)
    steps = generate_step(mx.array(PROMPT), model, max_tokens=TOKENS, sampler=greedy_sampler)
    return [int(token) for token, _ in steps]


def unsharded(target: Path, drafter_dir: Path) -> dict:
    """The same generations in one process, and the drafter's context (fc of its features, by NumPy)."""
    model, tokenizer, drafter = load(str(target), str(drafter_dir), dtype="float32", kernels="mlx")
    features, draft_rows = [], drafter.draft_rows

    def spy(block, context, cache):
        features.append(np.array(context[0], np.float64))
        return draft_rows(block, context, cache)

    drafter.draft_rows = spy
    greedy = generate(model, tokenizer, PROMPT, drafter, **GREEDY).tokens
    drafter.draft_rows = draft_rows
    sampled = generate(model, tokenizer, PROMPT, drafter, **SAMPLED).tokens
    cache, cached = PromptCache(), []
    for prompt in CACHED:
        cached.append([generate(model, tokenizer, prompt, drafter, prompt_cache=cache, **GREEDY).tokens, cache.reused])
    fc = np.array(drafter.fc.weight, np.float64)
    return {"greedy": greedy, "sampled": sampled, "cached": cached, "context": np.concatenate(features) @ fc.T}


def run_matrix(root: Path) -> None:
    """Every case run by two processes (one launch) into root/out, and its references into root/references."""
    folders = build_folders(root / "models")
    jobs, alone = [], {}
    for case, (arch, mode, kind) in CASES.items():
        target, drafter = folders[arch, kind]
        if (arch, kind) not in alone:
            alone[arch, kind] = {"mlx_lm": mlx_lm_greedy(target), **unsharded(target, drafter)}
        reference = alone[arch, kind]
        (root / "references").mkdir(exist_ok=True)
        np.save(root / "references" / f"{case}-context.npy", reference["context"])
        (root / "references" / f"{case}.json").write_text(
            json.dumps({k: v for k, v in reference.items() if k != "context"})
        )
        runs = [GREEDY, SAMPLED] + (EXTRA if case == "qwen2-pipeline-v1" else [])
        jobs.append(
            dict(
                name=case,
                target=str(target),
                drafter=str(drafter),
                mode=mode,
                prompt=PROMPT,
                runs=runs,
                cached=CACHED,
                script=reference["mlx_lm"],
            )
        )
    (root / "jobs.json").write_text(json.dumps(jobs))
    (root / "out").mkdir()
    command = [sys.executable, str(WORKER), str(root / "jobs.json"), str(root / "out")]
    results = launch([command, command], root / "launch")
    assert [r["returncode"] for r in results] == [0, 0], results
    (root / "done").touch()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """(what the two processes wrote, the references) of every case. Under pytest-xdist the workers share one
    launch: the first to get here runs it, the others read its files."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from filelock import FileLock

        root = tmp_path_factory.getbasetemp().parent / "sharded-matrix"  # this run's, shared by its workers
        root.mkdir(exist_ok=True)
        with FileLock(str(root) + ".lock"):
            if not (root / "done").exists():
                run_matrix(root)
    else:
        root = tmp_path_factory.mktemp("sharded")
        run_matrix(root)
    out, refs = root / "out", root / "references"
    found, references = {}, {}
    for case in CASES:
        found[case] = {
            "ranks": [json.loads((out / f"{case}-rank{r}.json").read_text()) for r in (0, 1)],
            "runs": json.loads((out / f"{case}.json").read_text())["runs"],
            "context": np.load(out / f"{case}-context.npy"),
        }
        references[case] = {
            **json.loads((refs / f"{case}.json").read_text()),
            "context": np.load(refs / f"{case}-context.npy"),
        }
    return found, references


@pytest.mark.slow
def test_two_processes_each_hold_a_share(sharded):
    found, _ = sharded
    for case, result in found.items():
        assert [r["size"] for r in result["ranks"]] == [2, 2], case  # a group of one would test nothing
        assert len(PROMPT) > MESSAGE_IDS  # the prompt's ids follow their announcement
        rank0, rank1 = result["ranks"]
        if CASES[case][1] == "pipeline":
            # mlx-lm's pipeline: rank 1 runs layers 0-1, rank 0 layers 2-3; the drafter reads layers 1 and 3
            assert (rank1["first_layer"], rank1["layers"], rank1["held"]) == (0, 2, [1]), case
            assert (rank0["first_layer"], rank0["layers"], rank0["held"]) == (2, 2, [3]), case
        else:
            assert rank0["held"] == rank1["held"] == [1, 3] and rank0["layers"] == rank1["layers"] == 4, case


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_one_process(sharded, case):
    found, references = sharded
    greedy = found[case]["runs"][0]["tokens"]
    assert len(greedy) == TOKENS
    assert greedy == references[case]["greedy"] == references[case]["mlx_lm"]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_scripted_drafts_are_accepted_and_rolled_back(sharded, case):
    """Drafts right up to a random position: every acceptance length, each cycle's rejected rows rolled back
    in both processes (recurrent layers too), and the output still mlx-lm's greedy text."""
    found, references = sharded
    scripted = found[case]["runs"][-1]
    assert scripted["tokens"] == references[case]["mlx_lm"]
    assert sum(scripted["accepted"]) >= TOKENS // 3 and {0, 3} <= set(scripted["accepted"]), scripted["accepted"]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_context_matches_one_process(sharded, case):
    """The drafter's context rows (its fc of the tapped layers' outputs, summed over the processes that hold them
    in a pipeline) against NumPy's fc of the one-process features, row by row over the whole greedy run."""
    found, references = sharded
    got, want = found[case]["context"], references[case]["context"]
    assert got.shape == want.shape and got.shape[0] >= len(PROMPT) + TOKENS - 2
    scale = np.abs(want).max()
    assert scale > 1.0  # rows of some size: the bound below is not met by near-zero rows
    # float32 rounding of values up to ~10 (the sums in another order; tensor parallel: the target's own
    # sharded matmuls too): measured 2.6e-6 (pipeline) and 9.2e-6 (tensor parallel) at most
    assert np.abs(got - want).max() <= 1e-5 * scale


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_sampled_matches_one_process(sharded, case):
    found, references = sharded
    sampled = found[case]["runs"][1]
    assert sampled["tokens"] == references[case]["sampled"]
    assert sampled["tokens"] != references[case]["greedy"]  # it sampled
    if CASES[case][2] == "v1":  # at T = 2 the random v1 drafters get drafts accepted: rollbacks of part of a block
        assert sum(sampled["accepted"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_prompt_cache_reuse_matches_one_process(sharded, case):
    found, references = sharded
    cached = [[run["tokens"], run["reused"]] for run in found[case]["runs"][-1 - len(CACHED) : -1]]
    assert cached == references[case]["cached"]
    # the hybrid target and the sliding-window one (its rotating caches hold only the last 8 rows) start afresh
    assert cached[1][1] == (0 if CASES[case][0] in ("qwen3_5", "llama_swa") else 50)


@pytest.mark.slow
def test_adaptive_and_plain_decoding(sharded):
    """Adaptive mode (its cost measurement on two caches, plain runs) and plain decoding on the pipeline."""
    found, references = sharded
    adaptive, plain = found["qwen2-pipeline-v1"]["runs"][2:4]
    assert adaptive["tokens"] == plain["tokens"] == references["qwen2-pipeline-v1"]["mlx_lm"]


# -- copy drafts (`--copyspec-mode`) -------------------------------------------------------------------------------

# case -> (target architecture, sharding): tensor parallel, and the hybrid's recurrent states rolled back in a pipeline
COPY_CASES = {"qwen3-tensor": ("qwen3", "tensor"), "qwen3_5-pipeline": ("qwen3_5", "pipeline")}
# lookups from matches of one token (`LookupConfig(1, 8)`, a list in the worker's jobs): they fire most
COPY = dict(GREEDY, copyspec_mode=[1, 8])


@pytest.mark.slow  # 5-10 s: one two-process launch
def test_lookups_on_a_sharded_target_match_mlx_lm(tmp_path):
    """Copy drafts on a target sharded over two processes (one branch per cycle: a lookup alone, or the drafter's
    path), on a prompt that repeats itself: p, mlx-lm's greedy answer to p, then p again. Lookups were verified in
    fixed blocks (and gave drafts) and in adaptive mode (plain runs that end where a lookup pays); the tokens are
    mlx-lm's greedy ones. At T = 2 the hybrid (one branch per cycle in one process too) gives the one-process
    generation's tokens."""
    jobs, references = [], {}
    for case, (arch, mode) in COPY_CASES.items():
        if arch == "qwen3_5":
            hybrid = make_hybrid("qwen3_5")
            target = save_indexed(tmp_path / case, hybrid, hybrid.args_config)
        else:
            target = write_index(save_target(tmp_path / case, arch))
        model, _ = load_model(target)
        drafter = save_drafter(tmp_path / f"{case}-drafter", make_dflash2_drafter(model, block_size=8, mask_token_id=5))
        p = PROMPT[:30]
        answer = [int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=TOKENS, sampler=greedy_sampler)]
        prompt = p + answer + p
        steps = generate_step(mx.array(prompt), model, max_tokens=TOKENS, sampler=greedy_sampler)
        references[case] = {"greedy": [int(t) for t, _ in steps]}
        runs = [COPY, dict(COPY, verify_mode="adaptive")]
        if arch == "qwen3_5":
            one, tokenizer, one_drafter = load(str(target), str(drafter), dtype="float32", kernels="mlx")
            settings = dict(COPY, copyspec_mode=LookupConfig(1, 8), temp=2.0, seed=3)
            references[case]["sampled"] = generate(one, tokenizer, prompt, one_drafter, **settings).tokens
            runs.append(dict(COPY, temp=2.0, seed=3))
        jobs.append(dict(name=case, target=str(target), drafter=str(drafter), mode=mode, prompt=prompt, runs=runs))
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    (tmp_path / "out").mkdir()
    command = [sys.executable, str(WORKER), str(tmp_path / "jobs.json"), str(tmp_path / "out")]
    results = launch([command, command], tmp_path / "launch")
    assert [r["returncode"] for r in results] == [0, 0], results
    for case in COPY_CASES:
        assert [json.loads((tmp_path / "out" / f"{case}-rank{r}.json").read_text())["size"] for r in (0, 1)] == [2, 2]
        greedy, adaptive, *sampled = json.loads((tmp_path / "out" / f"{case}.json").read_text())["runs"]
        assert greedy["tokens"] == adaptive["tokens"] == references[case]["greedy"], case
        assert greedy["lookup_tokens"] > 0, (case, greedy)
        assert "lookup" in adaptive["branches"], (case, adaptive)  # a fresh match's neutral estimate pays
        if sampled:
            assert sampled[0]["tokens"] == references[case]["sampled"] != greedy["tokens"], case
            assert "lookup" in sampled[0]["branches"], (case, sampled[0])


# -- bad input -----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_no_answer_from_the_hostfile_ends_with_a_message(tmp_path):
    """Rank 0 of two, and rank 1 never starts: the connect timeout's watchdog ends the process (SIGKILL, the way it
    ends one), naming the hostfile."""
    code = "from dflash2_mlx.distributed import init_group; init_group('ring', timeout=3)"
    [result] = launch([[sys.executable, "-c", code]] * 2, tmp_path, timeout=60, ranks=[0])
    assert result["returncode"] == -signal.SIGKILL, result
    assert "got no answer from the other processes within 3 s" in result["stderr"]
    assert "hosts.json" in result["stderr"]


@pytest.mark.slow
def test_a_taken_port_is_tried_again_on_others(tmp_path, monkeypatch):
    """A launch whose rank 0 finds its port held by another process (here a listening socket of the test's) fails to
    bind, and is started again on other ports, where the two ranks join."""
    import socket

    import helpers

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    draw, drawn = ring_ports, []

    def ports(n: int) -> list[int]:  # the held port first, then ports drawn as usual
        drawn.append([held.getsockname()[1], draw(1)[0]] if not drawn else draw(n))
        return drawn[-1]

    monkeypatch.setattr(helpers, "ring_ports", ports)
    code = "from dflash2_mlx.distributed import init_group; print(init_group('ring', timeout=60).size())"
    try:
        results = launch([[sys.executable, "-c", code]] * 2, tmp_path, timeout=120)
    finally:
        held.close()
    assert len(drawn) == 2  # the held port, then others
    assert [(r["returncode"], r["stdout"].strip()) for r in results] == [(0, "2"), (0, "2")], results


@pytest.mark.slow
def test_a_lone_process_is_refused(tmp_path):
    code = (
        "import os; [os.environ.pop(k, None) for k in ('MLX_RANK', 'MLX_HOSTFILE')]\n"
        "from dflash2_mlx.distributed import init_group; init_group('ring', timeout=30)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode != 0 and "Start every process with mlx.launch" in run.stderr
    with pytest.raises(ValueError, match="at least two processes"):
        ShardedTarget(make_target("qwen2"), mx.distributed.init(), "pipeline")


@pytest.mark.slow
def test_ranks_with_different_drafters_are_refused(tmp_path):
    """Each rank given another drafter: both stop at the start with the same clear error, no hang."""
    target = save_target(tmp_path / "target", "qwen3")
    model, _ = load_model(target)
    drafters = [
        save_drafter(tmp_path / f"d{seed}", make_drafter(model, seed=seed, block_size=8, mask_token_id=5))
        for seed in (1, 2)
    ]
    commands = [
        [
            *CLI,
            "generate",
            "--model",
            str(target),
            "--draft-model",
            str(d),
            "--tensor-parallel",
            "--backend",
            "ring",
            "--connect-timeout",
            "60",
        ]
        for d in drafters
    ]
    results = launch(commands, tmp_path / "launch", timeout=120)
    for r in results:
        assert r["returncode"] == 2, r
        assert "rank 1 loaded a different drafter from rank 0's" in r["stderr"], r


@pytest.mark.slow
def test_a_rank_lost_mid_generation_ends_the_other(tmp_path):
    """Rank 1 killed while rank 0 generates: rank 0 ends with a message, never hangs (the ring's own error, or the
    watchdog's after --peer-timeout where an MLX collective does not return)."""
    model_dir = tmp_path / "models"
    target = write_index(save_target(model_dir / "qwen2", "qwen2"))
    model, _ = load_model(target)
    drafter = save_drafter(model_dir / "drafter", make_drafter(model, block_size=8, mask_token_id=5))
    jobs = [
        dict(
            name="long",
            target=str(target),
            drafter=str(drafter),
            mode="pipeline",
            prompt=PROMPT,
            peer_timeout=5,
            runs=[dict(max_tokens=100000, verify_mode="dflash", block_size=4, eos_token_ids=[])],
        )
    ]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    (tmp_path / "out").mkdir()
    folder, command = (
        tmp_path / "launch",
        [sys.executable, str(WORKER), str(tmp_path / "jobs.json"), str(tmp_path / "out")],
    )
    # ready once rank 0 has drafted a block: both ranks are inside the generation
    procs = start_ranks(
        [command, command],
        folder,
        timeout=120,
        ready=lambda procs: running(procs, folder) and (tmp_path / "out" / "long-drafting").exists(),
    )
    try:
        assert procs[0].poll() is None, "rank 0 ended before rank 1 was killed"
        procs[1].kill()
        procs[0].wait(timeout=60)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    err = (folder / "err0.txt").read_text()
    assert procs[0].returncode != 0
    # the ring's own error where its collective fails; where MLX's all_gather never returns (it does not when a
    # peer dies), rank 0's watchdog after its 5 s peer timeout
    last = err.splitlines()[-1]
    assert "connection to a peer was lost" in last or "got no answer from the other processes for 5 s" in last, err[
        -2000:
    ]


def test_architectures_that_cannot_be_sharded_are_refused():
    import mlx.nn as nn
    from helpers import model_from_config
    from mlx_lm.models import qwen3

    class ScaledQwen3Model(qwen3.Qwen3Model):  # another forward than qwen3's: not pipelined by dflash2
        def __call__(self, inputs, cache=None, input_embeddings=None):
            return super().__call__(inputs, cache, self.embed_tokens(inputs) * 2.0)

    scaled = make_target("qwen3")
    scaled.model.__class__ = ScaledQwen3Model
    with pytest.raises(
        ValueError,
        match=r"cannot shard qwen3 models pipeline-parallel .*not qwen3's or llama's.*"
        r"use --tensor-parallel",
    ):
        check_shardable(scaled, "pipeline")
    gemma, _ = model_from_config(dict(target_config("qwen3"), model_type="gemma"))
    with pytest.raises(
        ValueError, match="cannot shard gemma models pipeline-parallel .*cannot shard this architecture"
    ):
        check_shardable(gemma, "pipeline")
    with pytest.raises(ValueError, match="has a forward this version cannot pipeline"):
        patches.pipeline_stage(scaled)
    for arch in ("qwen3", "llama", "llama_swa", "qwen2"):
        check_shardable(make_target(arch), "pipeline")
    check_shardable(make_target("qwen3"), "tensor")
    with pytest.raises(ValueError, match="cannot shard this architecture at all"):
        check_shardable(nn.Linear(2, 2), "tensor")


@pytest.mark.slow
def test_cli_under_mlx_launch_prints_once_and_matches_one_process(tmp_path):
    """`mlx.launch -n 2 -- python -m dflash2_apps.cli generate ... --pipeline`: one JSON line (rank 0's), the
    tokens of the same command in one process. The target is a qwen3, which mlx-lm does not pipeline itself."""
    target = write_index(save_target(tmp_path / "target", "qwen3"))
    model, _ = load_model(target)
    drafter = save_drafter(tmp_path / "drafter", make_dflash2_drafter(model, block_size=8, mask_token_id=5))
    flags = [
        "generate",
        "--model",
        str(target),
        "--draft-model",
        str(drafter),
        "--prompt",
        "w1 w2 w3",
        "--max-tokens",
        "12",
        "--verify-mode",
        "dflash",
        "--json",
        "--kernels",
        "mlx",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    alone = subprocess.run([*CLI, *flags], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert alone.returncode == 0, alone.stderr
    alone = json.loads(alone.stdout)
    # mlx installs it beside the interpreter running the tests (a venv's bin, which need not be on the PATH)
    launcher = shutil.which(
        "mlx.launch", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    )
    assert launcher, "mlx.launch (installed with mlx) is not on the PATH"

    def start(ports, folder):  # mlx.launch gives the ranks ports[0] and ports[0] + 1
        command = [
            launcher,
            "-n",
            "2",
            "--backend",
            "ring",
            "--starting-port",
            str(ports[0]),
            "--",
            *CLI,
            *flags,
            "--pipeline",
            "--backend",
            "ring",
        ]
        with open(folder / "out.txt", "w") as out, open(folder / "err.txt", "w") as err:
            return [subprocess.Popen(command, stdout=out, stderr=err, cwd=ROOT, env=env, start_new_session=True)]

    folder = tmp_path / "launch"
    [run] = start_ring(start, folder, 120)
    assert run.returncode == 0, (folder / "err.txt").read_text()
    lines = (folder / "out.txt").read_text().splitlines()
    assert len(lines) == 1, lines  # rank 1 prints nothing
    assert json.loads(lines[0])["tokens"] == alone["tokens"] and len(alone["tokens"]) > 0


class FakeGroup:
    """What mlx-lm's `pipeline()` reads of a group: its rank and size (no collective is run here)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_5", "qwen3", "llama_swa"])
def test_a_pipeline_stage_counts_layers_from_the_config_and_taps_its_own(arch):
    from dflash2_mlx.target import Target

    for rank, first, held, recurrent in [(0, 2, (3,), [2]), (1, 0, (1,), [0])]:
        model = make_hybrid(arch) if arch == "qwen3_5" else make_target(arch)
        if arch in ("qwen3", "llama_swa"):
            patches.pipeline_stage(model)
        model.model.pipeline(FakeGroup(rank, 2))  # rank 0 runs the last layers, as mlx-lm splits them
        target = Target(model, (1, 3))
        assert (target.num_layers, target.first_layer, len(target.layers), target.held_ids) == (4, first, 2, held)
        assert sorted(target.recurrent) == (recurrent if arch == "qwen3_5" else [])
        cache = target.make_cache()  # the stage's own layers only
        assert len(cache) == 2
        with target.capture():
            tapped = [first + j for j, layer in enumerate(target.layers) if "_dflash_tap" in layer.__dict__]
        assert tapped == list(held)
    with pytest.raises(ValueError, match="has only 4 layers"):
        Target(model, (1, 4))


@pytest.mark.parametrize("arch", ["qwen3", "llama_swa"])
def test_a_patched_pipeline_runs_the_unpatched_layers(arch, monkeypatch):
    """`patches.pipeline_stage` on the two stages of a pipeline of two (a fake group; the exchanges through a list):
    what rank 1 sends is layers 0-1 of the unpatched model run directly, and rank 0's logits are the unpatched
    model's, bit for bit, over a prefill longer than llama's sliding window and two cached steps."""
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import make_prompt_cache

    wire, sent = [], []
    monkeypatch.setattr(
        mx.distributed, "send", lambda h, dst, group=None: (wire.append(h), sent.append((h, dst)))[0] or h
    )
    monkeypatch.setattr(mx.distributed, "recv_like", lambda h, src, group=None: wire.pop(0))
    monkeypatch.setattr(mx.distributed, "all_gather", lambda h, group=None: mx.concatenate([h, mx.zeros_like(h)]))
    reference = make_target(arch)
    stages = {}
    for rank in (1, 0):
        stages[rank] = make_target(arch)
        patches.pipeline_stage(stages[rank])
        stages[rank].model.pipeline(FakeGroup(rank, 2))
        assert type(stages[rank].model).__module__ == type(reference.model).__module__
    caches = {rank: make_prompt_cache(stages[rank]) for rank in (0, 1)}
    kinds = ["RotatingKVCache", "KVCache"] if arch == "llama_swa" else ["KVCache"] * 2
    assert [type(c).__name__ for c in caches[0]] == [type(c).__name__ for c in caches[1]] == kinds
    reference_cache = make_prompt_cache(reference)
    prompt = mx.array([[3 + (7 * i) % 200 for i in range(12)]])
    for step, tokens in enumerate((prompt, prompt[:, :3], prompt[:, :1])):
        want = reference(tokens, cache=reference_cache)
        stages[1](tokens, cache=caches[1])
        got = stages[0](tokens, cache=caches[0])
        assert not wire and sent[-1][1] == 0  # rank 1 sent once, to rank 0, which took it
        assert got.shape == want.shape and mx.array_equal(got, want), (step, mx.abs(got - want).max().item())
    h = reference.model.embed_tokens(prompt)
    for layer in reference.model.layers[:2]:
        window = reference.model.sliding_window if getattr(layer, "use_sliding", False) else None
        h = layer(h, create_attention_mask(h, None, window_size=window), None)
    assert mx.array_equal(sent[0][0], h)


# -- the server ----------------------------------------------------------------------------------------------------

SERVE_TOKENS = 16


def running(procs: list[subprocess.Popen], folder: Path) -> bool:
    """True while every process runs; fails the test, with their stderr (folder/err*.txt), once one has ended."""
    if all(p.poll() is None for p in procs):
        return True
    pytest.fail(
        f"a rank ended early (exit codes {[p.poll() for p in procs]}): "
        f"{[(f.name, f.read_text()[-3000:]) for f in sorted(folder.glob('err*.txt'))]}"
    )


def serving_line(err: Path) -> str | None:
    """Rank 0's line that says where it serves (`[dflash2] serving ... on http://HOST:PORT`), once it has one."""
    lines = [
        line for line in err.read_text().splitlines() if line.startswith("[dflash2] serving ") and " on http://" in line
    ]
    return lines[0] if lines else None


@pytest.mark.slow
def test_serve_under_two_processes_matches_one_process(tmp_path):
    """`dflash2 serve --tensor-parallel` as two ring processes (adaptive mode: the cycle costs measured at startup, both
    processes running those forwards): the openai client's T = 0 chat answers, streamed and not, are mlx-lm's
    greedy text of the same prompts in one process; a second turn reuses the first's cached prefix, a branching
    turn a copy of it (copied in both processes: the turn it branched from still answers the same after); /health
    says the target is sharded and batching is off; SIGTERM to rank 0 ends both processes with 0, and only rank 0
    ever serves."""
    import urllib.request

    import openai
    from mlx_lm.generate import generate as mlx_lm_generate
    from mlx_lm.utils import load as mlx_lm_load

    # qwen3: a qwen2 folder's tokenizer loads as transformers' Qwen2Tokenizer, which drops the tiny words
    target = save_target(tmp_path / "target", "qwen3")
    model, tokenizer = mlx_lm_load(str(target))
    drafter = save_drafter(tmp_path / "drafter", make_drafter(model, block_size=8, mask_token_id=5))

    def expected(messages: list[dict]) -> str:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return mlx_lm_generate(model, tokenizer, ids, max_tokens=SERVE_TOKENS)

    command = [
        *CLI,
        "serve",
        "--model",
        str(target),
        "--draft-model",
        str(drafter),
        "--tensor-parallel",
        "--backend",
        "ring",
        "--port",
        "0",
        "--kernels",
        "mlx",
        "--max-tokens",
        str(SERVE_TOKENS),
        "--connect-timeout",
        "60",
    ]
    folder = tmp_path / "launch"
    procs = start_ranks(
        [command, command],
        folder,
        env={"DFLASH2_COSTS": str(tmp_path / "costs.json")},  # measured anew
        ready=lambda procs: running(procs, folder) and serving_line(folder / "err0.txt") is not None,
    )
    try:
        port = int(serving_line(folder / "err0.txt").rsplit(":", 1)[1])  # --port 0: the port the OS gave it
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)

        def chat(messages: list[dict], stream: bool) -> tuple[str, int]:
            """(the answer's text, the prompt tokens taken from the prompt cache)."""
            if not stream:
                r = client.chat.completions.create(model="default_model", messages=messages, temperature=0)
                return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens
            text, cached = "", None
            for chunk in client.chat.completions.create(
                model="default_model",
                messages=messages,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            ):
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                if chunk.usage is not None:
                    cached = chunk.usage.prompt_tokens_details.cached_tokens
            return text, cached

        turn1 = [{"role": "user", "content": "w3 w14 w15 w92 w7"}]
        a1, cached1 = chat(turn1, stream=True)
        assert a1 == expected(turn1) and a1 and cached1 == 0
        turn2 = [*turn1, {"role": "assistant", "content": a1}, {"role": "user", "content": "w40 w5 w17"}]
        a2, cached2 = chat(turn2, stream=True)
        assert a2 == expected(turn2)
        first_prompt = len(tokenizer.apply_chat_template(turn1, add_generation_prompt=True))
        assert cached2 >= first_prompt  # the first turn's prompt at least, from its slot
        branch = [*turn1, {"role": "assistant", "content": a1}, {"role": "user", "content": "w6 w71 w8 w100"}]
        a3, cached3 = chat(branch, stream=False)
        assert a3 == expected(branch) and cached3 >= first_prompt  # a copy of the second turn's slot, cut back
        again, cached4 = chat(turn2, stream=False)  # the slot the branch was copied from, whole in both processes
        assert again == a2 and cached4 > cached2

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=60) as response:
            health = json.loads(response.read())
        assert health["sharded"]["mode"] == "tensor" and health["sharded"]["processes"] == 2
        assert health["sharded"]["batching"] is False and health["batch"]["decode_concurrency"] == 1
        assert health["batch"]["batched_steps"] == 0

        procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    errors = [(folder / f"err{r}.txt").read_text() for r in (0, 1)]
    assert codes == [0, 0], errors
    assert "sharded tensor-parallel over 2 processes: requests run one at a time" in errors[0]
    assert "serving" not in errors[1] and "measuring this machine's cycle costs" in errors[0], errors
