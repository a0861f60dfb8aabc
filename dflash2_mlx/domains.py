"""Which domain a prompt belongs to (chat, code or math), so that a training set can say how much of each it holds
and a drafter's held-out tau can be read per domain. A keyword and syntax rule, not a model: it reads the prompt
text (a conversation's context included) and is checked against labelled examples in `tests/test_domains.py`."""

from __future__ import annotations

import re

DOMAINS = ("chat", "code", "math")

# Code: a fenced block, or a score of 2 (3 in a long prompt): a line of source counts 2, a distinct programming
# word 1.
_FENCE = "```"
_CODE_LINES = re.compile(
    r"^\s*(def|class|import|from\s+\S+\s+import|#include|#define|public|private|function|const|let|var|return)\b"
    r"|^\s*[\w.\[\]]+\s*=\s*[\w\"'(\[{].*[;)\]]\s*$"
    r"|^[^\n]*[)\]}\w]\s*;\s*$"
    r"|^[^\n]*\)\s*\{\s*$"
    r"|</?(div|span|html|body|script|table|form|input|button|ul|li)\b[^>\n]*>"
    r"|\bSELECT\b[^\n]*\bFROM\b",
    re.MULTILINE,
)
_CODE_WORDS = re.compile(
    r"\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|kotlin|swift|php|ruby|sql|html|css|react|vue|"
    r"angular|node\.?js|django|flask|api|json|yaml|regex|bash|shell|powershell|code|coding|function|script|"
    r"programming|compile|compiler|debug|bug|exception|stack trace|class|method|variable|array|"
    r"database|query|git|docker|kubernetes|linux|backend|frontend|algorithm|library|framework|repository|npm|"
    r"pip|sdk|endpoint|webhook|csv|dataframe|pandas|numpy|excel formula)\b",
    re.IGNORECASE,
)
# Math: arithmetic expressions and mathematical words, counted (an unambiguous word counts twice).
_MATH_EXPRESSION = re.compile(
    r"(?<![A-Za-z/])\d\s*[+*×÷^=]\s*\(?-?\d|\d\s+/\s+\d|\b[xyn]\s*[+*/^=]\s*\d|\d[xyn]\b\s*[+=-]"
)
_MATH_WORDS = re.compile(
    r"\b(solve|calculate|compute|probability|prove|proof|matrix|geometry|fraction|fractions|percent|percentage|"
    r"how many|sum of|product of|formula|multiply|multiplication|divide|division|divided by|integer|triangle|"
    r"circle|radius|area of|perimeter|average of|ratio|interest rate|statistics|profit|discount)\b|\d\s*%",
    re.IGNORECASE,
)
_MATH_SURE = re.compile(
    r"\b(equations?|integral|derivative|theorem|algebra|arithmetic|polynomial|logarithm|maths?|mathematics|"
    r"square root|prime numbers?|word problem)\b",
    re.IGNORECASE,
)
LONG = 1500  # characters: a longer prompt (a document, a log) needs more evidence


def prompt_domain(text: str) -> str:
    """The domain of a prompt: "code" where it holds source code or talks of programming, else "math" where it
    holds arithmetic or talks of mathematics, else "chat". A prompt over `LONG` characters needs more evidence.

    Args:
        text: the prompt, with any earlier turns of its conversation.

    Returns:
        One of `DOMAINS`.
    """
    long = len(text) > LONG
    code = 2 * len(_CODE_LINES.findall(text)) + len({w.lower() for w in _CODE_WORDS.findall(text)})
    if _FENCE in text or code >= 2 + long:
        return "code"
    words = {w.lower() for w in _MATH_WORDS.findall(text)}
    score = len(_MATH_EXPRESSION.findall(text)) + len(words) + 2 * len(set(_MATH_SURE.findall(text)))
    if score >= 2 + 2 * long:
        return "math"
    return "chat"
