"""The built-in prompt suites never change: a report that cites one (`dflash2 bench --prompts math`) can be made
again on the very same prompts."""

from __future__ import annotations

import hashlib
import json

import pytest

from dflash2_mlx.prompts import SUITES, load_suite, prompts_sha256

# sha256 of each built-in suite's prompts (all of them, as a JSON array: json.dumps, UTF-8), taken when pinned
PINNED = {
    "code": "c085fc4991bfc1349325eb48cc6d6e859ec43a2522cc869205ca07f74b229ae6",
    "chat": "c751ad363052860e6ee0492cc677b9544e8daa306e04c6bf2962e459836cdf2d",
    "math": "eb8e79d6e3daf872490e340963ace3cb81d3122a5aa0b75bde49860795e66f4f",
    "long": "6c220944dff602de7413920d7bbb4105a2f3244d85099fcc026d26f46d63e3a0",
    "copy": "c715b34b366b2a0e60c50cf1d23e04bda39806f396142af5010884da795f7588",
}


@pytest.mark.parametrize("name", SUITES)
def test_a_suite_reports_cite_never_changes(name):
    prompts = load_suite(name)
    digest = hashlib.sha256(json.dumps(prompts).encode("utf-8")).hexdigest()
    assert digest == PINNED.get(name), (
        f"the {name!r} suite's prompts hash to {digest}, not to the pinned {PINNED.get(name)}: reports cite suites "
        "by name, so a changed suite gets a new name (add it to SUITES beside this one, and pin its hash here), "
        "and this one stays as it is"
    )
    assert prompts_sha256(prompts) == digest  # what a report records of the prompts it ran


def test_every_suite_is_pinned():
    assert set(PINNED) == set(SUITES), "a new built-in suite gets its hash pinned in PINNED"
