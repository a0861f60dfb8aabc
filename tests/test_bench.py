"""`dflash2 bench`: a quick run on tiny models, every field in its JSON, and a lossless check that fails loudly."""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import mlx.core as mx
import pytest
from rich.cells import cell_len
from rich.console import Console

import dflash2_mlx.sampling as sampling
from dflash2_apps.bench_methods import Method, Run, drafter_names, methods_for
from dflash2_apps.bench_report import COLUMNS, render, render_per_prompt, source_commit
from dflash2_apps.bench_runs import accepted_per_cycle
from dflash2_apps.bench_stats import adaptive_summary, add_cycle_parts, method_row, per_prompt_rows
from dflash2_apps.cli import main
from dflash2_mlx.adaptive import FixedBlocks
from dflash2_mlx.costs import CostModel
from dflash2_mlx.loops import repetition_share
from dflash2_mlx.prompts import load_suite
from dflash2_mlx.replay import Trace, replay

ROW_FIELDS = {
    "method",
    "kind",
    "drafter",
    "block_size",
    "walk",
    "temperature",
    "generation_tps_median",
    "generation_tps_min",
    "generation_tps_max",
    "speedup",
    "tau",
    "cycles",
    "acceptance_by_position",
    "prompt_tps_median",
    "ttft_s_median",
    "peak_memory_gb",
    "draft_share",
    "token_sha256",
    "lossless",
}


@pytest.mark.slow
def test_quick_bench(tiny_pair, tiny_dflash2, tmp_path, capsys):
    target, drafter = tiny_pair
    code = main(
        [
            "bench",
            "--model",
            str(target),
            "--draft-model",
            str(drafter),
            "--draft-model",
            str(tiny_dflash2),
            "--quick",
            "--block-sizes",
            "4,8",
            "--temp",
            "0",
            "--temp",
            "1",
            "--json",
            str(tmp_path / "b.json"),
            "--markdown",
            str(tmp_path / "b.md"),
            "--copyspec-modes",
            "off",
        ]
    )  # the drafters' own profiles
    assert code == 0
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["errors"] == []
    rows = report["results"]
    methods = {r["method"] for r in rows}
    assert {"mlx-lm", "plain", "drafter B=4", "drafter B=8"} <= methods
    assert {"drafter#2 B=4 greedy", "drafter#2 B=8 viterbi"} <= methods  # DFlash 2, both walks
    for r in rows:
        assert ROW_FIELDS <= r.keys()
        if r["temperature"] == 0:
            assert r["lossless"] is True
        if r["kind"] == "dflash":
            profile = r["acceptance_by_position"]
            assert len(profile) == r["block_size"] - 1 and profile == sorted(profile, reverse=True)  # suffix decay
            assert r["cycles"] > 0 and all(0 <= p <= 1 for p in profile)
            # two counts of one record: mean accepted drafts = the summed share of cycles accepting position j
            assert r["tau"] == pytest.approx(1 + sum(profile))
            # both drafters are random: (almost) nothing accepted (measured: tau 1.0 at T=0, <= 1.12 at T=1)
            assert r["tau"] < (1.1 if r["temperature"] == 0 else 1.5), r
            assert 0 < r["draft_share"] < 1
    assert {r["temperature"] for r in rows} == {0, 1}
    ctx = report["context"]
    assert ctx["runtime"]["backend"] in ("cpu", "metal") and ctx["dtype"] == "float32" and ctx["trials"] == 1
    # the code that made it: the package's version, and the commit of this checkout (a commit git knows: HEAD may
    # have moved on since, in a tree others commit to)
    assert ctx["version"] == importlib.metadata.version("dflash2-mlx")
    commit = ctx["commit"].removesuffix("-dirty")
    known = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=os.path.dirname(__file__))
    assert known.returncode == 0, commit
    # the prompts it ran (the first two of the math suite), and the cost curves adaptive mode decided on: the
    # measured ones in the costs cache, in plain steps
    assert ctx["prompts_sha256"] == hashlib.sha256(json.dumps(load_suite("math", 2)).encode()).hexdigest()
    cached = json.loads(open(os.environ["DFLASH2_COSTS"]).read()).values()
    assert {c["drafter"] for c in ctx["costs"]} == {"drafter", "drafter#2"} and report["costs"] == ctx["costs"]
    for c in ctx["costs"]:
        assert any(
            c["step_s"] == k["verify_s"][0]
            and c["draft_steps"] == [s / c["step_s"] for s in k["draft_s"]]
            and c["verify_steps"] == [s / c["step_s"] for s in k["verify_s"]]
            for k in cached
        ), c
    assert ctx["drafter_names"] == {"drafter": "v1", "drafter#2": "DFlash 2"}
    assert {r["label"] for r in rows} >= {"v1 · adaptive", "v1 · B=4", "DFlash 2 · B=8 viterbi", "mlx-lm", "plain"}
    md = (tmp_path / "b.md").read_text()
    assert "| method | T | tok/s" in md and "accepted by position" in md
    # the report opens with the command that made it (shell-quoted), the JSON keeps it too
    assert md.startswith(f"Made by `dflash2 bench --model {target} --draft-model {drafter} ")
    assert ctx["command"] == md.split("`")[1] and "--markdown " + str(tmp_path / "b.md") in ctx["command"]
    # what the target said, so a reader can see it is not babble (every method agreeing proves nothing then)
    assert report["sample_output"]["temperature"] == 0 and report["sample_output"]["text"]
    assert "mlx-lm output of prompt 1 (T=0): " in md
    assert "speedup over mlx-lm" in capsys.readouterr().out
    # adaptive mode per prompt (one row per drafter, prompt and temperature), and at T = 1 the shadow calibration
    assert len(report["per_prompt"]) == 2 * 2 * 2 and "adaptive mode per prompt" in md
    calibration = report["shadow_calibration"]
    assert {(c["drafter"], c["block_size"]) for c in calibration} == {
        (d, B) for d in ("drafter", "drafter#2") for B in (4, 8)
    }
    # a block of B commits 1..B tokens, expected and measured alike; the relative error is their ratio's
    assert all(
        c["temperature"] == 1
        and c["probes"] > 0
        and 1 <= c["expected_tau"] <= c["block_size"]
        and 1 <= c["measured_tau"] <= c["block_size"]
        and c["relative"] == pytest.approx(c["expected_tau"] / c["measured_tau"] - 1)
        for c in calibration
    )
    # the probes propose each drafter's full block (8 and 16): the rows of smaller fixed blocks say so
    assert {c["drafter"]: c["probe_block"] for c in calibration} == {"drafter": 8, "drafter#2": 16}
    assert md.count("shadow probes (blocks of 8)") == 1 and md.count("shadow probes (blocks of 16)") == 2


def test_classic_speculative_baseline(tiny_pair, tmp_path):
    """--baseline-draft-model adds mlx-lm's classic speculative decoding, and only to its own rows: the
    mlx-lm baseline stays plain (here the draft is the target itself, so every draft is accepted)."""
    target, drafter = tiny_pair
    assert (
        main(
            [
                "bench",
                "--model",
                str(target),
                "--draft-model",
                str(drafter),
                "--baseline-draft-model",
                str(target),
                "--quick",
                "--block-sizes",
                "4",
                "--json",
                str(tmp_path / "b.json"),
            ]
        )
        == 0
    )
    rows = {r["method"]: r for r in json.loads((tmp_path / "b.json").read_text())["results"]}
    classic = rows["mlx-lm speculative k=3"]
    assert classic["lossless"] is True and classic["kind"] == "mlx-lm-spec"
    assert rows["mlx-lm"]["kind"] == "mlx-lm" and rows["mlx-lm"]["tau"] is None
    # its own drafts: (nearly) every cycle accepts all 3, so tau is close to 4 and the profile is flat
    assert classic["cycles"] > 0 and classic["tau"] > 3.5
    assert len(classic["acceptance_by_position"]) == 3 and min(classic["acceptance_by_position"]) > 0.8


def test_classic_cycles_from_mlx_lm_flags():
    """mlx-lm yields each cycle's accepted drafts (from_draft=True) and then the target's token."""
    flags = [False, True, True, False, False, True, False, True, True]  # the last run was cut by max_tokens
    assert accepted_per_cycle(flags) == [0, 2, 0, 1]


def test_a_lossy_method_is_an_error(tiny_pair, tmp_path, monkeypatch, capsys):
    target, drafter = tiny_pair

    def broken_accept(drafts, target_logits, metal=False):  # accepts every draft, right or wrong
        return mx.array(drafts.shape[0]), mx.argmax(target_logits[-1])

    monkeypatch.setattr(sampling, "accept_greedy", broken_accept)
    code = main(
        [
            "bench",
            "--model",
            str(target),
            "--draft-model",
            str(drafter),
            "--quick",
            "--block-sizes",
            "4",
            "--json",
            str(tmp_path / "b.json"),
        ]
    )
    report = json.loads((tmp_path / "b.json").read_text())
    assert code == 1
    assert any("drafter B=4 at T=0 produced different tokens" in e for e in report["errors"])
    # mlx-lm and plain are right; B=4 drafts through the broken rule every cycle. Adaptive mode drafts only
    # where its shadow probes (scored against plain decoding's own tokens) say this random drafter pays: its
    # row is wrong exactly when it drafted
    rows = {r["method"]: r for r in report["results"]}
    assert [r["lossless"] for r in report["results"]][:2] == [True, True] and rows["drafter B=4"]["lossless"] is False
    assert rows["drafter adaptive"]["lossless"] is (rows["drafter adaptive"]["cycles"] == 0)
    assert "NO (mismatch)" in capsys.readouterr().out


@pytest.mark.slow
def test_trials_alternate_the_order_of_the_methods(tiny_pair, tmp_path, monkeypatch):
    """Each prompt's methods back to back, A B C, then C B A from one prompt and one trial to the next: a drift
    across a pair costs every method the same (ABBA)."""
    import dflash2_apps.bench_runs as bench_runs

    target, drafter = tiny_pair
    calls, run_method = [], bench_runs.run_method

    def recorded(method, *args):
        calls.append(method.name)
        return run_method(method, *args)

    monkeypatch.setattr(bench_runs, "run_method", recorded)
    assert (
        main(
            [
                "bench",
                "--model",
                str(target),
                "--draft-model",
                str(drafter),
                "--block-sizes",
                "4",
                "--trials",
                "3",
                "--num-prompts",
                "2",
                "--max-tokens",
                "8",
                "--prompts",
                "math",
            ]
        )
        == 0
    )
    order = ["mlx-lm", "plain", "drafter adaptive", "drafter B=4"]
    back = order[::-1]
    # warm-up, then trials 1, 2, 3 of prompts 1 and 2
    assert calls == order + order + back + back + order + order + back


def test_per_prompt_rows_compare_adaptive_with_the_faster_of_plain_and_each_fixed_block():
    plain, adaptive, b3, b5 = (
        Method("plain", "plain"),
        Method("d adaptive", "adaptive", drafter_label="d"),
        Method("d B=3", "dflash", block_size=3, drafter_label="d"),
        Method("d B=5", "dflash", block_size=5, drafter_label="d"),
    )

    def runs(*tps):  # two trials of two prompts, 100 tokens each at these rates (trial 1 p1, p2, trial 2 p1, p2)
        r = [Run([0] * 100, t, 1.0, 0.1, 1.0, plain_tokens=50) for t in tps]
        return [r[:2], r[2:]]

    rows = per_prompt_rows(
        [plain, adaptive, b3, b5],
        {
            "plain": runs(10, 10, 10, 10),
            "d adaptive": runs(12, 9, 12, 9),
            "d B=3": runs(11, 8, 13, 8),
            "d B=5": runs(14, 6, 10, 6),
        },
        0.0,
    )
    assert [r["prompt"] for r in rows] == [1, 2]
    # prompt 1: B=3 at 11 and 13 tok/s is 200 tokens in 100/11 + 100/13 s; B=5: 100/14 + 100/10
    b3_tps, b5_tps = 200 / (100 / 11 + 100 / 13), 200 / (100 / 14 + 100 / 10)
    assert rows[0]["best_fixed"] == "d B=3" and rows[0]["best_fixed_tps"] == pytest.approx(b3_tps)
    assert rows[0]["fixed_tps"]["d B=5"] == pytest.approx(b5_tps)  # 11.67 < 11.92: B=5 is not the best
    assert rows[0]["vs_best"] == pytest.approx(12 / b3_tps) and rows[0]["vs_plain"] == pytest.approx(1.2)
    assert rows[1]["vs_best"] == pytest.approx(0.9) and rows[1]["plain_share"] == 0.5  # plain beats every block


def test_per_prompt_rows_give_each_ratio_its_range_over_trials_and_the_same_work_ratio_as_a_noise_band():
    plain, same, adaptive, b3 = (
        Method("plain", "plain"),
        Method("mlx-lm", "mlx-lm"),
        Method("d adaptive", "adaptive", drafter_label="d"),
        Method("d B=3", "dflash", block_size=3, drafter_label="d"),
    )

    def runs(*tps):  # trial 1 p1, p2, trial 2 p1, p2; 100 tokens each
        r = [Run([0] * 100, t, 1.0, 0.1, 1.0) for t in tps]
        return [r[:2], r[2:]]

    table = {
        "plain": runs(10, 10, 8, 10),
        "mlx-lm": runs(9, 10, 8, 11),
        "d adaptive": runs(12, 9, 10, 9),
        "d B=3": runs(11, 8, 13, 8),
    }
    rows = per_prompt_rows([same, plain, adaptive, b3], table, 0.0)
    # prompt 1, trial by trial: adaptive 12 vs plain 10 and B=3 11; then 10 vs 8 and 13
    assert rows[0]["vs_plain_trials"] == pytest.approx([12 / 10, 10 / 8])
    assert rows[0]["vs_best_trials"] == pytest.approx([10 / 13, 12 / 11])
    # mlx-lm over plain on prompt 1: 200 tokens in 100/9 + 100/8 s against 100/10 + 100/8 s
    assert rows[0]["same_work_vs_plain"] == pytest.approx((1 / 10 + 1 / 8) / (1 / 9 + 1 / 8))
    assert rows[1]["vs_plain_trials"] == pytest.approx([0.9, 0.9])
    assert rows[1]["same_work_vs_plain"] == pytest.approx((1 / 10 + 1 / 10) / (1 / 10 + 1 / 11))

    from rich.console import Console

    from dflash2_apps.bench_report import render_per_prompt

    md = "\n".join(render_per_prompt(rows, Console(file=io.StringIO(), width=200)))
    # every answer here is one token said 100 times: 92 of its 93 8-grams occurred earlier in it
    assert "| 0 | 1 | 100 | 99% | d | 8.9 | d B=3 |" in md and "1.23x (1.20-1.25)" in md and "(0.77-1.09)" in md
    assert "mlx-lm vs plain (the same work) per prompt 0.95-1.05x" in md
    assert "shorter than" not in md  # no max_tokens given: nothing to compare the answers' lengths with
    assert "shorter than" not in "\n".join(render_per_prompt(rows, Console(file=io.StringIO(), width=200), 100))
    table["d adaptive"][1][1] = Run([0] * 91, 9, 1.0, 0.1, 1.0)  # prompt 2 ends at EOS after 91 tokens in trial 2
    rows = per_prompt_rows([same, plain, adaptive, b3], table, 0.0)
    assert [r["tokens"] for r in rows] == [100, 95.5]
    md = "\n".join(render_per_prompt(rows, Console(file=io.StringIO(), width=200), 100))
    assert "| 0 | 2 | 95.5 | 99% | d |" in md
    assert "answers shorter than --max-tokens 100 (they ended at EOS): prompt 2 95.5 tokens" in md

    table["plain"][1][0] = None  # a trial without a plain run has no range
    assert per_prompt_rows([same, plain, adaptive, b3], table, 0.0)[0]["vs_plain_trials"] is None
    without = per_prompt_rows([plain, adaptive, b3], table, 0.0)  # no mlx-lm: no noise band
    assert without[0]["same_work_vs_plain"] is None
    assert "mlx-lm vs plain" not in "\n".join(render_per_prompt(without, Console(file=io.StringIO(), width=200)))


def brute_force_share(tokens: list[int], n: int = 8) -> float:
    """repetition_share counted the slow way: each window against every earlier one."""
    grams = [tokens[i : i + n] for i in range(len(tokens) - n + 1)]
    return sum(any(grams[j] == grams[i] for j in range(i)) for i in range(len(grams))) / len(grams) if grams else 0.0


def test_repetition_share_is_the_share_of_8_grams_that_occurred_earlier_in_the_answer():
    sentence = list(range(10, 20))  # 10 distinct tokens, said 5 times: 43 windows, the first 10 new
    assert repetition_share(sentence * 5) == pytest.approx(33 / 43) and brute_force_share(sentence * 5) == 33 / 43
    assert repetition_share(list(range(50))) == 0.0 == brute_force_share(list(range(50)))
    once = list(range(1, 9)) + [99] + list(range(1, 9))  # one 8-gram said twice: 10 windows, 1 seen before
    assert repetition_share(once) == pytest.approx(0.1) == brute_force_share(once)
    assert repetition_share([5] * 7) == 0.0  # shorter than an 8-gram: nothing to repeat
    rng = random.Random(0)
    for size in (8, 9, 30, 60):
        for alphabet in (2, 3, 40):
            tokens = [rng.randrange(alphabet) for _ in range(size)]
            assert repetition_share(tokens) == pytest.approx(brute_force_share(tokens)), tokens


def test_the_summary_gives_adaptive_mode_over_every_prompt_and_over_the_loop_free_ones():
    plain, adaptive, b3 = (
        Method("plain", "plain"),
        Method("d adaptive", "adaptive", drafter_label="d"),
        Method("d B=3", "dflash", block_size=3, drafter_label="d"),
    )
    answers = [list(range(100)), [1, 2, 3, 4, 5] * 20, list(range(1000, 1100))]  # prompt 2's answer is a loop

    def runs(*tps):  # two trials of the three prompts, at these rates on prompts 1, 2 and 3
        return [[Run(list(a), t, 1.0, 0.1, 1.0) for a, t in zip(answers, tps)] for _ in range(2)]

    table = {"plain": runs(10, 10, 10), "d adaptive": runs(12, 30, 9), "d B=3": runs(11, 25, 8)}
    rows = per_prompt_rows([plain, adaptive, b3], table, 0.0)
    assert [r["repeat"] for r in rows] == pytest.approx([0.0, 88 / 93, 0.0])  # 5 of prompt 2's 93 8-grams new
    summary = adaptive_summary([plain, adaptive, b3], table, rows)
    # every prompt: 600 tokens in 2 x (100/12 + 100/30 + 100/9) s, against plain's 600 in 60 s; loop-free: 1 and 3
    every, loop_free = 600 / (2 * (100 / 12 + 100 / 30 + 100 / 9)) / 10, 400 / (2 * (100 / 12 + 100 / 9)) / 10
    assert summary == [
        {
            "temperature": 0.0,
            "drafter": "d",
            "prompts": 3,
            "vs_plain": pytest.approx(every),
            "loop_free_prompts": 2,
            "loop_free_vs_plain": pytest.approx(loop_free),
            "loop_share": 0.5,
            "in_loop": [{"prompt": 2, "repeat": pytest.approx(88 / 93)}],
        }
    ]
    md = "\n".join(render_per_prompt(rows, Console(file=io.StringIO(), width=100), 100, summaries=summary))
    assert (
        f"d · adaptive: {every:.2f}x of plain (loop-free prompts: {loop_free:.2f}x, 2 of 3; left out, their "
        "answers in a loop: prompt 2 95% repeated); quote the loop-free figure"
    ) in md
    assert every == pytest.approx(1.317, abs=1e-3) and loop_free == pytest.approx(1.029, abs=1e-3)
    assert "| 0 | 2 | 100 | 95% | d |" in md
    # no answer in a loop: the two figures are one, and nothing is left out
    table["d adaptive"] = [[Run(list(range(100 * p, 100 * p + 100)), 12, 1.0, 0.1, 1.0) for p in range(3)]] * 2
    rows = per_prompt_rows([plain, adaptive, b3], table, 0.0)
    md = "\n".join(
        render_per_prompt(
            rows,
            Console(file=io.StringIO(), width=100),
            100,
            summaries=adaptive_summary([plain, adaptive, b3], table, rows),
        )
    )
    assert "d · adaptive: 1.20x of plain (loop-free prompts: 1.20x, 3 of 3)\n" in md


def quick_shaped_report(temps: tuple[float, ...] = (0.0,), lookups: int = 0) -> dict:
    """What `dflash2 bench --quick` reports with the bundled drafters (their names, their blocks: v1 at B=8,
    DFlash 2 at B=5 with both walks), built from made-up runs of 2 prompts x 1 trial x 24 tokens per temperature;
    prompt 2's answers are a loop. Each drafting run accepts 3 drafts, `lookups` of them from lookups."""
    v1 = SimpleNamespace(kind="v1", config=SimpleNamespace(block_size=8), walks=("greedy",), default_block_cap=None)
    v2 = SimpleNamespace(
        kind="dflash2", config=SimpleNamespace(block_size=8), walks=("greedy", "viterbi"), default_block_cap=5
    )
    drafters = [("smollm2-135m-dflash-b8", v1), ("smollm2-135m-dflash2-b8", v2)]
    methods = methods_for(drafters, None, False)
    answers = [list(range(100, 124)), [7, 8, 9] * 8]
    report = {
        "results": [],
        "per_prompt": [],
        "adaptive_summary": [],
        "shadow_calibration": [],
        "errors": [],
        "sample_output": {"temperature": 0.0, "text": "In a 7-hour shift, the baker makes"},
    }
    for temp in temps:
        runs = {}
        for i, m in enumerate(methods):
            drafts = m.kind in ("dflash", "adaptive")
            runs[m.name] = [
                [
                    Run(
                        list(a),
                        5.0 + i + p,
                        60.0,
                        1.0,
                        0.83,
                        [1, 0, 2] if drafts else [],
                        12 if m.kind == "adaptive" else 0,
                        [0.25, 0.26] if drafts else [],
                        lookups if drafts else 0,
                    )
                    for p, a in enumerate(answers)
                ]
            ]
        for m in methods:
            row = method_row(m, runs[m.name], 5.5)
            row.update(temperature=temp, lossless=True if temp == 0 else None)
            add_cycle_parts(row, [(0.024, 0.24)] if m.kind == "dflash" else [])
            report["results"].append(row)
        rows = per_prompt_rows(methods, runs, temp)
        report["per_prompt"] += rows
        report["adaptive_summary"] += adaptive_summary(methods, runs, rows)
    report["context"] = {
        "target": "SmolLM2-135M-Instruct (default)",
        "drafters": [d for d, _ in drafters],
        "drafter_names": drafter_names(drafters),
        "dtype": "float32",
        "prompts": 2,
        "suites": "math",
        "trials": 1,
        "max_tokens": 24,
        "commit": "665b953-dirty",
        "version": "0.1.0",
        "runtime": {
            "mlx": "0.32.4",
            "backend": "cpu",
            "blas": "openblas",
            "kernels": "pure-MLX",
            "machine": "Linux x86_64",
            "python": "3.12.3",
        },
        "costs": [
            {
                "drafter": d,
                "step_s": 0.1,
                "block_size": 8,
                "tree_budget": None,
                "verify_steps": [1.0, 1.27, 1.7, 1.7, 1.7, 1.77, 1.77, 1.77],
                "draft_steps": [0.2] * 7,
            }
            for d, _ in drafters
        ],
    }
    return report


@pytest.mark.parametrize("temps", [(0.0,), (0.0, 1.0)])
def test_the_report_reads_at_a_glance_in_100_columns(temps):
    """Labels that say what ran, the drafters' names once (in the header), the first columns only: in 100
    columns every row of every table is one line, and nothing is cut short."""
    report = quick_shaped_report(temps)
    console = Console(width=100, record=True, file=io.StringIO())
    md = render(report, console)
    text = console.export_text()
    lines = text.splitlines()
    assert max(cell_len(line) for line in lines) <= 100 and "…" not in text
    labels = [r["label"] for r in report["results"]]
    assert labels == [
        "mlx-lm",
        "plain",
        "v1 · adaptive",
        "v1 · B=8",
        "DFlash 2 · adaptive",
        "DFlash 2 · B=5 greedy",
        "DFlash 2 · B=5 viterbi",
    ] * len(temps)
    rows = [line for line in lines if line.startswith("│")]  # the body rows of every table
    assert len(rows) == len(report["results"]) + len(report["per_prompt"]) == 11 * len(temps)
    for label in set(labels):
        assert sum(line.startswith(f"│ {label} ") for line in rows) == len(temps), label
    assert text.count("smollm2-135m-dflash-b8") == text.count("smollm2-135m-dflash2-b8") == 1
    assert "drafters: v1 = smollm2-135m-dflash-b8, DFlash 2 = smollm2-135m-dflash2-b8" in text
    head = next(line for line in lines if "method" in line)
    columns = [c.strip() for c in head.strip("┃ ").split("┃")]
    assert columns == ["method", *(["T"] if len(temps) > 1 else []), "tok/s", "vs mlx-lm", "tau", "lossless"]
    # DFlash 2 adaptive: 48 tokens in 24/9 + 24/10 s, plain in 24/6 + 24/7 s; prompt 1 alone: 9 against 6 tok/s
    assert (
        "1.47x of plain (loop-free prompts: 1.50x, 1 of 2; left out, their answers in a loop: prompt 2 82% repeated)"
    ) in " ".join(line.strip() for line in lines)
    assert "0.1.0 (665b953-dirty)" in lines[0] and lines[-1].startswith("mlx-lm output of prompt 1 (T=0): In a 7")
    # the markdown has every column, and the per-prompt repeat
    assert "| " + " | ".join(COLUMNS) + " |" in md and "| 0 | 2 | 24 | 82% | DFlash 2 |" in md
    # --wide: the rest of the columns too, nothing cut short (in 140 columns, rows still one line)
    console = Console(width=140, record=True, file=io.StringIO())
    render(report, console, wide=True)
    text = console.export_text()
    assert "TTFT s" in text and "accepted by position" in text and "…" not in text
    assert sum(line.startswith("│ DFlash 2 · B=5 viterbi ") for line in text.splitlines()) == 2 * len(temps)


def test_the_report_counts_accepted_drafts_from_lookups_and_from_the_drafter():
    """Rows whose lookups gave drafts: the JSON counts accepted drafts by source, and the report shows them, on the
    terminal by default only where lookups gave some (the markdown always)."""
    report = quick_shaped_report(lookups=2)
    rows = {r["label"]: r for r in report["results"]}
    # 2 prompts x 1 trial, each run accepting 1 + 0 + 2 drafts, 2 of them from lookups
    assert (rows["DFlash 2 · B=5 greedy"]["lookup_tokens"], rows["DFlash 2 · B=5 greedy"]["drafter_tokens"]) == (4, 2)
    console = Console(width=100, record=True, file=io.StringIO())
    md = render(report, console)
    lines = console.export_text().splitlines()
    assert max(cell_len(line) for line in lines) <= 100
    head = next(line for line in lines if "method" in line)
    assert [c.strip() for c in head.strip("┃ ").split("┃")] == [
        "method",
        "tok/s",
        "vs mlx-lm",
        "tau",
        "lookup / drafter",
        "lossless",
    ]
    cells = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]] for line in lines if "│" in line}
    assert cells["DFlash 2 · B=5 greedy"][3] == "4 / 2" and cells["mlx-lm"][3] == "-"  # mlx-lm: no cycles
    assert "| DFlash 2 · B=5 greedy | 0 | 10.5 | 10.5-10.5 | 1.90x | 2.00 | 4 / 2 | " in md
    # on a terminal narrower than 100 columns a line under the table gives the counts; every cell stays whole
    narrow = Console(width=80, record=True, file=io.StringIO())
    render(report, narrow)
    text = narrow.export_text()
    assert "lookup / drafter ┃" not in text and "DFlash 2 · B=5 greedy 4 / 2" in text.replace("\n", " ")
    # no lookup gave a draft: the terminal leaves the column out, the markdown counts them all from the drafter
    report = quick_shaped_report()
    console = Console(width=100, record=True, file=io.StringIO())
    md = render(report, console)
    assert "lookup / drafter" not in console.export_text() and " | 1.90x | 2.00 | 0 / 6 | " in md


def test_drafters_go_by_their_kind_numbered_where_several_share_one():
    v1, v2 = SimpleNamespace(kind="v1"), SimpleNamespace(kind="dflash2")
    assert drafter_names([("a", v2), ("b", v1), ("c", v2)]) == {"a": "DFlash 2 (1)", "b": "v1", "c": "DFlash 2 (2)"}
    assert drafter_names([("a", v2), ("b", v1)]) == {"a": "DFlash 2", "b": "v1"}


def test_the_report_names_the_commit_it_was_made_from(tmp_path):
    """`git describe --always --dirty` of the checkout, None outside one or in a folder the checkout ignores."""

    def git(*args):
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path / "repo",
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    assert source_commit(tmp_path) is None  # no checkout
    (tmp_path / "repo" / "venv").mkdir(parents=True)
    git("init", "-q")
    (tmp_path / "repo" / ".gitignore").write_text("venv/\n")
    git("add", ".gitignore")
    git("commit", "-qm", "one")
    commit = source_commit(tmp_path / "repo")
    assert git("rev-parse", commit) == git("rev-parse", "HEAD") and not commit.endswith("-dirty")
    (tmp_path / "repo" / ".gitignore").write_text("venv/\nbuild/\n")
    assert source_commit(tmp_path / "repo") == commit + "-dirty"
    assert source_commit(tmp_path / "repo" / "venv") is None  # a package installed into the checkout's venv


def test_replay_on_a_cost_curve_read_from_a_file(tiny_pair, tmp_path, capsys):
    target, drafter = tiny_pair
    suite, out, traces = tmp_path / "prompts.jsonl", tmp_path / "replay.json", tmp_path / "traces.json"
    suite.write_text(json.dumps({"prompt": "w1 w2 w3 w4"}) + "\n")
    curve = {"verify_s": [0.1 + 0.01 * n for n in range(8)], "draft_s": [0.02] * 7}  # the drafter's blocks: to 8
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"another machine's cost key": curve}))  # the costs cache's shape
    args = [
        "bench",
        "--model",
        str(target),
        "--draft-model",
        str(drafter),
        "--replay",
        "--prompts",
        str(suite),
        "--num-prompts",
        "1",
        "--max-tokens",
        "16",
        "--block-sizes",
        "3",
        "--replay-traces",
        str(traces),
        "--json",
        str(out),
    ]
    assert main([*args, "--costs", str(costs)]) == 0
    report = json.loads(out.read_text())
    assert report["costs"] == {"drafter": curve} and report["context"]["costs_file"] == str(costs)
    assert (
        f"drafter replayed at T = 0 on the cost curve in {costs} (target forward over n tokens / one plain step: "
        "1.00 1.10 1.20 1.30 1.40 1.50 1.60 1.70; drafter pass 0.20-0.20 steps)"
    ) in capsys.readouterr().out
    kept = next(iter(json.loads(traces.read_text()).values()))
    trace, model = Trace(kept["tokens"], {int(B): d for B, d in kept["drafts"].items()}), CostModel(**curve)
    assert report["replay"][0]["fixed"]["3"] == pytest.approx(
        replay(trace, FixedBlocks(3), model, 16).tokens_per_s * model.verify_s[0]
    )

    def refused(content: str, error: str) -> None:
        costs.write_text(content)
        assert main([*args, "--costs", str(costs)]) == 2
        assert error in capsys.readouterr().err

    refused(
        json.dumps({"key": {"verify_s": curve["verify_s"]}}),
        f"--costs {costs}, curve 'key': no 'draft_s' key; a cost curve is {{\"verify_s\": [seconds of a target "
        'forward over 1, 2, ... tokens], "draft_s": [seconds of a drafter pass for a block of 2, 3, ...]}',
    )
    refused(
        json.dumps({"verify_s": curve["verify_s"], "draft_s": [0.02, "fast"]}),
        f"--costs {costs}: 'draft_s' must be a list of seconds (numbers > 0), got [0.02, \"fast\"]",
    )
    refused("{not json", f"--costs {costs}: not JSON (")
    refused(
        json.dumps({"verify_s": [0.1, 0.11], "draft_s": [0.02]}),
        f"--costs {costs}: the curve covers blocks up to 2 tokens (2 in 'verify_s', 1 in 'draft_s'), drafter "
        "replays blocks up to 8: it needs 8 and 7",
    )
    refused(json.dumps({"one": curve, "two": curve}), f"--costs {costs} holds 2 curves and none is keyed by drafter's")
    assert main(["bench", "--model", str(target), "--costs", str(costs)]) == 2
    assert "--costs goes with --replay" in capsys.readouterr().err
    assert main([*args, "--costs", str(tmp_path / "nope.json")]) == 2
    assert f"--costs {tmp_path / 'nope.json'}: no such file" in capsys.readouterr().err
    # a replay report's curves (by drafter label) are a curve file too
    assert main([*args, "--costs", str(out)]) == 0 and json.loads(out.read_text())["costs"] == {"drafter": curve}


def test_prompt_suites(tmp_path):
    assert len(load_suite("math")) >= 16 and len(load_suite("code")) == 164
    long = load_suite("long")
    assert len(long) >= 8 and len(set(long)) == len(long)
    chat = load_suite("chat", limit=5)
    assert len(chat) == 5 and all(len(p) <= 600 for p in chat)
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "one"}\n\n{"prompt": "two"}\n')
    assert load_suite(str(path)) == ["one", "two"]
    path.write_text('{"prompt": "one"}\n{"text": "two"}\n')
    with pytest.raises(ValueError, match=r"mine.jsonl:2: expected a JSON object with a \"prompt\""):
        load_suite(str(path))
    with pytest.raises(FileNotFoundError, match="neither one of"):
        load_suite("poetry")


def test_compare_importers(tmp_path):
    from dflash2_apps.compare import load_comparison

    published = load_comparison("published")
    assert any(r.get("tau") == 6.49 and r.get("speedup") == 4.86 and r.get("hardware") == "H200" for r in published)
    zlab = tmp_path / "zlab.log"
    zlab.write_text(
        "--dataset gsm8k\nBaseline throughput: 40.1 tok/s\nDFlash throughput:  190.2 tok/s\n"
        "Decoding speedup: 4.74\nAverage Acceptance length: 6.32\nAcceptance length histogram: []\n"
        "--dataset math500\nDecoding speedup: 6.08\nAverage Acceptance length: 7.87\n"
    )
    assert load_comparison(str(zlab)) == [
        {"engine": "z-lab/dflash benchmark", "suite": "gsm8k", "speedup": 4.74, "tau": 6.32},
        {"engine": "z-lab/dflash benchmark", "suite": "math500", "speedup": 6.08, "tau": 7.87},
    ]
    sglang = tmp_path / "humaneval.jsonl"
    sglang.write_text(
        '{"text": "a", "meta_info": {"completion_tokens": 120, "spec_verify_ct": 20}}\n'
        '{"text": "b", "meta_info": {"completion_tokens": 60, "spec_verify_ct": 10}}\n'
    )
    assert load_comparison(str(sglang)) == [{"engine": "SGLang", "suite": "humaneval", "tau": 6.0}]
    ours = tmp_path / "mine.json"
    ours.write_text(json.dumps({"schema": "dflash2-compare/1", "results": [{"engine": "vLLM", "tau": 3.1}]}))
    assert load_comparison(str(ours)) == [{"engine": "vLLM", "tau": 3.1}]
    (tmp_path / "bad.json").write_text('{"x": 1}')
    with pytest.raises(ValueError, match="not a dflash2-compare/1 JSON"):
        load_comparison(str(tmp_path / "bad.json"))


@pytest.mark.slow
def test_bench_shows_the_comparison(tiny_pair, tmp_path, capsys):
    target, drafter = tiny_pair
    assert (
        main(
            [
                "bench",
                "--model",
                str(target),
                "--draft-model",
                str(drafter),
                "--quick",
                "--block-sizes",
                "4",
                "--compare",
                "published",
                "--markdown",
                str(tmp_path / "b.md"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "compared with CUDA runs" in out and "DFlash (paper) (H200)" in (tmp_path / "b.md").read_text()


@pytest.mark.slow
def test_peers_absent_get_rows_that_say_why(tiny_pair, tmp_path, capsys):
    """--engines with an interpreter that lacks the peers (a bare venv): the bench still runs ours, and each
    peer gets a row per block size naming what is missing and how to install it."""
    import venv

    venv.create(tmp_path / "bare", with_pip=False)
    python = tmp_path / "bare" / "bin" / "python"
    target, drafter = tiny_pair
    assert (
        main(
            [
                "bench",
                "--model",
                str(target),
                "--draft-model",
                str(drafter),
                "--quick",
                "--block-sizes",
                "4",
                "--engines",
                "dflash,dflash-mlx",
                "--peer-python",
                str(python),
                "--json",
                str(tmp_path / "b.json"),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["errors"] == [] and report["context"]["engines"] == ["dflash", "dflash-mlx"]
    rows = {r["method"]: r for r in report["results"]}
    assert rows["drafter B=4"]["lossless"] is True  # ours ran
    for engine, module, pip in (
        ("dflash", "dflash", "dflash==0.1.0"),
        ("dflash-mlx", "dflash_mlx", "dflash-mlx==0.1.8"),
    ):
        row = rows[f"{engine} drafter B=4"]
        assert row["kind"] == "peer" and row["generation_tps_median"] is None and row["lossless"] is None
        assert row["note"] == (
            f"{engine} is not installed in {python} (no module {module!r}): `{python} -m pip "
            f"install {pip}` with mlx-lm (and mlx[cpu] on Linux), or pass --peer-python with an "
            "environment that has it"
        )
    assert "cannot run (see note)" in capsys.readouterr().out


def test_a_peer_worker_that_dies_is_a_reason(tmp_path):
    """An interpreter that exits at once (here /bin/false): the request fails with what the worker said."""
    from dflash2_apps.peer_engines import PeerError, PeerWorker

    worker = PeerWorker("dflash", "/bin/false", {}, tmp_path / "w.log")
    with pytest.raises(PeerError, match=r"^dflash worker \(/bin/false\) exited: no output$"):
        worker.request(op="load", target="t", drafter="d", dtype=None)
    worker.close()


def test_bad_engine_options(tiny_pair, tmp_path, capsys):
    target, drafter = tiny_pair
    common = ["bench", "--model", str(target), "--draft-model", str(drafter), "--quick"]
    assert main([*common, "--engines", "dflash,vllm"]) == 2
    assert "unknown engine(s) ['vllm'] for --engines; choose among dflash, dflash-mlx" in capsys.readouterr().err
    assert main([*common, "--engines", "dflash", "--peer-python", str(tmp_path / "nope")]) == 2
    assert f"--peer-python {tmp_path / 'nope'}: no such interpreter" in capsys.readouterr().err
    assert main([*common, "--peer-python", sys.executable]) == 2
    assert "--peer-python goes with --engines" in capsys.readouterr().err


def test_published_copy_for_the_peers(tiny_pair, tmp_path):
    """The copy the peers load: a factorised selector's codebooks expanded to V x R tables that give the very
    codes the factorised drafter computes per token (so the same drafts), read back by our own loader; and a
    hub id that a constructed cache resolves offline, as the authors' hub-only `load_draft` needs."""
    from helpers import make_dflash2_drafter, save_drafter
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import load_model

    from dflash2_apps.peer_engines import hub_cache_entry, published_drafter
    from dflash2_mlx.loading import bind_drafter, load_drafter
    from dflash2_mlx.sampling import SamplingParams

    model, _ = load_model(tiny_pair[0])
    source = save_drafter(tmp_path / "factorised", make_dflash2_drafter(model, block_size=8, selector_factorized=True))
    ours = load_drafter(str(source))
    assert ours.candidate_selector.factorized
    bind_drafter(ours, model)
    hub_id, snapshot = hub_cache_entry(tmp_path / "hub", "drafter-0")
    note = published_drafter(ours, model, str(source), snapshot)
    assert note == "float32, selector codebooks expanded from the factorised form"
    assert snapshot_download(hub_id, cache_dir=tmp_path / "hub", local_files_only=True) == str(snapshot)
    config = json.loads((snapshot / "config.json").read_text())
    assert config["block_size"] == 8 and config["tie_word_embeddings"] is False  # dflash-mlx's loader needs both
    theirs = load_drafter(str(snapshot))
    assert not theirs.candidate_selector.factorized
    bind_drafter(theirs, model)
    ids = mx.arange(256)
    embed = ours._target.embed
    for side in ("predecessor", "successor"):
        table = getattr(theirs.candidate_selector, f"{side}_codebook").weight
        codes = getattr(ours.candidate_selector, f"{side}_codes")(ids, embed)
        assert table.shape == (256, 16) and table.dtype == mx.float32
        assert mx.allclose(table, codes, rtol=1e-5, atol=1e-6).item()
    mx.random.seed(0)
    context = mx.random.normal((1, 12, 2 * 64))
    block = mx.array([[7] + [5] * 7])
    drafts = [d.propose(block, context, d.make_cache(), SamplingParams()).tokens.tolist() for d in (ours, theirs)]
    assert drafts[0] == drafts[1]


def test_copyspec_modes_give_each_of_our_rows_once_per_mode():
    from dflash2_apps.bench_methods import with_copyspec_modes

    rows = [Method("mlx-lm", "mlx-lm"), Method("plain", "plain"), Method("d adaptive", "adaptive", drafter=object())]
    assert with_copyspec_modes(rows, ["auto"]) == rows
    both = with_copyspec_modes(rows, ["auto", "off"])
    assert [(m.name, m.copyspec) for m in both] == [
        ("mlx-lm", "auto"),
        ("plain", "auto"),
        ("d adaptive copy auto", "auto"),
        ("d adaptive copy off", "off"),
    ]
    with pytest.raises(ValueError, match="--copyspec-modes takes modes from"):
        with_copyspec_modes(rows, ["auto", "on"])
