"""Speculation inside the server's batch (`server/batched_worker.py`) over real HTTP on 127.0.0.1, with the openai
client: on a Mac-like batched cost curve concurrent requests draft and verify together, and each gets, at T = 0,
exactly the text it gets alone (plain decoding, the target's own greedy output); on a CPU-like curve no batched
cycle runs, /health says why, and the answers are the same. A rollback that gives each request the next one's
rows is caught. Costs are fixed (`batched_decide_on`): the tiny models' own timings are Python overhead."""

from __future__ import annotations

import http.client
import threading
import time

import openai
import pytest
from helpers import (
    TIMEOUT,
    batched_decide_on,
    chat_ids,
    cpu_batched_costs,
    flat_batched_costs,
    held_first,
    make_dflash2_drafter,
    make_hybrid,
    make_target,
    parse_metrics,
    request,
    running,
    save_drafter,
    save_model,
    save_target,
    slow_except,
    user,
    wait_for,
)
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load_model

from dflash2_mlx import batched, generate
from dflash2_mlx.server import GenerationArguments, batched_worker, scheduler
from dflash2_mlx.server.batched_worker import batched_warm_start

PROMPTS = [user(" ".join(f"w{7 * i + j + 3}" for j in range(1 + i % 5))) for i in range(8)]
MAX_TOKENS = 40


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def folders(request, tiny_pair, tiny_dflash2, tmp_path_factory):
    """A tiny target folder and a DFlash 2 drafter folder for it."""
    if request.param == "qwen3":
        return tiny_pair[0], tiny_dflash2
    root = tmp_path_factory.mktemp("llama")
    target = save_target(root / "target", "llama", seed=1)
    model, _ = load_model(target)
    return target, save_drafter(root / "drafter", make_dflash2_drafter(model, block_size=16, mask_token_id=5))


def concurrent_clients(
    app, port, monkeypatch, n: int = 8, extra: dict | None = None, sampling: dict | None = None
) -> tuple[list, dict, dict]:
    """n openai clients at once (every other one streaming), T = 0: the first request is held after its first
    token until the others are queued, then moves into the batch with them. Returns (replies as (text, completion
    tokens, finish reason, batch size), /health, /metrics). `extra`: fields every client sends beside OpenAI's;
    `sampling`: OpenAI's sampling fields instead of T = 0."""
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
    results = [None] * n

    def one(i):
        kw = {"model": "default_model", "messages": PROMPTS[i], "max_tokens": MAX_TOKENS}
        kw.update(sampling or {"temperature": 0})
        if extra:
            kw["extra_body"] = extra
        try:
            if i % 2:
                chunks = list(api.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
                stats = chunks[-1].model_extra["dflash"]
                results[i] = (text, chunks[-1].usage.completion_tokens, finish, stats["batch_size"])
            else:
                reply = api.chat.completions.create(**kw)
                choice = reply.choices[0]
                stats = reply.model_extra["dflash"]
                results[i] = (
                    choice.message.content,
                    reply.usage.completion_tokens,
                    choice.finish_reason,
                    stats["batch_size"],
                )
        except openai.APIError as e:
            results[i] = ("error", str(e), None, 0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    with held_first(monkeypatch) as (gate, holding):
        try:
            threads[0].start()
            assert holding.wait(TIMEOUT), "the first request never ran"
            for t in threads[1:]:
                t.start()
            wait_for(lambda: app.worker.jobs.qsize() == n - 1, "the others to queue")
        finally:
            gate.set()
            for t in threads:
                t.join(TIMEOUT)
    health = request(port, "GET", "/health")[2]
    metrics = parse_metrics(metrics_text(port))
    return results, health, metrics


def metrics_text(port) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def alone(app, processors=None) -> list[tuple]:
    """Each prompt's answer alone: the target's own greedy output (text, completion tokens, finish reason), with
    mlx-lm's `processors` applied if given."""
    wants = [
        generate(
            app.worker.model,
            app.tokenizer,
            chat_ids(app, p),
            None,
            verify_mode="off",
            max_tokens=MAX_TOKENS,
            logits_processors=processors,
        )
        for p in PROMPTS
    ]
    return [(w.text, len(w.tokens), w.finish_reason) for w in wants]


def test_batched_cycles_answer_as_each_request_alone(folders, monkeypatch):
    """On a Mac-like curve the 8 requests draft and verify together: batched cycles run (counted in /health and
    /metrics, with the drafts they accepted), and every reply is its prompt's answer alone."""
    batched_decide_on(monkeypatch, flat_batched_costs)
    with running(*folders) as (app, port):
        want = alone(app)
        results, health, metrics = concurrent_clients(app, port, monkeypatch)
    assert len({w[0] for w in want}) == 8  # distinct answers: a swap between requests cannot pass
    assert [r[:3] for r in results] == want
    assert all(r[3] >= 2 for r in results), results  # each was decoded in a batch
    batch = health["batch"]
    assert batch["speculative"] and "pays" in batch["reason"]
    assert batch["batched_cycles"] > 0 and batch["max_size"] == 8
    assert batch["batched_accepted_tokens"] > 0  # requests kept different numbers of rows in some cycles
    assert metrics["dflash2_batched_cycles_total"] == batch["batched_cycles"]
    assert metrics["dflash2_batched_accepted_tokens_total"] == batch["batched_accepted_tokens"]
    # the batch's throughput: the tokens its steps committed (never more than the answers hold) over their time
    tokens, seconds = metrics["dflash2_batched_tokens_total"], metrics["dflash2_batched_seconds_total"]
    assert 0 < tokens <= sum(r[1] for r in results) and seconds > 0
    assert batch["tokens_per_s"] == pytest.approx(tokens / seconds, rel=1e-2)
    assert metrics["dflash2_cycles_total"] >= batch["batched_cycles"]


def test_a_cpu_like_curve_runs_no_batched_cycle(tiny_pair, tiny_dflash2, monkeypatch):
    """On a CPU-like curve (every token of every request costs a plain step) the batch is mlx-lm's, by plain
    steps, as before: no batched cycle, the reason in /health, the same answers."""
    batched_decide_on(monkeypatch, cpu_batched_costs)
    with running(tiny_pair[0], tiny_dflash2) as (app, port):
        want = alone(app)
        results, health, metrics = concurrent_clients(app, port, monkeypatch)
    assert [r[:3] for r in results] == want
    batch = health["batch"]
    assert not batch["speculative"] and batch["reason"] == batched_worker.NOT_PAYING
    assert batch["batched_cycles"] == 0 and batch["batched_steps"] > 0 and batch["max_size"] == 8
    assert metrics["dflash2_batched_cycles_total"] == 0


@pytest.mark.parametrize("policy", slow_except(["on", "off"], "on"))
def test_batched_speculation_on_or_off_as_asked(tiny_pair, tiny_dflash2, monkeypatch, policy):
    """`--batched-speculation on` runs the speculative batch on a curve where no cycle pays (its plan then takes
    plain steps); `off` keeps mlx-lm's batch on one where cycles pay. The answers are each prompt's alone."""
    batched_decide_on(monkeypatch, cpu_batched_costs if policy == "on" else flat_batched_costs)
    with running(tiny_pair[0], tiny_dflash2, "--batched-speculation", policy) as (app, port):
        want = alone(app)
        results, health, _ = concurrent_clients(app, port, monkeypatch)
    assert [r[:3] for r in results] == want
    batch = health["batch"]
    assert batch["speculative"] == (policy == "on") and batch["reason"].startswith(f"--batched-speculation {policy}")
    assert batch["batched_cycles"] == 0 and batch["max_size"] == 8
    assert (app.worker.batched_costs is not None) == (policy == "on")


def test_requests_it_cannot_honour_yet_decode_in_mlx_lms_batch(tiny_pair, tiny_dflash2, monkeypatch):
    """A repetition penalty and a logit bias (logits processors) on a curve where cycles pay: the batch is
    mlx-lm's, by plain steps, and each answer is mlx-lm's with the same processors, alone."""
    extra = {"repetition_penalty": 1.5, "repetition_context_size": 8, "logit_bias": {"204": -100.0, "180": 5.0}}
    batched_decide_on(monkeypatch, flat_batched_costs)
    with running(tiny_pair[0], tiny_dflash2) as (app, port):
        processors = make_logits_processors(
            logit_bias={204: -100.0, 180: 5.0}, repetition_penalty=1.5, repetition_context_size=8
        )
        want = alone(app, processors)
        results, health, _ = concurrent_clients(app, port, monkeypatch, extra=extra)
    assert [r[:3] for r in results] == want
    batch = health["batch"]
    assert batch["speculative"] and batch["batched_cycles"] == 0 and batch["max_size"] == 8


def test_sampling_settings_reach_each_request_in_the_speculative_batch(tiny_pair, tiny_dflash2, monkeypatch):
    """At T > 0 the requests draft and verify together, each with its own temperature, top-p, top-k and min-p as
    the decoder takes them (whose draws inside a batch follow mlx-lm's law: `test_batched_decode.py`)."""
    batched_decide_on(monkeypatch, flat_batched_costs)
    added, real = [], batched.BatchedDecoder.add

    def add(self, prompt, params, *args, **kwargs):
        added.append(params)
        return real(self, prompt, params, *args, **kwargs)

    monkeypatch.setattr(batched.BatchedDecoder, "add", add)
    sampling = {"temperature": 0.7, "top_p": 0.9}
    extra = {"top_k": 5, "min_p": 0.05}
    with running(tiny_pair[0], tiny_dflash2) as (app, port):
        results, health, _ = concurrent_clients(app, port, monkeypatch, extra=extra, sampling=sampling)
    assert all(r[0] != "error" and 1 <= r[1] <= MAX_TOKENS for r in results), results
    assert len(added) == 8 and all((p.temperature, p.top_p, p.top_k, p.min_p) == (0.7, 0.9, 5, 0.05) for p in added), (
        added
    )
    assert health["batch"]["batched_cycles"] > 0  # drafts verified by the rejection rule inside the batch


def test_a_hybrid_target_answers_each_request_as_alone(tmp_path, monkeypatch):
    """A hybrid target (GatedDeltaNet layers, whose state cannot yet be rolled back per request in a batch) on a
    curve where cycles would pay: its batches stay mlx-lm's, /health says why, and each of the 8 concurrent
    requests gets its answer alone."""
    hybrid = make_hybrid("qwen3_5", seed=2)
    target = save_model(tmp_path / "hybrid", hybrid, hybrid.args_config)
    model, _ = load_model(target)
    drafter = save_drafter(tmp_path / "drafter", make_dflash2_drafter(model, block_size=16, mask_token_id=5))
    batched_decide_on(monkeypatch, flat_batched_costs)
    with running(target, drafter) as (app, port):
        want = alone(app)
        results, health, _ = concurrent_clients(app, port, monkeypatch)
    assert [r[:3] for r in results] == want
    assert all(r[3] >= 2 for r in results), results  # each was decoded in a batch
    batch = health["batch"]
    assert not batch["speculative"] and "recurrent layers" in batch["reason"] and batch["max_size"] == 8


class Rotated:
    """The per-request rollback with each request given the next one's kept rows."""

    def __init__(self, real):
        self.real = real

    def __call__(self, cache, kept, fed):
        return self.real(cache, kept[1:] + kept[:1], fed)


def test_rolling_back_the_wrong_requests_rows_changes_the_answers(tiny_pair, tiny_dflash2, monkeypatch):
    """The negative control: with each request's rollback given the next one's kept rows, answers differ from
    their prompts' alone, so `test_batched_cycles_answer_as_each_request_alone` catches that mutation."""
    batched_decide_on(monkeypatch, flat_batched_costs)
    monkeypatch.setattr(batched, "roll_back_rows", Rotated(batched.roll_back_rows))
    with running(tiny_pair[0], tiny_dflash2) as (app, port):
        want = alone(app)
        results, health, _ = concurrent_clients(app, port, monkeypatch)
    assert health["batch"]["batched_cycles"] > 0
    assert [r[:3] for r in results] != want


def test_requests_leave_the_speculative_batch_stopped_finished_or_alone(tokenizer, monkeypatch):
    """Three requests in the speculative batch (the first moved in after its first cycle): the short one finishes,
    one is cancelled after 6 tokens, and the long one, then alone with nothing queued, goes on speculatively by
    itself. Every token sent is plain decoding's from scratch; the cancelled one's are a prefix of it."""
    model = make_target("qwen3", seed=3)
    worker = batched_worker.BatchedWorker(
        model,
        tokenizer,
        make_dflash2_drafter(model, block_size=8),
        8,
        True,
        costs=flat_batched_costs(4),
        block_max=4,
        reason=batched_worker.PAYS,
    )
    kw = {"temp": 0.0, "verify_mode": "dflash", "block_size": 4, "eos_token_ids": []}
    prompts = [[5 + i] + list(range(20 + 3 * i, 30 + 5 * i)) for i in range(3)]
    lengths = [48, 4, 30]
    jobs = [scheduler.Job(p, {**kw, "max_tokens": n}, time.monotonic() + TIMEOUT) for p, n in zip(prompts, lengths)]
    relay, continued, resumed = batched_worker.BatchedWorker._relay, scheduler.Worker._continued, []

    def relayed(self, decoder, entries, uid, step):
        relay(self, decoder, entries, uid, step)
        e = entries.get(uid)
        if e is not None and e.job is jobs[2] and e.generated >= 6:
            e.job.cancelled.set()

    def resumed_record(self, r, entry, generated):
        resumed.append(r.verify_mode)
        return continued(self, r, entry, generated)

    monkeypatch.setattr(batched_worker.BatchedWorker, "_relay", relayed)
    monkeypatch.setattr(scheduler.Worker, "_continued", resumed_record)
    out = []
    with held_first(monkeypatch) as (gate, holding):
        try:
            worker.submit(jobs[0])
            assert holding.wait(TIMEOUT)
            worker.submit(jobs[1])
            worker.submit(jobs[2])
            gate.set()
            for job in jobs:
                tokens = []
                while (event := job.events.get(timeout=TIMEOUT))[0] == "record":
                    tokens += event[1].tokens
                out.append((tokens, event[1]))
        finally:
            gate.set()
            assert worker.stop()
    wants = [
        generate(model, tokenizer, p, None, verify_mode="off", max_tokens=n, eos_token_ids=[]).tokens
        for p, n in zip(prompts, lengths)
    ]
    assert [reason for _, reason in out] == ["finished", "finished", "cancelled"]
    assert out[0][0] == wants[0] and out[1][0] == wants[1]
    assert 6 <= len(out[2][0]) < 30 and out[2][0] == wants[2][: len(out[2][0])]
    assert worker.batched_cycles > 0 and all(job.batch_size == 3 for job in jobs)
    assert resumed and set(resumed) == {"dflash"}  # the long one finished alone, speculatively


def test_the_warm_start_loads_the_batched_curve_where_a_batched_cycle_can_run(monkeypatch):
    """The curve is asked for with the server's block and batch (k <= 8, at most --decode-concurrency); a target
    whose rows cannot be rolled back, no drafter or --verify-mode off ask for none, each with its reason."""
    model = make_target("qwen3")
    drafter = make_dflash2_drafter(model, block_size=8)
    calls, curve = [], flat_batched_costs
    batched_decide_on(monkeypatch, lambda block, batch: calls.append((block, batch)) or curve(block, batch))
    defaults = GenerationArguments(verify_mode="dflash", block_size=4)
    assert batched_warm_start(model, drafter, defaults, 32)[1:] == (4, batched_worker.PAYS)
    assert batched_warm_start(model, drafter, defaults, 3)[0].batch_max == 3
    curve = cpu_batched_costs
    assert batched_warm_start(model, drafter, defaults, 32) == (None, 4, batched_worker.NOT_PAYING)
    assert calls == [(4, 8), (4, 3), (4, 8)]
    swa = make_target("llama_swa")
    costs, _, reason = batched_warm_start(swa, make_dflash2_drafter(swa, block_size=8), defaults, 32)
    assert costs is None and "cannot yet be rolled back per request" in reason
    assert "no drafter" in batched_warm_start(model, None, defaults, 32)[2]
    assert "--verify-mode off" in batched_warm_start(model, drafter, GenerationArguments(verify_mode="off"), 32)[2]
    assert "one at a time" in batched_warm_start(model, drafter, defaults, 1)[2]
    assert len(calls) == 3
    # --batched-speculation: on takes the curve where no cycle pays; off measures nothing; on where it cannot run
    # is an error naming why
    assert batched_warm_start(model, drafter, defaults, 32, "on") == (curve(4, 8), 4, batched_worker.FORCED)
    assert batched_warm_start(model, drafter, defaults, 32, "off")[0] is None and len(calls) == 4
    for args in ((swa, make_dflash2_drafter(swa, block_size=8)), (model, None)):
        with pytest.raises(ValueError, match="--batched-speculation on cannot run here .*(rolled back|no drafter)"):
            batched_warm_start(*args, defaults, 32, "on")
