"""The repository's style checks, as the pre-commit hooks run them (.pre-commit-config.yaml): `ruff check` and
`ruff format --check` over the whole tree (configured in pyproject.toml), no module of the package over 600 lines,
and the commit-msg hook that refuses a subject over 72 characters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBJECT_HOOK = ROOT / ".ci" / "commit_subject.py"
MAX_MODULE_LINES = 600


def ruff(*args: str) -> subprocess.CompletedProcess:
    """`ruff ARGS` from this environment (the `test` extra pins it), run at the repository's root."""
    try:
        import ruff as _  # noqa: F401
    except ImportError:
        pytest.fail("ruff is not installed in this environment: pip install -e '.[test]' (the test extra pins it)")
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff_finds_nothing(command):
    result = ruff(*command)
    assert result.returncode == 0, (
        f"`ruff {' '.join(command)}` reports the findings below: fix them (`ruff check --fix`, `ruff format`), "
        f"then commit\n{result.stdout}{result.stderr}"
    )


def test_ruff_reports_what_it_finds(tmp_path):
    """The checks above are not vacuous: the configured ruff, on a module with an unused import and a long
    line, reports both and exits 1."""
    (tmp_path / "bad.py").write_text("import os\n\nx = '" + "a" * 130 + "'\n")
    result = ruff("check", "--config", str(ROOT / "pyproject.toml"), "--no-cache", str(tmp_path / "bad.py"))
    assert result.returncode == 1
    assert "F401" in result.stdout and "E501" in result.stdout


def test_no_module_over_600_lines():
    """Each module of the package (dflash2_mlx/, apps/) stays under 600 lines: split a longer one by what its
    parts do."""
    long = {
        str(path.relative_to(ROOT)): n
        for folder in ("dflash2_mlx", "apps")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by responsibility): {long}"


def subject_hook(tmp_path: Path, message: str) -> subprocess.CompletedProcess:
    (tmp_path / "COMMIT_EDITMSG").write_text(message)
    return subprocess.run(
        [sys.executable, str(SUBJECT_HOOK), str(tmp_path / "COMMIT_EDITMSG")], capture_output=True, text=True
    )


@pytest.mark.parametrize(
    "message, ok",
    [
        ("x" * 72, True),
        ("x" * 73, False),
        ("é" * 72 + "\n", True),  # characters, not bytes
        ("docs: short\n\n" + "a body line is not the subject " * 10 + "\n", True),
        ("# git's comments come first here, and are longer than a subject may be " * 2 + "\n\ndocs: short\n", True),
        ("\n\n" + "y" * 73 + "\n", False),
    ],
)
def test_the_commit_msg_hook_refuses_a_subject_over_72_characters(tmp_path, message, ok):
    result = subject_hook(tmp_path, message)
    assert result.returncode == (0 if ok else 1), result.stderr
    assert ("73 characters, over the 72 allowed" in result.stderr) is not ok


def test_the_commit_msg_hook_says_how_it_is_called(tmp_path):
    result = subprocess.run([sys.executable, str(SUBJECT_HOOK)], capture_output=True, text=True)
    assert result.returncode == 2 and "usage: .ci/commit_subject.py MESSAGE_FILE" in result.stderr


def test_the_hooks_are_the_ones_documented():
    """The hooks the config runs: ruff check and ruff format from the environment, and the subject hook at the
    commit-msg stage (both hook types installed by a plain `pre-commit install`)."""
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = {h["id"]: h for repo in config["repos"] for h in repo["hooks"]}
    assert hooks["ruff-check"]["entry"].split()[:2] == ["ruff", "check"]
    assert hooks["ruff-format"]["entry"].split()[:2] == ["ruff", "format"]
    assert hooks["commit-subject"]["entry"] == ".ci/commit_subject.py"
    assert hooks["commit-subject"]["stages"] == ["commit-msg"]
    assert set(config["default_install_hook_types"]) == {"pre-commit", "commit-msg"}
