"""Prompt domains (chat, code, math): the rule against prompts labelled by hand, and a data folder's split per
domain with its held-out part and its answers in a loop."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2_mlx.domains import DOMAINS, prompt_domain
from dflash2_mlx.formats.shards import Sample
from dflash2_mlx.train.data import domain_split

# ShareGPT-like prompts, labelled by reading them.
LABELLED = {
    "code": [
        "Java add to the arraylist of a class type",
        "write a python script",
        "how to load csv file to sql server without bulkadmin permission?",
        "I have the following code:\n```\nuseEffect(() => {\n  document.title = title;\n}, [title]);\n```\nWhy does it "
        "run twice?",
        "Hi, i am working on a neopixel project. This is the code:\nconst int buttonPin = 2;\n"
        "const int numPixels = 27;\n"
        "void setup() {\n  pinMode(buttonPin, INPUT);\n}",
        "How would you generate an interactive tree diagram in python using plotly, and then include this within a "
        "flask app?",
        "SELECT name, total FROM orders WHERE total > 100 -- why is this slow on a big table?",
    ],
    "math": [
        "why would you say 9+10 = 21",
        "what is the derivative of the euclidean distance between two points in 3D space",
        "a shopkeeper sold an article offering a discount of 5 % and earned a profit of 31.1 %. what would have "
        "been the percentage of profit earned if no discount had been offered?",
        "Solve for x: 3x + 7 = 22.",
        "There is a triangle inside a circle, with its vertices on the circle. What is the probability that the "
        "center of the circle falls inside the triangle?",
        "Can you make a difficult fraction division question for a 6th grader?",
    ],
    "chat": [
        "write an essay on the french revolution",
        "please help me plan a 5-day Kyoto trip with restaurants and tourist attractions",
        "Write me a poem in the style of Edgar Allan Poe about a man named Jacob who loves ska music",
        "list the largest outdoor retailers in the world",
        "Explain the fault-tolerance of the reaction control system on the Space Shuttle",
        "I have an interview about product speccing with the company Weekend Health. Give me an example question.",
        "The meeting moved from 2019-2020 budgets to the 2021 plan; summarize it in three bullet points.",
    ],
}


@pytest.mark.parametrize("domain", DOMAINS)
def test_each_labelled_prompt_gets_its_domain(domain):
    assert [prompt_domain(text) for text in LABELLED[domain]] == [domain] * len(LABELLED[domain])


def test_a_long_document_needs_more_than_a_passing_word():
    """A long prompt that mentions programming once or twice in passing is chat; the same words in a short one are
    a programming question."""
    short = "Which library and framework should a newsroom use?"
    document = "The newsroom's year. " * 80 + short
    assert prompt_domain(short) == "code" and prompt_domain(document) == "chat"


def test_a_folder_is_split_per_domain_with_its_held_out_part_and_loops(smollm2):
    """Counts from the labels above, response lengths and loops written by hand: an answer saying one 4-token
    phrase 8 times has 25 8-grams of which all but the first 4 occurred before (share 21/25 >= 0.5)."""
    _, tokenizer = smollm2
    loop = [11, 12, 13, 14] * 8
    fresh = list(range(100, 140))
    rows = [  # (domain, held out, response)
        ("code", False, loop),
        ("code", True, fresh[:10]),
        ("math", False, fresh),
        ("math", False, loop[:20]),
        ("chat", True, loop),
        ("chat", False, fresh[:5]),
        ("chat", False, fresh[:7]),
    ]
    samples = []
    for i, (domain, heldout, response) in enumerate(rows):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": LABELLED[domain][i % 5]}], add_generation_prompt=True
        )
        samples.append(Sample(f"s{i}", np.array(prompt + response, np.int32), len(prompt), heldout))
    split = domain_split(samples, tokenizer)
    assert split == {
        "code": dict(train=1, heldout=1, train_tokens=32, heldout_tokens=10, train_in_a_loop=1, heldout_in_a_loop=0),
        "math": dict(train=2, heldout=0, train_tokens=60, heldout_tokens=0, train_in_a_loop=1, heldout_in_a_loop=0),
        "chat": dict(train=2, heldout=1, train_tokens=12, heldout_tokens=32, train_in_a_loop=0, heldout_in_a_loop=1),
    }
