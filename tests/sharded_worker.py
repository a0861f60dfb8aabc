"""One process of the two-process runs of test_distributed.py (started with MLX_RANK and MLX_HOSTFILE set).

    python tests/sharded_worker.py JOBS.json OUT_DIR

For each job (a target folder, a drafter folder, pipeline or tensor, a prompt of token ids, generation settings
(a `copyspec_mode` of [min_match, max_draft] is a `LookupConfig`);
optionally prompts to run through one prompt cache, and the target's greedy continuation to script drafts from)
every rank loads its share of the target and the drafter; rank 0 generates (the other ranks follow) and writes
OUT_DIR/<name>-drafting (empty) once it drafts the first block, OUT_DIR/<name>.json (each run's tokens, accepted
drafts, each cycle's lookup branch and the drafts lookups gave) and
OUT_DIR/<name>-context.npy (the context rows the drafter was handed during the first run, in order); every rank
writes OUT_DIR/<name>-rank<r>.json (the group's size, the layers it holds and the drafter's among them).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from dflash2_mlx import PromptCache, distributed, generate, stream_cycles
from dflash2_mlx.generate import summarize
from dflash2_mlx.lookup import LookupConfig
from dflash2_mlx.sampling import Proposal


def scripted(sequence: list[int], seed: int):
    """A `propose` that drafts the next tokens of `sequence` (the prompt and the target's greedy continuation),
    wrong from a random position of each block on: every acceptance length occurs."""
    rng, seen = random.Random(seed), [0]

    def propose(block, context, cache, params, walk="greedy"):
        seen[0] += context.shape[1]  # rows committed before the anchor
        n = block.shape[1] - 1
        right = sequence[seen[0] + 1 : seen[0] + 1 + n]
        right += [0] * (n - len(right))
        cut = rng.randint(0, n)
        drafts = right[:cut] + [(t + 1) % 256 for t in right[cut:]]
        return Proposal(mx.array(drafts, mx.uint32), None, None, mx.array(True))

    return propose


def spied(draft_rows, contexts: list[np.ndarray], started: Path):
    """`draft_rows` that also appends the context rows it is handed to `contexts`, and touches `started` at its
    first call (the generation has begun: every rank is inside it)."""

    def spy(block, context, cache):
        if not contexts:
            started.touch()
        contexts.append(np.array(context[0]))
        return draft_rows(block, context, cache)

    return spy


def main(jobs_file: str, out_dir: str) -> None:
    jobs, out = json.loads(Path(jobs_file).read_text()), Path(out_dir)
    group = distributed.init_group("ring", timeout=60)
    for job in jobs:
        target, tokenizer, drafter = distributed.load(
            job["target"], job["drafter"], group, job["mode"], dtype="float32", kernels="mlx"
        )
        share = {
            "size": group.size(),
            "first_layer": target.first_layer,
            "layers": len(target.layers),
            "held": list(target.held_ids),
        }
        (out / f"{job['name']}-rank{group.rank()}.json").write_text(json.dumps(share))
        if group.rank() != 0:
            distributed.follow(target)
            continue
        contexts, draft_rows = [], drafter.draft_rows
        drafter.draft_rows = spied(draft_rows, contexts, out / f"{job['name']}-drafting")
        runs = []
        with distributed.leading(target), distributed.watched(target, job.get("peer_timeout")):
            for settings in job["runs"]:
                if isinstance(settings.get("copyspec_mode"), list):  # [min_match, max_draft]
                    settings = dict(settings, copyspec_mode=LookupConfig(*settings["copyspec_mode"]))
                records = list(stream_cycles(target, tokenizer, job["prompt"], drafter, **settings))
                result = summarize(records, drafter, settings.get("block_size"))
                branches = [r.branch for r in records]
                runs.append(
                    {
                        "tokens": result.tokens,
                        "accepted": result.accepted,
                        "branches": branches,
                        "lookup_tokens": result.lookup_tokens,
                    }
                )
                drafter.draft_rows = draft_rows  # the contexts of the first run only
            if job.get("cached"):  # consecutive prompts through one prompt cache (a shared prefix reused)
                cache = PromptCache()
                for prompt in job["cached"]:
                    result = generate(target, tokenizer, prompt, drafter, prompt_cache=cache, **job["runs"][0])
                    runs.append({"tokens": result.tokens, "accepted": result.accepted, "reused": cache.reused})
            if job.get("script"):  # greedy, drafts scripted from the target's known continuation
                drafter.propose = scripted(job["prompt"] + job["script"], job.get("spoil_seed", 0))
                result = generate(
                    target,
                    tokenizer,
                    job["prompt"],
                    drafter,
                    max_tokens=len(job["script"]),
                    verify_mode="dflash",
                    eos_token_ids=[],
                )
                runs.append({"tokens": result.tokens, "accepted": result.accepted})
        np.save(out / f"{job['name']}-context.npy", np.concatenate(contexts))
        (out / f"{job['name']}.json").write_text(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main(*sys.argv[1:])
