"""llama.cpp as `dflash2 data`'s engine, measured against the torch engine in one run: the default GGUF target's
greedy answers to the first 128 prompts of `smollm2/data-384` that fit in 256 tokens, 192 new tokens, 64 at once,
torch (`torch_engine.generate`, the machine's dtype) then llama.cpp (continuous batching through
`llama-cpp-python`'s C API on the same GGUF, in its own venv: it builds from source), then the reverse.
Prints tokens/s and conversations a minute of each run, and how many llama.cpp answers are token-identical to
torch's (with the median first differing token).

    python -m venv VENV && VENV/bin/pip install llama-cpp-python numpy
    .venv/bin/python runs/smollm2/llama_cpp_engine.py VENV/bin/python
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS, PROMPT_TOKENS, NEW_TOKENS, SLOTS, THREADS = 128, 256, 192, 64, 2


def llama_answers(gguf: str, prompts: list[list[int]], eos: set[int]):
    """(prompt index, greedy answer) by llama.cpp, in finishing order: each decode call carries one token of every
    answering sequence and whole prompts of newly filled ones (run in the venv that has `llama_cpp`)."""
    import ctypes

    import llama_cpp as L
    import numpy as np

    L.llama_backend_init()
    quiet = L.llama_log_callback(lambda *args: None)  # kept referenced: llama.cpp calls it for the whole run
    L.llama_log_set(quiet, ctypes.c_void_p())
    model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    params = L.llama_context_default_params()
    params.n_ctx, params.n_seq_max = SLOTS * (PROMPT_TOKENS + NEW_TOKENS), SLOTS
    params.n_batch, params.n_ubatch = PROMPT_TOKENS + SLOTS, 512
    params.n_threads = params.n_threads_batch = THREADS
    params.kv_unified = False
    ctx = L.llama_init_from_model(model, params)
    memory, batch = L.llama_get_memory(ctx), L.llama_batch_init(params.n_batch, 0, 1)
    queue = iter(enumerate(prompts))
    owner, answer, prompt_len, waiting = [None] * SLOTS, [[] for _ in range(SLOTS)], [0] * SLOTS, []

    def fill(slot: int) -> None:
        index, ids = next(queue, (None, None))
        owner[slot], answer[slot] = index, []
        if ids is not None:
            prompt_len[slot] = len(ids)
            waiting.append((slot, ids))

    def add(token: int, position: int, slot: int, logits: bool) -> None:
        n = batch.n_tokens
        batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = token, position, 1, logits
        batch.seq_id[n][0] = slot
        batch.n_tokens = n + 1

    for slot in range(SLOTS):
        fill(slot)
    while True:
        rows = []  # the slots whose next token this call computes, in the order of their logits
        batch.n_tokens = 0
        for slot in range(SLOTS):
            if owner[slot] is not None and answer[slot]:
                add(answer[slot][-1], prompt_len[slot] + len(answer[slot]) - 1, slot, True)
                rows.append(slot)
        while waiting and batch.n_tokens + len(waiting[0][1]) <= params.n_batch:
            slot, ids = waiting.pop(0)
            for i, token in enumerate(ids):
                add(token, i, slot, i == len(ids) - 1)
            rows.append(slot)
        if not rows:
            return
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(rows), vocab))
        for slot, token in zip(rows, logits.argmax(-1).tolist()):
            answer[slot].append(token)
            if token in eos or len(answer[slot]) >= NEW_TOKENS:
                yield owner[slot], answer[slot]
                L.llama_memory_seq_rm(memory, slot, -1, -1)
                fill(slot)


def worker(job: str) -> None:
    """The llama.cpp run of `job` (a JSON file: gguf, prompts, eos), its answers and seconds written back to it."""
    spec = json.loads(Path(job).read_text())
    start = time.perf_counter()
    answers = dict(llama_answers(spec["gguf"], spec["prompts"], set(spec["eos"])))
    spec |= {"answers": answers, "seconds": time.perf_counter() - start}
    Path(job).write_text(json.dumps(spec))


def main(llama_python: str) -> None:
    from dflash2_mlx.assets import default_target
    from dflash2_mlx.formats.shards import read_shards
    from dflash2_mlx.loading import load_target
    from dflash2_mlx.train import torch_engine

    model, tokenizer = load_target()
    prompts = [s.tokens[: s.prompt_len].tolist() for s in read_shards("runs/smollm2/data-384")]
    prompts = [p for p in prompts if len(p) <= PROMPT_TOKENS][:PROMPTS]
    eos = sorted(tokenizer.eos_token_ids)

    def by_torch():
        start = time.perf_counter()
        found = torch_engine.generate(model, prompts, NEW_TOKENS, eos, SLOTS, PROMPT_TOKENS)
        return dict(found), time.perf_counter() - start

    def by_llama():
        with tempfile.NamedTemporaryFile("w", suffix=".json") as job:
            Path(job.name).write_text(json.dumps({"gguf": str(default_target()), "prompts": prompts, "eos": eos}))
            subprocess.run([llama_python, __file__, "--worker", job.name], check=True)
            done = json.loads(Path(job.name).read_text())
        return {int(k): v for k, v in done["answers"].items()}, done["seconds"]

    engines = {"torch": by_torch, "llama.cpp": by_llama}
    print("| run | engine | s | response tok/s | conversations / min |\n|---|---|---|---|---|")
    rates, answers = {name: [] for name in engines}, {}
    for i, name in enumerate(["torch", "llama.cpp", "llama.cpp", "torch"]):
        answers[name], seconds = engines[name]()
        tokens = sum(map(len, answers[name].values()))
        rates[name].append(len(answers[name]) * 60 / seconds)
        print(f"| {i + 1} | {name} | {seconds:.1f} | {tokens / seconds:.1f} | {rates[name][-1]:.1f} |", flush=True)
    ratio = sum(rates["llama.cpp"]) / sum(rates["torch"])
    reference, theirs = answers["torch"], answers["llama.cpp"]
    same = sum(theirs[k] == reference[k] for k in reference)
    first = sorted(
        next((j for j, (a, b) in enumerate(zip(reference[k], theirs[k])) if a != b), len(reference[k]))
        for k in reference
    )
    print(
        f"llama.cpp {ratio:.2f}x torch ({torch_engine.machine_dtype()}); {same} of {len(reference)} answers "
        f"token-identical; median first differing token {first[len(first) // 2]}"
    )


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main(sys.argv[1])
