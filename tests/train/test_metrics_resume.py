"""metrics.jsonl after a resume or a restart holds every step once: the records an attempt logged after
its last checkpoint (and a line torn by a kill) are dropped before the resumed attempt logs those steps again."""

from __future__ import annotations

import json

from foldtrain.train.metrics import RunLogger


def test_a_resumed_logger_drops_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 6)]
    path.write_text("\n".join(lines) + '\n{"step": 6, "lo')  # step 6 torn by a kill mid-write
    log = RunLogger(tmp_path, True, 8, 3, progress=False, resumed=True)  # resumed from the checkpoint of step 3
    for s in range(4, 9):
        log.log({"step": s, "loss": 0.5})
    log.close()
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == list(range(1, 9))


def test_a_fresh_logger_appends(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 5}\n')
    log = RunLogger(tmp_path, True, 8, 0, progress=False)
    log.log({"step": 1})
    log.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [5, 1]
