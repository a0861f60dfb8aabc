"""`dflash2 serve` for agents and under load, over real HTTP on 127.0.0.1 with the official `openai` client: the
cycle costs measured before serving (never inside a request), the served model names.

The servers run in this process (`test_serve.running`): a tiny real target and DFlash 2 drafter loaded from
folders, a real tokenizer."""

from __future__ import annotations

import threading

import openai
import pytest
from test_serve import GOOD, TIMEOUT, request, running, user

import dflash2_apps.serve as serve
from dflash2_mlx import adaptive
from dflash2_mlx.adaptive import AdaptiveBlocks


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


# -- warm start: the cycle costs are loaded or measured before serving -------------------------------------------


@pytest.fixture
def measurements(monkeypatch, tmp_path):
    """The name of the thread of every measurement of the cycle costs (costs cached in a file of this test's)."""
    monkeypatch.setenv("DFLASH2_COSTS", str(tmp_path / "costs.json"))
    calls, real = [], adaptive.measure_costs

    def recorded(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(adaptive, "measure_costs", recorded)
    return calls


def measured_in_requests(port: int, calls: list) -> int:
    """How many measurements three requests (plain, streaming, text) ran, each answered in full."""
    before = len(calls)
    api = client(port)
    reply = api.chat.completions.create(model="default_model", messages=user("w3 w4 w5"), max_tokens=6)
    assert reply.choices[0].finish_reason in ("stop", "length")
    chunks = list(api.chat.completions.create(model="default_model", messages=user("w6 w7"), max_tokens=6,
                                              stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert api.completions.create(model="default_model", prompt="w1 w2 w3", max_tokens=6).choices[0].text is not None
    return len(calls) - before


@pytest.mark.parametrize("mode", ["adaptive", "ddtree"])
def test_cycle_costs_are_measured_before_serving_never_in_a_request(tiny_pair, tiny_dflash2, measurements, mode,
                                                                     monkeypatch, caplog):
    """The costs are measured once, in the thread that builds the server, before it listens; then requests run
    none, even when every generation says the curve is stale (adaptive mode's verdict drops the cached copy,
    which without the warm start makes the next request measure again: see the negative control below)."""
    monkeypatch.setattr(AdaptiveBlocks, "stale", lambda self: True)
    with running(tiny_pair[0], tiny_dflash2, "--verify-mode", mode, "--block-size", 8) as (app, port):
        assert measurements == [threading.current_thread().name]
        with caplog.at_level("INFO"):
            assert measured_in_requests(port, measurements) == 0
        if mode == "adaptive":
            assert "no longer match this machine" in caplog.text  # the stale verdict was reached, and logged
        health = request(port, "GET", "/health")[2]
        assert health["verify_mode"] == mode and health["queued"] == 0 and health["running"] is False
        assert health["model"] == app.model_id and health["memory"]["active_gb"] > 0
        assert health["memory"]["peak_gb"] >= health["memory"]["active_gb"]


def test_negative_control_requests_that_measure_are_caught(tiny_pair, tiny_dflash2, measurements, monkeypatch):
    """Without the warm start the same check fails: the first request measures, and after each stale verdict
    the next one measures again."""
    monkeypatch.setattr(AdaptiveBlocks, "stale", lambda self: True)
    monkeypatch.setattr(serve, "warm_start", lambda model, drafter, defaults: {})
    with running(tiny_pair[0], tiny_dflash2, "--verify-mode", "adaptive") as (app, port):
        assert measurements == []
        assert measured_in_requests(port, measurements) == 3
        assert set(measurements) == {"dflash2-worker"}


def test_health_reports_the_mode_without_costs_for_dflash(tiny_pair, tiny_dflash2, measurements):
    """Fixed-block mode needs no costs: nothing is measured at all."""
    with running(tiny_pair[0], tiny_dflash2) as (app, port):
        status, _, health = request(port, "GET", "/health")
        assert status == 200 and health["status"] == "ok" and health["verify_mode"] == "dflash"
        assert client(port).chat.completions.create(model="default_model", messages=GOOD, max_tokens=3).choices
    assert measurements == []


# -- served model names ----------------------------------------------------------------------------------------


def test_the_model_answers_to_its_id_and_its_served_names(tiny_pair, tiny_dflash2):
    flags = ["--model-id", "tiny", "--served-model-name", "alias-a,alias-b", "--served-model-name", "alias-c"]
    with running(tiny_pair[0], tiny_dflash2, *flags) as (app, port):
        api = client(port)
        names = ["tiny", "alias-a", "alias-b", "alias-c"]
        assert [m.id for m in api.models.list()] == names
        for name in [*names, "default_model"]:
            reply = api.chat.completions.create(model=name, messages=GOOD, max_tokens=2)
            assert reply.model == (name if name != "default_model" else "tiny")
        chunks = list(api.chat.completions.create(model="alias-b", messages=GOOD, max_tokens=2, stream=True))
        assert {c.model for c in chunks} == {"alias-b"}
        assert api.completions.create(model="alias-c", prompt="w1 w2", max_tokens=2).model == "alias-c"
        with pytest.raises(openai.NotFoundError) as caught:
            api.chat.completions.create(model="gpt-4o", messages=GOOD, max_tokens=2)
        assert caught.value.code == "model_not_found"
        assert "'gpt-4o' does not exist here: this server serves 'tiny', 'alias-a', 'alias-b', 'alias-c'" in \
            str(caught.value)
        assert request(port, "GET", "/health")[2]["served_model_names"] == names


def test_served_model_names_refuse_empty_names():
    assert serve.served_names(["a, b", "c"]) == ("a", "b", "c")
    with pytest.raises(ValueError, match="--served-model-name takes names, separated by commas"):
        serve.served_names(["a,,b"])

