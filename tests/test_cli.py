"""The `dflash2` command, in process and as installed from a wheel (outside the checkout)."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import numpy as np
import pytest

from dflash2_apps.cli import main, make_parser

ROOT = Path(__file__).resolve().parents[1]
JSON_FIELDS = {
    "text",
    "tokens",
    "prompt_tokens",
    "generation_tokens",
    "accepted",
    "tau",
    "cycles",
    "generation_tps",
    "prompt_tps",
    "peak_memory_gb",
    "finish_reason",
    "verify_mode",
    "block_size",
}


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["generate", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_and_lossless_through_the_cli(tiny_pair, capsys):
    target, drafter = tiny_pair
    common = ("--model", target, "--prompt", "w1 w2 w3", "--max-tokens", 21, "--json")
    code, out, _ = run_cli(capsys, *common, "--draft-model", drafter, "--block-size", 5, "--verify-mode", "dflash")
    assert code == 0
    spec = json.loads(out)
    assert JSON_FIELDS <= spec.keys()
    assert spec["verify_mode"] == "dflash" and spec["block_size"] == 5
    assert spec["generation_tokens"] == len(spec["tokens"]) == 21
    accepted, cycles = spec["accepted"], spec["cycles"]
    assert cycles == len(accepted) > 0 and all(0 <= a <= 4 for a in accepted)
    assert spec["tau"] == pytest.approx((sum(accepted) + cycles) / cycles)  # bonus included
    # the prefill token and each cycle's accepted drafts + bonus reach the 21 tokens, the last cycle is needed
    assert 1 + sum(a + 1 for a in accepted) >= 21 > 1 + sum(a + 1 for a in accepted[:-1])
    assert spec["tau"] < 1.25, accepted  # tiny_pair's drafter is random: it accepts (almost) nothing
    assert spec["prompt_tokens"] == 5  # "<|user|> w1 w2 w3 <|assistant|>": the chat template was applied
    code, out, _ = run_cli(capsys, *common, "--verify-mode", "off")
    plain = json.loads(out)
    assert plain["tokens"] == spec["tokens"] and plain["text"] == spec["text"]
    assert plain["verify_mode"] == "off" and plain["cycles"] == 0 and plain["tau"] is None
    code, out, _ = run_cli(capsys, *common, "--verify-mode", "off", "--ignore-chat-template")
    assert json.loads(out)["prompt_tokens"] == 3
    code, out, _ = run_cli(capsys, *common, "--draft-model", drafter)  # the default: adaptive, up to the trained 8
    adaptive = json.loads(out)
    assert adaptive["verify_mode"] == "adaptive" and adaptive["block_size"] == 8
    assert adaptive["tokens"] == plain["tokens"]
    assert adaptive["plain_tokens"] + sum(adaptive["accepted"]) + adaptive["cycles"] + 1 >= 21


def test_streaming_output_ends_with_a_summary(tiny_pair, capsys):
    target, drafter = tiny_pair
    code, out, err = run_cli(
        capsys,
        "--model",
        target,
        "--draft-model",
        drafter,
        "--prompt",
        "w5",
        "--max-tokens",
        10,
        "--temp",
        0.7,
        "--seed",
        3,
    )
    assert code == 0
    words = len(out.split())  # one word per token; EOS is not rendered
    assert 1 <= words <= 10
    assert f"[adaptive B<=8] {words + (words < 10)} tokens at" in err, err
    assert f"{words + (words < 10) - 1} tokens by plain steps" in err or "tau" in err  # all plain, or some cycles
    assert ("finish: length" if words == 10 else "finish: stop") in err


@pytest.mark.parametrize(
    "args, message",
    [
        (("--prompt", "x"), "--verify-mode adaptive needs --draft-model"),
        (("--draft-model", "/no/such/drafter"), "'/no/such/drafter' is neither an existing path"),
        (("--draft-model", "{drafter}", "--block-size", "12"), "block size 12 is outside 2..8"),
        (("--draft-model", "{drafter}", "--top-p", "2"), "top_p must be in (0, 1]"),
        (("--draft-model", "{drafter}", "--min-p", "1.5"), "min_p must be in [0, 1] (0 = off), got 1.5"),
    ],
)
def test_errors_are_one_clear_line(tiny_pair, capsys, args, message):
    target, drafter = tiny_pair
    args = [a.format(drafter=drafter) for a in args]
    code, out, err = run_cli(capsys, "--model", target, *args)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_bad_input_is_one_line_and_exit_2(capsys):
    assert main(["info"]) == 2  # neither a drafter nor --self-check: a ValueError of the command's own
    assert (
        capsys.readouterr().err == "dflash2 info: error: give a drafter folder or hub id (dflash2 info PATH), "
        "--self-check or --assets\n"
    )
    assert main(["info", "/no/such/drafter"]) == 2  # a FileNotFoundError of the library's
    assert capsys.readouterr().err.count("\n") == 1


def test_an_unexpected_error_names_its_type_and_causes(capsys, monkeypatch):
    """An error that is not bad input (a bug, a broken file, a failing device) is not passed off as one: its
    type, message and every exception it came from, exit 1, and how to see the traceback."""
    import dflash2_apps.info

    def broken(path):
        try:
            try:
                raise KeyError("weights")
            except KeyError as e:
                raise OSError("the safetensors header is cut short") from e
        except OSError:
            raise RuntimeError("[load] could not read the drafter")  # noqa: B904 - chained implicitly (__context__)

    monkeypatch.setattr(dflash2_apps.info, "drafter_info", broken)
    assert main(["info", "somewhere"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "dflash2 info: error: RuntimeError: [load] could not read the drafter",
        "  caused by OSError: the safetensors header is cut short",
        "  caused by KeyError: 'weights'",
        "(rerun with --verbose for the traceback)",
    ]


@pytest.mark.slow
def test_verbose_shows_the_traceback(capsys, monkeypatch):
    import dflash2_apps.info

    with pytest.raises(FileNotFoundError):  # raised on, bad input too: Python prints the traceback
        main(["--verbose", "info", "/no/such/drafter"])
    monkeypatch.setattr(dflash2_apps.info, "drafter_info", lambda path: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        main(["--verbose", "info", "somewhere"])
    with pytest.raises(ZeroDivisionError):  # the flag after the command too
        main(["info", "somewhere", "--verbose"])
    run = subprocess.run(
        [sys.executable, "-m", "dflash2_apps.cli", "info", "/no/such/drafter", "--verbose"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1
    assert run.stderr.startswith("Traceback (most recent call last):") and "in resolve_path" in run.stderr
    assert (
        run.stderr.splitlines()[-1] == "FileNotFoundError: '/no/such/drafter' is neither an existing path nor "
        "a hub id (owner/name)"
    )


@pytest.mark.slow
def test_only_the_running_commands_module_is_imported():
    """`dflash2 export ...` imports the export module, not the bench's or the server's (start-up time), and
    `dflash2 --help` still lists every command."""
    code = (
        "import sys; from dflash2_apps.cli import COMMANDS, make_parser, module_of; "
        "make_parser('export').parse_args(['export', '--mlx-path', 'a', '--hf-path', 'b']); "
        "print(sorted(c for c in COMMANDS if module_of(c) in sys.modules)); "
        "print(sorted(make_parser('export')._subparsers._group_actions[0].choices))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        "['export']",
        str(
            sorted(
                [
                    "generate",
                    "serve",
                    "chat",
                    "convert",
                    "export",
                    "data",
                    "train",
                    "bench",
                    "replay",
                    "tree-sim",
                    "info",
                ]
            )
        ),
    ]


def test_replay_and_tree_sim_flags_parse_under_both_spellings():
    """`dflash2 replay` and `dflash2 tree-sim` take their short flag names and bench's longer ones (what
    `bench --replay` and `bench --tree-sim` were given) into the same places."""
    replay = make_parser("replay")
    short = replay.parse_args(["replay", "--traces", "t.json", "--jitter", "3", "--walk", "viterbi", "--costs", "c"])
    assert (short.replay_traces, short.replay_jitter, short.walk, short.costs) == ("t.json", 3, "viterbi", "c")
    assert short.temp is None and short.max_tokens == 128 and short.run.__module__ == "dflash2_apps.replay"
    long = replay.parse_args(["replay", "--replay-traces", "t.json", "--replay-jitter", "3"])
    assert (long.replay_traces, long.replay_jitter, long.walk) == ("t.json", 3, "greedy")
    sim = make_parser("tree-sim")
    short = sim.parse_args(["tree-sim", "data", "--budgets", "1,4", "--samples", "2", "--block-sizes", "4"])
    long = sim.parse_args(
        ["tree-sim", "data", "--tree-budgets", "1,4", "--tree-sim-samples", "2", "--block-sizes", "4"]
    )
    for args in (short, long):
        assert (args.tree_sim, args.tree_budgets, args.tree_sim_samples, args.block_sizes) == ("data", "1,4", 2, "4")
    assert short.run.__module__ == "dflash2_apps.tree_sim"
    with pytest.raises(SystemExit):
        sim.parse_args(["tree-sim"])  # DATA is required
    with pytest.raises(SystemExit):
        replay.parse_args(["replay", "--temp", "0.7"])  # greedy answers only: no --temp


def test_replay_runs_as_a_command_and_bench_replay_says_so(tiny_pair, tmp_path, capsys):
    """`dflash2 replay` writes the replay report; `bench --replay` (bench's flag names) says once on stderr that it
    is `dflash2 replay` now and writes the same report."""
    from dflash2_mlx.adaptive import FixedBlocks
    from dflash2_mlx.costs import CostModel
    from dflash2_mlx.replay import Trace, replay

    target, drafter = tiny_pair
    suite, costs, traces = tmp_path / "prompts.jsonl", tmp_path / "costs.json", tmp_path / "traces.json"
    suite.write_text(json.dumps({"prompt": "w1 w2 w3 w4"}) + "\n")
    curve = {"verify_s": [0.1 + 0.01 * n for n in range(8)], "draft_s": [0.02] * 7}  # the drafter's blocks: to 8
    costs.write_text(json.dumps(curve))
    common = [
        "--model",
        str(target),
        "--draft-model",
        str(drafter),
        "--prompts",
        str(suite),
        "--num-prompts",
        "1",
        "--max-tokens",
        "12",
        "--block-sizes",
        "3",
        "--costs",
        str(costs),
    ]
    notice = "dflash2 bench: --replay is the command `dflash2 replay` now"
    assert main(["replay", *common, "--traces", str(traces), "--json", str(tmp_path / "a.json")]) == 0
    assert notice not in capsys.readouterr().err
    report = json.loads((tmp_path / "a.json").read_text())
    (row,) = report["replay"]
    kept = next(iter(json.loads(traces.read_text()).values()))
    trace = Trace(kept["tokens"], {int(B): d for B, d in kept["drafts"].items()})
    assert row["fixed"]["3"] == pytest.approx(
        replay(trace, FixedBlocks(3), CostModel(**curve), 12).tokens_per_s * curve["verify_s"][0]
    )
    assert main(["bench", "--replay", *common, "--replay-traces", str(traces), "--json", str(tmp_path / "b.json")]) == 0
    assert capsys.readouterr().err.count(notice) == 1
    assert json.loads((tmp_path / "b.json").read_text())["replay"] == report["replay"]
    assert main(["replay", *common, "--jitter", "-1"]) == 2
    assert "--jitter/--replay-jitter is a number of curves (0: none), got -1" in capsys.readouterr().err


def test_tree_sim_runs_as_a_command_and_bench_tree_sim_says_so(tiny_pair, tmp_path, capsys):
    """`dflash2 tree-sim DATA` prints the teacher-forced tau table; `bench --tree-sim DATA` says once on stderr that
    it is `dflash2 tree-sim DATA` now and prints the same table."""
    from dflash2_mlx.formats.shards import Sample, write_shard

    target, drafter = tiny_pair
    tokens = np.array([3, 9, 4, 1, 7] + [10 + (7 * i) % 200 for i in range(20)], np.int32)
    write_shard(tmp_path / "shard-00000.npz", [Sample("a", tokens, 5, True), Sample("b", tokens, 5, False)])
    common = ["--model", str(target), "--draft-model", str(drafter)]
    notice = "dflash2 bench: --tree-sim DATA is the command `dflash2 tree-sim DATA` now"
    assert main(["tree-sim", str(tmp_path), *common, "--budgets", "1,4", "--markdown", str(tmp_path / "a.md")]) == 0
    out, err = capsys.readouterr()
    assert notice not in err
    table = (tmp_path / "a.md").read_text()
    assert table.startswith(f"Made by `dflash2 tree-sim {tmp_path} --model {target} ")
    assert f"teacher-forced tau on 1 held-out samples of {tmp_path}" in out and "| tree 1 | tree 4 |" in out
    assert "| drafter | 8 | 13 | " in out  # 20 response tokens: the anchors with 7 after them
    assert main(["bench", "--tree-sim", str(tmp_path), *common, "--tree-budgets", "1,4"]) == 0
    alias_out, alias_err = capsys.readouterr()
    assert alias_err.count(notice) == 1 and alias_out == out


@pytest.mark.slow
def test_installed_wheel_runs_outside_the_checkout(tiny_pair, tmp_path):
    """Build the wheel, install it into a fresh environment (dependencies from this one), and run the
    installed `dflash2` from a folder that is not the checkout."""
    target, drafter = tiny_pair
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, ROOT],
        check=True,
        cwd=tmp_path,
    )
    env_dir = tmp_path / "env"
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    # a venv made from a venv (.venv) sees the base Python's site-packages, not this environment's: add them
    purelib = sysconfig.get_path("purelib", vars={"base": str(env_dir), "platbase": str(env_dir)})
    Path(purelib, "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    python = env_dir / "bin" / "python"
    (wheel,) = wheels.glob("dflash2_mlx-*.whl")
    # everything the checkout has must be in the wheel (an editable install elsewhere could hide a gap)
    import zipfile

    shipped = set(zipfile.ZipFile(wheel).namelist())
    needed = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "dflash2_mlx").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    needed |= {"dflash2_apps/" + p.name for p in (ROOT / "apps").glob("*.py")}
    needed |= {"dflash2_metal/" + p.name for p in (ROOT / "metal").iterdir() if p.suffix in (".py", ".metal", ".h")}
    assert needed <= shipped, sorted(needed - shipped)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # (a checkout there looks installed to pip)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", wheel],
        check=True,
        cwd=tmp_path,
        env=env,
    )
    where = subprocess.run(
        [
            python,
            "-c",
            "import dflash2_mlx, dflash2_apps, dflash2_metal; from dflash2_mlx.kernels import kernel; "
            "kernel('lattice_path'); print(dflash2_mlx.__file__, dflash2_apps.__file__, dflash2_metal.__file__)",
        ],
        check=True,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    ).stdout
    assert str(ROOT) not in where and str(env_dir) in where
    dflash2 = env_dir / "bin" / "dflash2"
    help_text = subprocess.run(
        [dflash2, "generate", "--help"], check=True, cwd=tmp_path, env=env, capture_output=True, text=True
    ).stdout
    assert "--draft-model" in help_text and "--verify-mode" in help_text
    result = subprocess.run(
        [
            dflash2,
            "generate",
            "--model",
            target,
            "--draft-model",
            drafter,
            "--prompt",
            "w7 w8",
            "--max-tokens",
            "9",
            "--json",
        ],
        check=True,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    out = json.loads(result.stdout)
    assert out["generation_tokens"] == 9 and out["verify_mode"] == "adaptive"
    if Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0").exists():  # installed by apps/install.sh
        assert out["runtime"]["blas"] == "openblas"  # the command restarted itself with it preloaded


def test_dflash2_flags(tiny_pair, tiny_dflash2, capsys):
    target, _ = tiny_pair
    common = ("--model", target, "--prompt", "w1 w2", "--max-tokens", 15, "--json")
    code, out, _ = run_cli(capsys, *common, "--verify-mode", "off")
    plain = json.loads(out)["tokens"]
    for extra in (["--path", "viterbi"], ["--path", "greedy", "--draft-quant", "w8a32:gs32"], ["--block-size", "16"]):
        code, out, _ = run_cli(capsys, *common, "--draft-model", tiny_dflash2, *extra)
        r = json.loads(out)
        assert code == 0 and r["tokens"] == plain, extra
    assert r["block_size"] == 16
    code, out, _ = run_cli(capsys, *common, "--draft-model", tiny_dflash2, "--verify-mode", "dflash")
    assert json.loads(out)["block_size"] == 5  # DFlash 2's default cap, as oMLX
    code, out, _ = run_cli(capsys, *common, "--draft-model", tiny_dflash2)
    assert json.loads(out)["block_size"] == 16  # adaptive mode may use the trained size


def test_omlx_settings_drive_the_run(tiny_pair, tiny_dflash2, tmp_path, capsys):
    target, _ = tiny_pair
    settings = tmp_path / "model_settings.json"
    settings.write_text(
        json.dumps(
            {
                "version": 1,
                "models": {
                    "tiny": {
                        "dflash_enabled": True,
                        "dflash_draft_model": str(tiny_dflash2),
                        "dflash_block_size": 3,
                        "dflash_draft_quant_enabled": True,
                        "dflash_draft_quant_weight_bits": 8,
                        "dflash_draft_quant_activation_bits": 32,
                        "dflash_draft_quant_group_size": 32,
                    }
                },
            }
        )
    )
    code, out, err = run_cli(
        capsys,
        "--model",
        target,
        "--omlx-settings",
        settings,
        "--omlx-model",
        "tiny",
        "--prompt",
        "w3",
        "--max-tokens",
        6,
        "--json",
    )
    r = json.loads(out)
    # no dflash_verify_mode: oMLX's default, adaptive, which runs as adaptive here
    assert code == 0 and r["verify_mode"] == "adaptive" and r["block_size"] == 3 and r["draft_quant"] == "w8a32:gs32"
    assert "oMLX settings" not in err
    code, out, _ = run_cli(
        capsys,
        "--model",
        target,
        "--omlx-settings",
        settings,
        "--omlx-model",
        "tiny",
        "--prompt",
        "w3",
        "--max-tokens",
        6,
        "--json",
        "--block-size",
        2,
    )
    assert json.loads(out)["block_size"] == 2  # the command line wins


def test_info(tiny_dflash2, capsys):
    assert main(["info", str(tiny_dflash2), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    params = info["parameters"]
    assert set(params) == {"attention", "mlp", "norms", "fc", "conv", "selector", "total"}
    assert sum(v for k, v in params.items() if k != "total") == params["total"]
    assert info["config"]["architecture"] == "DFlash2DraftModel" and info["config"]["selector_top_k"] == 8
    assert main(["info", str(tiny_dflash2)]) == 0
    table = capsys.readouterr().out
    assert "selector" in table and "conv" in table and "100.0%" in table


def test_info_counts_the_published_checkpoint():
    from dflash2_mlx.info import parameter_counts

    header = json.loads((ROOT / "tests" / "fixtures" / "dflash2-safetensors-header.json").read_text())
    counts = parameter_counts({k: v["shape"] for k, v in header.items()})
    assert counts["total"] == 2_772_159_744  # as the fixture's source states
    assert counts["selector"] == 2 * 202048 * 256 + 256 * 6656
    assert counts["conv"] == 5 * 2 * (2 * 2 * 6656 + 1664 * 6656)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_info_unpacks_mlx_quantized_weights(bits):
    """MLX packs `bits`-bit values into uint32 words across rows' ends (3-, 5-, 6-bit values straddle
    words): a quantized Linear counts as the dense matrix it was made from."""
    import mlx.nn as nn

    from dflash2_mlx.info import parameter_counts

    q = nn.QuantizedLinear.from_linear(nn.Linear(160, 96, bias=False), group_size=32, bits=bits)
    shapes = {f"layers.0.mlp.up_proj.{k}": list(v.shape) for k, v in q.parameters().items()}
    assert parameter_counts(shapes, bits) == {"mlp": 96 * 160, "total": 96 * 160}


@pytest.mark.parametrize("bits", [3, 5, 6])
def test_info_counts_a_quantized_drafter_as_its_source(tmp_path, bits):
    from helpers import synthetic_checkpoint

    from dflash2_mlx.convert import convert
    from dflash2_mlx.formats.quantize import DraftQuant
    from dflash2_mlx.info import drafter_info

    src = synthetic_checkpoint(tmp_path / "hf", "dflash2")
    mlx_dir = convert(str(src), tmp_path / "q", quant=DraftQuant(bits, 16, 32), min_quantized_size=0)
    assert json.loads((mlx_dir / "config.json").read_text())["quantization"]["bits"] == bits
    assert drafter_info(str(mlx_dir))["parameters"] == drafter_info(str(src))["parameters"]
