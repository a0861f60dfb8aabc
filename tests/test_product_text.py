"""The product speaks of itself: no numbered work periods, issue numbers or dated report names in any tracked
file (code, tests, docs, drafter cards, reports, file names). A finding is listed as file:line."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BINARY = (".npz", ".npy", ".safetensors", ".png", ".jpg", ".gguf")

# Each pattern needs a number, so "an HTTP session", scope="session", "paste into an issue" and "drafter#2"
# (a label glued to a word) stay legitimate. This file is skipped: its examples below are the phrases it forbids.
PATTERNS = {
    "numbered work period": re.compile(r"\b[Ss]essions?[ -]\d+|\bS\d{1,2}\b"),
    "issue number": re.compile(r"\b[Ii]ssues? #?\d+|(?<![\w&/#])#\d+\b"),
    "dated report name": re.compile(r"\bbench-s\d+|-s\d+\.(?:md\b|json\b|\{)"),
}


def findings(path: str, text: str) -> list[str]:
    out = [f"{path}: file name: {kind}" for kind, rx in PATTERNS.items() if rx.search(Path(path).name)]
    for number, line in enumerate(text.splitlines(), 1):
        for kind, rx in PATTERNS.items():
            if m := rx.search(line):
                out.append(f"{path}:{number}: {kind}: {m.group(0)!r} in {line.strip()[:120]!r}")
    return out


@pytest.mark.parametrize(
    "line",
    [
        "Session 9: both drafters continue",
        "the drafters bundled before them (sessions 2-7)",
        "continue the session-8 drafters",
        "Recipe comparisons (issue 14).",
        "a fix for #14 in the loop",
        "see bench-s13 for the numbers",
        "`runs/smollm2/bench-s9.md`",
        "run-s12.json has it",
        "`run-s9.{md,json}`",
        "the S13 report",
    ],
)
def test_patterns_flag_work_periods_issues_and_dated_names(line):
    assert findings("x.md", line)


@pytest.mark.parametrize(
    "line",
    [
        "requests.Session() keeps an HTTP session open",
        "one inference session per model",
        '@pytest.fixture(scope="session")',
        "returns the report as markdown to paste into an issue",
        'assert {"drafter#2 B=4 greedy"} <= methods',
        "# 1. prefill",
        "color: #fff",
        "the bench report `runs/smollm2/bench.md` and `bench-peers.md`",
        "sm_80 kernels, S-shaped curve, SmolLM2-135M",
    ],
)
def test_patterns_leave_legitimate_words_alone(line):
    assert findings("x.md", line) == []


def test_tracked_files_name_no_work_periods_issues_or_dated_reports():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    problems = []
    for path in filter(None, files.decode().split("\0")):
        file = ROOT / path
        text = ""
        if file != Path(__file__).resolve() and not path.endswith(BINARY) and file.is_file():
            data = file.read_bytes()
            text = "" if b"\0" in data else data.decode("utf-8", errors="replace")
        problems += findings(path, text)
    assert not problems, "\n".join(problems)
