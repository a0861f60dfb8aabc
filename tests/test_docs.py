"""The product's pages say only what is there: every repo path that README.md, CONTRIBUTING.md, docs/*.md and
runs/README.md name exists, the README stays short and keeps its two commands at the top, and the results page
stays one page. A finding names the page and the missing path."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    "README.md",
    "CONTRIBUTING.md",
    "runs/README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
]
COMMANDS = [
    'bash apps/install.sh && .venv/bin/dflash2 generate --prompt "Write a haiku about the sea."',
    "bash apps/install.sh && .venv/bin/python -m pytest -q",
]
README_MAX_WORDS = 1500
RESULTS_MAX_LINES = 200

PATH_ENDINGS = (".py", ".md", ".json", ".sh", ".metal")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
PATHLIKE = re.compile(r"[\w.\-/*]+")


def named_paths(text: str) -> list[str]:
    """The repo paths a page names: its links' targets (web links and anchors left out) and its inline code spans
    that look like paths (a `/` in them, or a name ending in .py, .md, .json, .sh or .metal). Fenced code blocks
    are commands, not references, and are skipped; so are paths outside the checkout (absolute, `~/...`) and
    placeholders (a folder in capitals, e.g. `OUT/curve.csv`)."""
    prose = FENCE.sub("", text)
    found = [m.split("#")[0] for m in LINK.findall(prose) if not re.match(r"[a-z]+:|#", m)]
    for span in CODE.findall(prose):
        if PATHLIKE.fullmatch(span) and ("/" in span or span.endswith(PATH_ENDINGS)):
            found.append(span)
    return [p for p in found if p and not p.startswith(("/", "~")) and not re.match(r"[A-Z][A-Z_]*/", p)]


def missing_paths(page: str, text: str) -> list[str]:
    """The paths `page` (relative to the repo root) names that exist neither beside it nor from the repo root,
    each as "page: `path` does not exist"; a glob must match something."""
    here = (ROOT / page).parent
    out = []
    for path in named_paths(text):
        bases = [here, ROOT]
        if "*" in path:
            exists = any(any(base.glob(path)) for base in bases)
        else:
            exists = any((base / path).exists() for base in bases)
        if not exists:
            out.append(f"{page}: `{path}` does not exist")
    return out


@pytest.mark.parametrize(
    "line, missing",
    [
        ("the vocabularies live in `dflash2_mlx/vocab.py`", "dflash2_mlx/vocab.py"),
        ("GGUF targets load through `checkpoints/gguf.py`", "checkpoints/gguf.py"),
        ("see [the report](runs/smollm2/bench-adaptive-6.md)", "runs/smollm2/bench-adaptive-6.md"),
        ("kernels in `metal/*.cuda`", "metal/*.cuda"),
        ("the `nowhere.md` page", "nowhere.md"),
    ],
)
def test_a_missing_path_is_named(line, missing):
    assert missing_paths("README.md", line) == [f"README.md: `{missing}` does not exist"]


@pytest.mark.parametrize(
    "line",
    [
        "the loop is `dflash2_mlx/decode.py`, the kernels `metal/*.metal`, the results [here](runs/README.md#results)",
        "costs in `~/.cache/dflash2/costs.json`, the route `/v1/chat/completions`, the run's `OUT/curve.csv`",
        "[mlx-lm](https://github.com/ml-explore/mlx-lm), a flag `--verify-mode`, a command `dflash2 bench --quick`",
        "```bash\ndflash2 export --mlx-path path/to/drafter --hf-path drafter-vllm\n```",
    ],
)
def test_what_is_not_a_repo_path_is_left_alone(line):
    assert missing_paths("README.md", line) == []


def test_a_page_resolves_paths_beside_it():
    assert missing_paths("runs/README.md", "[the bench](smollm2/bench.md)") == []
    assert missing_paths("README.md", "[the bench](smollm2/bench.md)") == [
        "README.md: `smollm2/bench.md` does not exist"
    ]


def test_every_path_the_pages_name_exists():
    assert "docs/server.md" in PAGES  # the docs folder was read
    problems = [p for page in PAGES for p in missing_paths(page, (ROOT / page).read_text())]
    assert not problems, "\n".join(problems)


def test_readme_is_short_and_starts_with_its_two_commands():
    text = (ROOT / "README.md").read_text()
    words = len(text.split())  # what `wc -w` counts: runs of non-whitespace
    assert words <= README_MAX_WORDS, (
        f"README.md has {words} words; keep it to {README_MAX_WORDS} (move detail to docs/)"
    )
    top = text.splitlines()[:15]
    for command in COMMANDS:
        assert command in top, f"README.md must keep this line, verbatim, in its first 15 lines: {command}"


def test_results_page_is_one_page():
    lines = len((ROOT / "runs/README.md").read_text().splitlines())
    assert lines <= RESULTS_MAX_LINES, f"runs/README.md has {lines} lines; keep it to {RESULTS_MAX_LINES}"


# Files under runs/ that are inputs (kept answers and drafts, cost curves, training data), not reports.
INPUTS = ("traces.json", "/curves/", "/data")


def test_every_report_records_its_commit():
    reports = [p for p in sorted((ROOT / "runs").rglob("*.json")) if not any(part in p.as_posix() for part in INPUTS)]
    assert len(reports) >= 5, reports  # the runs folder was read
    lacking = [
        str(p.relative_to(ROOT))
        for p in reports
        if not isinstance(json.loads(p.read_text()).get("context"), dict)
        or not json.loads(p.read_text())["context"].get("commit")
    ]
    assert not lacking, f"reports without context.commit: {lacking}"
