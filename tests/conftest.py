"""The suite's hooks and fixtures: OpenBLAS preloaded, the kernel self-check cleared per test, and session
fixtures built from helpers.py's tiny real parts (a word-level tokenizer, a tiny target and drafter folders, the
real SmolLM2 default target)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from helpers import (
    batched_decide_on,
    cpu_batched_costs,
    make_dflash2_drafter,
    make_drafter,
    make_target,  # noqa: F401  (test_torch_engine.py imports it from here)
    save_drafter,
    save_target,
    save_tokenizer,
    smollm2_or_skip,
)
from mlx_lm.utils import load_model


def pytest_configure(config):
    """Run the suite with OpenBLAS preloaded, as the CLI runs (the SmolLM2 tests are ~7x slower on MLX's
    bundled reference BLAS). Global output capture is stopped first so the new process keeps the terminal."""
    from dflash2_apps.openblas import restart_with_openblas

    capture = config.pluginmanager.getplugin("capturemanager")
    restart_with_openblas(
        ["-m", "pytest", *config.invocation_params.args], before_exec=capture.stop_global_capturing if capture else None
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the hub
    if getattr(config.option, "numprocesses", None):
        # pytest-xdist workers, one per core, inherit this before they start: each OpenBLAS on one thread
        # instead of every worker's threads contending for all the cores
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # adaptive mode's measured costs go to a file of this run's, never to the user's cache
    os.environ["DFLASH2_COSTS"] = str(Path(config.rootpath) / ".pytest_cache" / f"costs-{os.getpid()}.json")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    """A test that uses the real SmolLM2 target (fixtures `smollm2`, `smollm2_path`: the model loaded, or read, once
    per worker, 10-30 s on 2 cores) is marked slow, wherever it is."""
    for item in items:
        if {"smollm2", "smollm2_path"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _fresh_kernel_check():
    """Every test starts without the Metal kernels' self-check results (they are kept per process)."""
    from dflash2_mlx import kernel_check

    kernel_check.clear()
    yield
    kernel_check.clear()


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """The word-level tokenizer, loaded the way mlx-lm loads a model's tokenizer."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(folder)
    return load_tokenizer(folder)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A tiny qwen3 target folder and a DFlash v1 drafter folder for it."""
    root = tmp_path_factory.mktemp("tiny")
    target_dir = save_target(root / "target")
    model, _ = load_model(target_dir)
    drafter = make_drafter(model, block_size=8, mask_token_id=5)
    return target_dir, save_drafter(root / "drafter", drafter)


@pytest.fixture(scope="session")
def tiny_dflash2(tiny_pair, tmp_path_factory):
    """A DFlash 2 drafter folder for the tiny_pair target."""
    model, _ = load_model(tiny_pair[0])
    drafter = make_dflash2_drafter(model, block_size=16, mask_token_id=5)
    return save_drafter(tmp_path_factory.mktemp("tiny2") / "drafter", drafter)


@pytest.fixture(scope="session")
def smollm2_path():
    return smollm2_or_skip()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from dflash2_mlx.loading import load_target

    return load_target(str(smollm2_path), dtype="float32")


@pytest.fixture
def terminal_sigint():
    """SIGINT handled as in a terminal (KeyboardInterrupt) for the test, whatever the suite was started with: a
    suite started in the background (`nohup ... &`) ignores SIGINT, and its children would inherit that (exec
    resets a handler to the default, but not "ignore")."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def _batched_costs_of_a_cpu(monkeypatch):
    """Servers decide batched cycles on a CPU-like curve (none pays: mlx-lm's batch, as before) unless a test
    gives another (`batched_decide_on`): the tiny models' own timings would make the choice this machine's load."""
    batched_decide_on(monkeypatch, cpu_batched_costs)
