"""Prompts the target writes itself (`dflash2 data --self-prompts N`): which replies are kept, how the file grows
and resumes, and how `dflash2 data` answers them with a held-out split."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import make_target

import dflash2_mlx.train.data as data
from dflash2_mlx.train import self_prompts
from dflash2_mlx.train.data import DataSettings, build, read_shards

CODE = "How do I sort a list of dictionaries by a key in Python, and what does the key function return? {}"
MATH = "Solve for x: 3x + {} = 22, and show each step."
CHAT = "Tell me about the weather in Lisbon in spring, please ({})."


def scripted(calls: list):
    """A stand-in for the target: for the i-th instruction of a call, a code or math prompt where the instruction
    asks for that domain, with every third reply chat, every fifth cut off and every seventh a repeat."""

    def respond(asks, seed):
        calls.append((len(asks), seed))
        replies = []
        for i, ask in enumerate(asks):
            n = sum(c for c, _ in calls[:-1]) + i
            text = (
                CODE
                if "programming" in ask
                or "code" in ask
                or any(lang in ask for lang in ("Python", "SQL", "Java", "C", "Bash", "Go", "Rust", "PHP"))
                else MATH
            ).format(f"w{n if n % 7 else 0}")
            replies.append(None if n % 5 == 4 else CHAT.format(n) if n % 3 == 2 else f'  "{text}" ')
        return replies

    return respond


def test_kept_replies_are_of_their_domain_new_and_whole(tmp_path):
    calls = []
    got = self_prompts.write(tmp_path, 6, scripted(calls), seed=3)
    for domain, prompts in got.items():
        assert len(prompts) == 6 and len({self_prompts.normalized(p) for p in prompts}) == 6
        assert all(self_prompts.keep(p, domain) == p for p in prompts)  # quotes and spaces stripped, domain right
    assert json.loads((tmp_path / self_prompts.FILE).read_text())["prompts"] == got
    assert self_prompts.instruction("code", 4, 3) == self_prompts.instruction("code", 4, 3)
    assert len({self_prompts.instruction("math", k, 3) for k in range(20)}) > 10


def test_replies_in_the_assistants_voice_are_no_prompts():
    """Replies SmolLM2-135M wrote when asked for a code prompt: a refusal or an offer to help is dropped, while a
    user's own first person stays."""
    for reply in [
        "I'm sorry, but as a text-based AI, I'm unable to assist with SQL code. Try: SELECT * FROM users;",
        "I can assist you with a C function. Please provide the error handling code you need in C.",
        "What a delightful request. I'd be happy to help with Python code that reads JSON files.",
    ]:
        assert self_prompts.keep(reply, "code") is None
    for prompt in [
        "I'm getting an error in my Python code: `for i in range(len(x)): print(x[i+1])`. Why?",
        "I am trying to write a SQL query that joins two tables. How do I use LEFT JOIN?",
    ]:
        assert self_prompts.keep(prompt, "code") == prompt


def test_the_file_grows_and_a_resumed_run_asks_new_instructions(tmp_path):
    calls = []
    first = self_prompts.write(tmp_path, 4, scripted(calls), seed=0)
    _, asked = self_prompts.read(tmp_path)
    more = self_prompts.write(tmp_path, 9, scripted(calls), seed=0)
    for domain in self_prompts.WRITTEN:
        assert more[domain][:4] == first[domain] and len(more[domain]) == 9
    seeds = [seed for _, seed in calls]
    assert len(set(seeds)) == len(seeds)  # every call samples with a seed of its own
    assert self_prompts.read(tmp_path)[1]["code"] > asked["code"]
    again = []
    self_prompts.write(tmp_path, 9, scripted(again), seed=0)
    assert again == []  # enough written: the target is not asked


def test_a_target_that_writes_nothing_usable_is_told_to_ask_for_fewer(tmp_path):
    with pytest.raises(RuntimeError, match="ask for fewer"):
        self_prompts.write(tmp_path, 3, lambda asks, seed: [CHAT.format(0)] * len(asks), seed=0, tries=4)


@pytest.mark.parametrize("engine", ["torch", "mlx"])
def test_both_engines_sample_a_reply_per_instruction(engine, tokenizer):
    pytest.importorskip("torch")
    settings = DataSettings(target="tiny", batch_size=3, engine=engine)
    asks = ["write code", "write a problem", "write", "code please"]
    replies = data._replies(make_target("llama", seed=2), tokenizer, asks, settings, seed=1)
    assert len(replies) == 4 and all(r is None or isinstance(r, str) for r in replies)


def test_data_answers_the_written_prompts_with_a_held_out_split(tmp_path, tokenizer, monkeypatch):
    """ShareGPT prompts first, then each domain's written prompts as `self-<domain>/<k>`, every 50th held out;
    growing `--self-prompts` answers only the new ones."""
    model = make_target("llama", seed=2)
    calls = []
    monkeypatch.setattr(data, "_replies", lambda m, t, asks, s, seed: scripted(calls)(asks, seed))
    settings = DataSettings(target="tiny", num_prompts=2, max_prompt_tokens=400, max_new_tokens=4, batch_size=2)
    build(tmp_path, dataclasses.replace(settings, self_prompts=2), model, tokenizer, progress=False)
    ids = [s.id for s in read_shards(tmp_path)]
    written = [i for i in ids if i.startswith("self-")]
    assert len(ids) == 6 and sorted(written) == ["self-code/0", "self-code/1", "self-math/0", "self-math/1"]
    held = {s.id for s in read_shards(tmp_path) if s.heldout}
    assert {"self-code/0", "self-math/0"} <= held and not {"self-code/1", "self-math/1"} & held
    prompts, _ = self_prompts.read(tmp_path)
    sample = next(s for s in read_shards(tmp_path) if s.id == "self-math/1")
    want = tokenizer.apply_chat_template([{"role": "user", "content": prompts["math"][1]}], add_generation_prompt=True)
    assert sample.tokens[: sample.prompt_len].tolist() == want
    build(tmp_path, dataclasses.replace(settings, self_prompts=3), model, tokenizer, progress=False)
    grown = [s.id for s in read_shards(tmp_path)]
    assert grown[:6] == ids and sorted(grown[6:]) == ["self-code/2", "self-math/2"]
    meta = json.loads((tmp_path / "data.json").read_text())
    assert meta["settings"]["self_prompts"] == 3
    assert sum(d["train"] + d["heldout"] for d in meta["domains"].values()) == 8
