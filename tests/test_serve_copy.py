"""`dflash2 serve` with copy drafts (`--copyspec-mode`, `auto` by default): over real HTTP on 127.0.0.1 a prompt that
repeats a passage gets plain decoding's answer, and GET /metrics, GET /health and the answer's `dflash` statistics
count the drafts lookups gave (none with the mode off); requests decoded together in mlx-lm's BatchGenerator answer
as alone."""

from __future__ import annotations

import json
import time

import pytest
from helpers import (
    COSTS,
    TIMEOUT,
    call,
    decide_on,
    expected,
    held_first,
    make_dflash2_drafter,
    make_target,
    parse_metrics,
    prompts,
    request,
    running,
)

from dflash2_apps.cli import make_parser
from dflash2_apps.serve import build_server
from dflash2_mlx import generate
from dflash2_mlx.server import GenerationArguments, scheduler
from dflash2_mlx.server import app as app_module

MAX_TOKENS = 32
DECODING = ("cycles", "accepted_tokens", "lookup_cycles", "lookup_tokens")  # GET /health's "decoding" counts


def copy_prompt(model, tokenizer) -> list[int]:
    """A passage p, the target's own greedy answer to it, then p again: the lookup of the second p proposes that
    answer, and the tiny target (which falls into repeating a token) keeps giving tokens its context holds."""
    p = prompts(40, seed=11)[28]
    answer = generate(model, tokenizer, p, None, verify_mode="off", max_tokens=48).tokens
    return p + answer + p


def metrics(port) -> dict[str, float]:
    status, _, text = call(port, "GET", "/metrics")
    assert status == 200, text
    return parse_metrics(text)


def health(port) -> dict:
    status, _, text = call(port, "GET", "/health")
    assert status == 200, text
    return json.loads(text)


def completion(app, port, prompt: list[int]) -> dict:
    """The server's answer to `prompt` (token ids), checked against the target's own plain decoding."""
    status, _, body = request(
        port, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    )
    assert status == 200, body
    want = expected(app, prompt, MAX_TOKENS)
    assert body["choices"][0]["text"] == want.text and body["usage"]["completion_tokens"] == len(want.tokens)
    return body


@pytest.mark.parametrize("mode", ["dflash", "adaptive"])
def test_serve_copies_by_default_and_answers_as_plain_decoding(mode, tiny_pair, tiny_dflash2, monkeypatch):
    """No --copyspec-mode given: lookups run (`auto`), their drafts are counted in /metrics, /health and the answer's
    `dflash` statistics, and the answer is plain decoding's at T = 0. Adaptive mode decides on fixed costs
    (`decide_on`), so the test does not hang on this machine's load."""
    monkeypatch.setattr(app_module, "load_or_measure_costs", lambda *a: COSTS)
    decide_on(monkeypatch, COSTS)
    with running(tiny_pair[0], tiny_dflash2, "--verify-mode", mode) as (app, port):
        assert app.defaults.copyspec_mode == "auto" and app.defaults.verify_mode == mode
        assert health(port)["decoding"] == dict.fromkeys(DECODING, 0)
        prompt = copy_prompt(app.worker.model, app.tokenizer)
        stats = completion(app, port, prompt)["dflash"]
        m, h = metrics(port), health(port)["decoding"]
    assert m["dflash2_lookup_tokens_total"] >= 10, m  # most of the answer came from the context
    assert m["dflash2_lookup_tokens_total"] <= m["dflash2_accepted_tokens_total"]
    assert 0 < m["dflash2_lookup_cycles_total"] <= m["dflash2_cycles_total"]
    # one answer: /health's totals and its own statistics are /metrics' counts
    assert h == {key: m[f"dflash2_{key}_total"] for key in DECODING}
    assert (stats["lookup_cycles"], stats["lookup_tokens"]) == (h["lookup_cycles"], h["lookup_tokens"])
    assert (stats["cycles"], stats["accepted"]) == (h["cycles"], h["accepted_tokens"])


def test_copyspec_off_looks_nothing_up(tiny_pair, tiny_dflash2):
    """The negative control: `--copyspec-mode off` gives the same answer with no lookup counted, so the counts above
    come from the lookups."""
    with running(tiny_pair[0], tiny_dflash2, "--copyspec-mode", "off") as (app, port):
        assert app.defaults.copyspec_mode == "off"
        stats = completion(app, port, copy_prompt(app.worker.model, app.tokenizer))["dflash"]
        m, h = metrics(port), health(port)["decoding"]
    assert m["dflash2_lookup_tokens_total"] == 0 and m["dflash2_lookup_cycles_total"] == 0
    assert m["dflash2_cycles_total"] > 0  # it did decode speculatively
    assert h["lookup_cycles"] == h["lookup_tokens"] == stats["lookup_cycles"] == stats["lookup_tokens"] == 0
    assert h["cycles"] == stats["cycles"] > 0


def test_the_flag_and_its_errors(tiny_pair, capsys):
    args = make_parser().parse_args(["serve", "--model", str(tiny_pair[0])])
    assert args.copyspec_mode is None  # unset: stream_cycles' own default, auto
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--copyspec-mode", "always"])
    assert "invalid choice: 'always'" in capsys.readouterr().err
    assert GenerationArguments().copyspec_mode == "auto"
    with pytest.raises(ValueError, match="copyspec mode must be one of"):
        GenerationArguments(copyspec_mode="always")
    args = make_parser().parse_args(
        [
            "serve",
            "--model",
            str(tiny_pair[0]),
            "--verify-mode",
            "off",
            "--copyspec-mode",
            "conservative",
            "--port",
            "0",
        ]
    )
    app, server = build_server(args)
    try:
        assert app.defaults.copyspec_mode == "conservative"
    finally:
        app.close()
        server.server_close()


def test_batched_copy_requests_answer_as_alone(tokenizer, monkeypatch):
    """Three requests with copy drafts on, the first moved into mlx-lm's batch after its first cycle, the batch left
    by the last one alone (which goes on speculatively, looking up in its prompt and tokens so far): every answer is
    plain decoding's."""
    model = make_target("qwen3", seed=3)
    worker = scheduler.Worker(model, tokenizer, make_dflash2_drafter(model, block_size=8), 8, True)
    kw = {"verify_mode": "dflash", "block_size": 4, "eos_token_ids": [], "copyspec_mode": "auto"}
    passages = [[5 + i] + list(range(20 + 3 * i, 30 + 5 * i)) for i in range(3)]
    batch = [p + p + p[:4] for p in passages]
    batch[2] = batch[2] * 3  # the longest: it outlives the others, alone, speculative again
    jobs = [
        scheduler.Job(p, dict(kw, max_tokens=40 + 40 * (i == 2)), time.monotonic() + TIMEOUT)
        for i, p in enumerate(batch)
    ]
    try:
        with held_first(monkeypatch) as (gate, holding):
            worker.submit(jobs[0])
            assert holding.wait(TIMEOUT)
            for job in jobs[1:]:
                worker.submit(job)
            gate.set()
            answers, branches = [], set()  # the last one's cycles' winning branches
            for job in jobs:
                tokens = []
                while (event := job.events.get(timeout=TIMEOUT))[0] == "record":
                    tokens += event[1].tokens
                    if job is jobs[2]:
                        branches.add(event[1].branch)
                assert event[:2] == ("end", "finished"), event
                answers.append(tokens)
        assert worker.batch_size_max == 3
        assert "lookup" in branches  # the last one, speculative again, copied from its context
    finally:
        assert worker.stop()
    for prompt, job, tokens in zip(batch, jobs, answers):
        want = generate(
            model, tokenizer, prompt, None, verify_mode="off", max_tokens=job.generation.max_tokens, eos_token_ids=[]
        )
        assert tokens == want.tokens
