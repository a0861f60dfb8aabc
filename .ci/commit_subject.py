#!/usr/bin/env python3
"""The commit-msg hook (.pre-commit-config.yaml): refuse a commit whose subject is over 72 characters.

    .ci/commit_subject.py MESSAGE_FILE

The subject is the message's first line that is neither blank nor a comment (git drops both). Exit 0 when it fits,
1 (saying by how much it does not) when it is longer, 2 on a wrong call.
"""

from __future__ import annotations

import sys
from pathlib import Path

LIMIT = 72


def subject(message: str) -> str:
    """The subject of a commit message: its first line that is neither blank nor a `#` comment.

    Args:
        message: the commit message, as git hands it to the hook.
    """
    return next((line.rstrip() for line in message.splitlines() if line.strip() and not line.startswith("#")), "")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: .ci/commit_subject.py MESSAGE_FILE (the file git hands a commit-msg hook)", file=sys.stderr)
        return 2
    line = subject(Path(argv[0]).read_text(encoding="utf-8", errors="replace"))
    if len(line) > LIMIT:
        print(
            f"the commit subject is {len(line)} characters, over the {LIMIT} allowed: shorten it to say what and "
            f"why, and put the details in the body after a blank line:\n  {line}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
