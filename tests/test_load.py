"""`python -m dflash2_apps.load --compare`: both servers started in turn on the tiny pair (real processes, real
HTTP on 127.0.0.1), the same streaming clients at two levels, and the report."""

from __future__ import annotations

import json

from dflash2_apps import load


def test_compare_runs_both_servers_and_writes_the_report(tiny_pair, tiny_dflash2, tmp_path):
    out = tmp_path / "load-vs-mlx-lm"
    argv = ["--compare", "--model", str(tiny_pair[0]), "--draft-model", str(tiny_dflash2), "--levels", "1,2",
            "--requests", "2", "--max-tokens", "6", "--verify-mode", "dflash", "--serve-arg=--block-size",
            "--serve-arg=4", "--out", str(out), "--timeout", "60", "--start-timeout", "120"]
    assert load.main(argv) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert list(report["servers"]) == ["dflash2 serve", "mlx_lm.server"]
    for name, rows in report["servers"].items():
        assert list(rows) == ["1", "2"]
        for level, row in rows.items():
            assert (row["requests"], row["failed"]) == (2 * int(level), 0), (name, level, row)
            assert row["completion_tokens"] > 0 and row["tokens_per_s"] > 0
            assert 0 < row["latency_p50_s"] <= row["latency_p99_s"] <= row["wall_s"]
    assert report["servers"]["dflash2 serve"]["1"]["verify_modes"] == ["dflash"]  # a lone client: speculative
    # T = 0 on one target: every answer the same text from both servers (1 x 2 and 2 x 2 answers)
    texts = [r["texts"] for rows in report["servers"].values() for r in rows.values()]
    assert all(t for t in texts)
    assert report["agreement"]["compared"] == 2 + 4 and report["agreement"]["same"] == 6
    md = out.with_suffix(".md").read_text()
    assert md.count("| dflash2 serve |") == 2 and md.count("| mlx_lm.server |") == 2
    assert "Throughput, dflash2 serve / mlx_lm.server, by clients: 1: " in md
