"""Prompts the target writes itself, for the domains ShareGPT holds little of (code, math): the target is asked,
at T > 0, for a question or an exercise on a topic drawn from the lists below; what it writes is kept as a prompt
when it reads as that domain (`domains.prompt_domain`), is of a prompt's length, is not in the assistant's voice,
and is new (compared lower-cased, whitespace collapsed). `dflash2 data --self-prompts N` then answers them as it
answers ShareGPT's."""

from __future__ import annotations

import json
import random
import re
import zlib
from pathlib import Path

from ..domains import prompt_domain

WRITTEN = ("code", "math")
FILE = "self-prompts.json"  # in the data folder: {"prompts": {domain: [...]}, "asked": {domain: instructions}}
TEMPERATURE, TOP_P = 0.8, 0.95
MAX_TOKENS = 160  # a written prompt's most tokens; one cut off there is dropped
SHORTEST, LONGEST = 20, 800  # characters a kept prompt has
# A reply in the assistant's voice (a refusal, an offer to help) is no user's prompt: 23 of the first 181 code
# prompts SmolLM2-135M wrote were.
ASSISTANT_VOICE = re.compile(
    r"\b(as an ai|(i'm|i am) sorry|i apologize|(i'm|i am|i'd be|i would be) (here|happy|glad|ready) to"
    r"|i can (help|assist)|(i'm|i am) (unable|afraid|designed|not able)|i (can't|cannot) (help|assist|provide)"
    r"|text-based ai|language model|chatbot)\b",
    re.IGNORECASE,
)

_LANGUAGES = ["Python", "JavaScript", "TypeScript", "SQL", "Java", "C++", "C", "Bash", "Go", "Rust", "C#", "PHP"]
_CODE_TOPICS = [
    "lists",
    "dictionaries",
    "strings",
    "sorting",
    "recursion",
    "classes",
    "reading files",
    "error handling",
    "regular expressions",
    "dates and times",
    "HTTP requests",
    "parsing JSON",
    "unit tests",
    "loops",
    "functions",
    "async code",
    "sets",
    "stacks and queues",
    "binary search",
    "linked lists",
    "hash maps",
    "closures",
    "iterators",
    "joins",
    "grouping rows",
    "indexes",
    "command-line arguments",
    "CSV files",
    "string formatting",
    "off-by-one errors",
    "null values",
    "threads",
    "matrices",
    "environment variables",
    "inheritance",
    "interfaces",
    "memory use",
    "logging",
    "caching",
    "a REST API",
    "a web form",
    "a linked data structure",
]
_CODE_ASKS = [
    "Write one question a beginner might ask about {topic} in {language}. Reply with the question only.",
    "Write a short {language} programming exercise about {topic}. Reply with the exercise only.",
    "Write a request for a {language} function that works with {topic}. Reply with the request only.",
    "Write a message asking why some {language} code about {topic} fails, with the code. Reply with the message only.",
    "Write an interview question about {topic} in {language}. Reply with the question only.",
    "Write a request to explain a short {language} snippet that uses {topic}, with the snippet. Reply with the "
    "request only.",
]
_MATH_TOPICS = [
    "fractions",
    "percentages",
    "ratios",
    "the area of a rectangle",
    "perimeters",
    "averages",
    "speed and distance",
    "simple interest",
    "a linear equation",
    "two equations in two unknowns",
    "a quadratic equation",
    "probability with dice",
    "probability with cards",
    "combinations",
    "prime numbers",
    "divisibility",
    "unit conversion",
    "work rates",
    "ages",
    "making change",
    "discounts",
    "exponents",
    "square roots",
    "triangles",
    "circles",
    "the volume of a box",
    "number sequences",
    "derivatives",
    "integrals",
    "logarithms",
    "matrices",
    "the median and the mean",
    "angles",
    "compound interest",
    "percent change",
]
_MATH_ASKS = [
    "Write a math word problem about {topic} for a {grade} student. Reply with the problem only.",
    "Write one problem about {topic} to solve, with numbers. Reply with the problem only.",
    "Write a question a student might ask about {topic}. Reply with the question only.",
    "Write a math exercise with a short story about {thing} that needs {topic}. Reply with the exercise only.",
    "Write a problem about {topic} and ask for the answer step by step. Reply with the problem only.",
]
_GRADES = ["3rd grade", "5th grade", "7th grade", "high school", "first-year university"]
_THINGS = [
    "apples",
    "a train trip",
    "a bakery",
    "a garden",
    "a savings account",
    "a basketball team",
    "a bookshelf",
    "a road trip",
    "a pizza party",
    "a school fair",
    "a farm",
    "a paint job",
    "a marathon",
    "a recipe",
]


def instruction(domain: str, k: int, seed: int) -> str:
    """The k-th request to the target for a `domain` prompt: a template and a topic drawn by (seed, domain, k)."""
    rng = random.Random(f"{seed}/{domain}/{k}")
    if domain == "code":
        ask = rng.choice(_CODE_ASKS)
        return ask.format(topic=rng.choice(_CODE_TOPICS), language=rng.choice(_LANGUAGES))
    if domain == "math":
        ask = rng.choice(_MATH_ASKS)
        return ask.format(topic=rng.choice(_MATH_TOPICS), grade=rng.choice(_GRADES), thing=rng.choice(_THINGS))
    raise ValueError(f"the target writes prompts for {WRITTEN}, not {domain!r}")


def normalized(text: str) -> str:
    """What two prompts are compared by: lower-cased, whitespace collapsed."""
    return re.sub(r"\s+", " ", text).strip().lower()


def keep(text: str, domain: str) -> str | None:
    """`text` as a prompt (surrounding quotes and space stripped), or None where it is not one of `domain`."""
    text = text.strip().strip('"').strip()
    if not SHORTEST <= len(text) <= LONGEST or prompt_domain(text) != domain or ASSISTANT_VOICE.search(text):
        return None
    return text


def read(folder: str | Path) -> tuple[dict[str, list[str]], dict[str, int]]:
    """The prompts a data folder's target wrote so far per domain, and how many instructions each took."""
    path = Path(folder) / FILE
    saved = json.loads(path.read_text()) if path.exists() else {}
    prompts, asked = saved.get("prompts", {}), saved.get("asked", {})
    return {d: list(prompts.get(d, [])) for d in WRITTEN}, {d: int(asked.get(d, 0)) for d in WRITTEN}


def write(folder: str | Path, n: int, respond, seed: int, tries: int = 20) -> dict[str, list[str]]:
    """Grow a data folder's written prompts to `n` per domain, saving them after each batch; those already there
    stay, in order, and a resumed run continues with the next instructions.

    Args:
        folder: the data folder.
        n: prompts wanted per domain.
        respond: (instructions, seed) -> the target's sampled reply to each, as text, or None where the reply was
            cut off at `MAX_TOKENS`.
        seed: draws the instructions (the k-th of a domain is always the same) and seeds the sampling.
        tries: give up on a domain after `tries * n` instructions.

    Returns:
        {domain: prompts}, at least `n` each.
    """
    prompts, asked = read(folder)
    for domain in WRITTEN:
        seen = {normalized(p) for p in prompts[domain]}
        while len(prompts[domain]) < n:
            if asked[domain] >= tries * n:
                raise RuntimeError(
                    f"the target wrote {len(prompts[domain])} usable {domain} prompts in {asked[domain]} tries, "
                    f"fewer than {n}: ask for fewer"
                )
            first = asked[domain]
            batch = [instruction(domain, k, seed) for k in range(first, first + 2 * (n - len(prompts[domain])) + 8)]
            for reply in respond(batch, zlib.crc32(f"{seed}/{domain}/{first}".encode())):
                text = None if reply is None else keep(reply, domain)
                if text is not None and normalized(text) not in seen and len(prompts[domain]) < n:
                    seen.add(normalized(text))
                    prompts[domain].append(text)
            asked[domain] += len(batch)
            saved = {"prompts": prompts, "asked": asked}
            (Path(folder) / FILE).write_text(json.dumps(saved, indent=1, ensure_ascii=False))
    return prompts
