"""Every rank checks at start that it trains on the same prepared dataset."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from foldtrain.data import TokenData, prepare
from foldtrain.data.dataset import fingerprint
from foldtrain.distributed import _ranges, check_same_data
from tests.conftest import tiny_run_args
from tests.support import torchrun

# each rank trains on the prepared directory named by its RANK (as if every node prepared its own copy)
WRAPPER = """import os, sys
from foldtrain.cli import main
paths = sys.argv[1].split(",")
sys.exit(main([*sys.argv[2:], "--data.path", paths[int(os.environ["RANK"])]]))
"""


def test_identity_and_single_process(small_data):
    meta = TokenData.open(small_data).meta
    assert fingerprint(meta) == fingerprint(json.loads(json.dumps(meta))) == TokenData.open(small_data).fingerprint
    assert len(fingerprint(meta)) == 12
    shards = [dict(s) for s in meta.get("shards") or [meta["splits"]]]
    shards[-1] = {**shards[-1], "val": {**shards[-1]["val"], "sha256": "0" * 64}}
    other = {**meta, "shards": shards} if "shards" in meta else {**meta, "splits": shards[0]}
    assert fingerprint(other) != fingerprint(meta)
    check_same_data(fingerprint(meta))  # no process group: nothing to compare
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and _ranges([3]) == "3"


def test_ranks_with_different_data_fail_on_every_rank(small_corpus, small_data, tmp_path):
    other = tmp_path / "other"
    prepare(small_corpus, other, vocab_size=512, val_fraction=0.1, seed=1, quiet=True)  # another split of the same text
    wrapper = tmp_path / "per_rank_data.py"
    wrapper.write_text(WRAPPER)
    args = tiny_run_args(
        small_data, tmp_path / "run", "--train.steps", "2", "--dp.strategy", "ddp", "--train.device", "cpu"
    )
    r = torchrun(2, str(wrapper), f"{small_data},{other}", "train", *args, timeout=300)
    assert r.returncode != 0
    a, b = TokenData.open(small_data).fingerprint, TokenData.open(other).fingerprint
    line = (
        "foldtrain: error: the ranks train on different data "
        f"(dataset fingerprints from meta.json checksums: rank 0: {a}; rank 1: {b})"
    )
    assert r.stderr.count(line) == 2, r.stderr[-4000:]  # raised on both ranks: neither waits for the other
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


_FAULTS_PROBE = """
import resource, sys, torch
from foldtrain.hostmem import keep_freed_host_memory
from foldtrain.model.gpt import GPT, GPTShape, lm_loss
torch.set_num_threads(1)
applied = keep_freed_host_memory() if sys.argv[1] == "1" else False
model = GPT(GPTShape(1, 2, 32, 128, 8192))  # 2,048 tokens x 8,192 words: 64 MB logits, above glibc's mmap threshold
x = torch.randint(0, 8192, (16, 128))
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    lm_loss(model(x), x).backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, sum(faults[-5:]))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's; elsewhere the setting is a no-op")
def test_keep_freed_host_memory_stops_refaulting_a_steps_largest_tensors():
    """Training steps whose logits are 64 MB: by default every step faults the pages of its largest tensors in
    again (about 66,000 4 KiB pages a step here); with the setting the heap keeps them, and only the steps
    in which it still grows towards its high-water mark fault (page faults of the last 5 of 8 steps, counted
    by the kernel, not timed)."""

    def faults(on: str) -> tuple[str, int]:
        out = subprocess.run(
            [sys.executable, "-c", _FAULTS_PROBE, on], capture_output=True, text=True, check=True
        ).stdout.split()
        return out[0], int(out[1])

    applied, kept = faults("1")
    _, default = faults("0")
    assert applied == "True"
    assert default >= 5 * 16384, default  # at least one 64 MB tensor's pages, every step
    assert kept <= default / 4, (kept, default)
