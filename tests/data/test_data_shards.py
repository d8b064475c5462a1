"""Sharded prepare: parallel workers, resume after an interruption, parts on several machines, bad shards."""

from __future__ import annotations

import importlib
import json
import shutil

import numpy as np
import pytest

from foldtrain.cli import main
from foldtrain.data import TokenData, prepare
from foldtrain.errors import DataError

from .conftest import write_corpus

shards_mod = importlib.import_module("foldtrain.data.shards")
SHARD_MB = 0.004  # ~4 KB of input per shard: the 30-document corpus makes ~10 shards


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards") / "raw"
    write_corpus(root, n_docs=30, words=300, seed=5)
    return root


@pytest.fixture(scope="module")
def reference(raw, tmp_path_factory):
    """The corpus prepared in one go, in one process."""
    out = tmp_path_factory.mktemp("ref") / "ds"
    prepare(raw, out, vocab_size=300, val_fraction=0.2, seed=4, shard_mb=SHARD_MB, quiet=True)
    return out


def same_dataset(a, b):
    ma, mb = (json.loads((p / "meta.json").read_text()) for p in (a, b))
    assert ma["shards"] == mb["shards"] and ma["splits"] == mb["splits"]
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    for f in sorted(a.glob("*.bin")):
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name


def test_layout_and_parallel_workers(raw, reference, tmp_path):
    meta = json.loads((reference / "meta.json").read_text())
    n = len(meta["shards"])
    assert n >= 6 and meta["format"] == "foldtrain-tokens-v2"
    assert sorted(p.name for p in reference.glob("train-*.bin")) == [f"train-{i:05d}.bin" for i in range(n)]
    assert sum(s["train"]["tokens"] for s in meta["shards"]) == meta["splits"]["train"]["tokens"]
    prepare(raw, tmp_path / "w3", vocab_size=300, val_fraction=0.2, seed=4, shard_mb=SHARD_MB, workers=3, quiet=True)
    same_dataset(reference, tmp_path / "w3")


def test_interrupted_prepare_resumes_from_complete_shards(raw, reference, tmp_path, monkeypatch):
    out = tmp_path / "ds"
    real, calls = shards_mod.run_shard, []

    def dies_at_shard_4(job):
        if job.index == 4:
            (tmp_path / "ds.partial" / "train-00004.bin.tmp").write_bytes(b"half")
            raise KeyboardInterrupt("killed")
        calls.append(job.index)
        return real(job)

    monkeypatch.setattr(shards_mod, "run_shard", dies_at_shard_4)
    with pytest.raises(KeyboardInterrupt):
        prepare(raw, out, vocab_size=300, val_fraction=0.2, seed=4, shard_mb=SHARD_MB, quiet=True)
    assert calls == [0, 1, 2, 3] and not out.exists()
    assert sorted(p.name for p in (tmp_path / "ds.partial").glob("shard-*.json")) == [
        f"shard-{i:05d}.json" for i in range(4)
    ]
    calls.clear()
    monkeypatch.setattr(shards_mod, "run_shard", lambda job: (calls.append(job.index), real(job))[1])
    prepare(raw, out, vocab_size=300, val_fraction=0.2, seed=4, shard_mb=SHARD_MB, quiet=True)
    n = len(json.loads((out / "meta.json").read_text())["shards"])
    assert calls == list(range(4, n)), "complete shards are kept, the rest is prepared"
    same_dataset(reference, out)
    assert not (tmp_path / "ds.partial").exists()


def test_resume_with_other_options_refused_and_nothing_changes(raw, tmp_path, monkeypatch, capsys):
    out = tmp_path / "ds"
    monkeypatch.setattr(shards_mod, "run_shard", lambda job: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        prepare(raw, out, vocab_size=300, val_fraction=0.2, seed=4, shard_mb=SHARD_MB, quiet=True)
    before = {p.name: p.read_bytes() for p in (tmp_path / "ds.partial").iterdir()}
    with pytest.raises(
        DataError,
        match=r"ds.partial holds an interrupted prepare with different options \(seed 4 there, 5 now\); "
        r"re-run with the same options",
    ):
        prepare(raw, out, vocab_size=300, val_fraction=0.2, seed=5, shard_mb=SHARD_MB, quiet=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "ds.partial").iterdir()} == before
    args = [
        "prepare",
        "--data.path",
        str(raw),
        "--data.out",
        str(out),
        "--data.vocab_size",
        "300",
        "--data.val_fraction",
        "0.2",
        "--data.seed",
        "4",
        "--data.shard_mb",
        "0.008",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("foldtrain: error: ") and "shard_mb 0.004 there, 0.008 now" in err[0]


def test_parts_on_several_machines_combine_into_the_dataset(raw, reference, tmp_path, monkeypatch):
    """Each "machine" prepares its part in its own directory; copying the parts together and running
    the command without --data.shard finalizes the same dataset one machine would have made."""
    kw = dict(vocab_size=300, val_fraction=0.2, seed=4, shard_mb=SHARD_MB, quiet=True)
    parts = []
    for k in range(3):
        res = prepare(raw, tmp_path / f"m{k}" / "ds", shard=k, num_shards=3, **kw)
        assert res["part"] == k and not (tmp_path / f"m{k}" / "ds").exists()
        parts.append(tmp_path / f"m{k}" / "ds.partial")
    n = json.loads((parts[0] / "options.json").read_text())["n_shards"]
    for k, p in enumerate(parts):
        assert sorted(f.name for f in p.glob("shard-*.json")) == [f"shard-{i:05d}.json" for i in range(k, n, 3)]
    combined = tmp_path / "all" / "ds.partial"
    for p in parts:
        shutil.copytree(p, combined, dirs_exist_ok=True)
    calls = []
    real = shards_mod.run_shard
    monkeypatch.setattr(shards_mod, "run_shard", lambda job: (calls.append(job.index), real(job))[1])
    prepare(raw, tmp_path / "all" / "ds", **kw)
    assert calls == [], "combining prepares nothing again"
    same_dataset(reference, tmp_path / "all" / "ds")


def test_missing_or_truncated_shard_on_open(reference, tmp_path):
    ds = tmp_path / "ds"
    shutil.copytree(reference, ds)
    f = ds / "train-00003.bin"
    size = f.stat().st_size
    with f.open("r+b") as fh:
        fh.truncate(size - 4)
    with pytest.raises(
        DataError,
        match=rf"train-00003.bin is truncated \({size - 4} bytes, expected {size}\); re-run foldtrain prepare",
    ):
        TokenData.open(ds)
    f.unlink()
    with pytest.raises(DataError, match="token file .*train-00003.bin is missing; re-run foldtrain prepare"):
        TokenData.open(ds)


def test_checksums_small_or_on_request(reference, tmp_path, monkeypatch):
    ds = tmp_path / "ds"
    shutil.copytree(reference, ds)
    f = max(ds.glob("val-*.bin"), key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    data[0] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"{f.name} is corrupt"):
        TokenData.open(ds)  # small: verified by default
    monkeypatch.setattr("foldtrain.data.dataset.VERIFY_AUTO_BYTES", 10)  # as if the dataset were large
    TokenData.open(ds)  # sizes only
    with pytest.raises(DataError, match=f"{f.name} is corrupt"):
        TokenData.open(ds, verify=True)
    from foldtrain.config import DataConfig
    from foldtrain.data import open_dataset

    open_dataset(DataConfig(path=str(ds)))
    with pytest.raises(DataError, match=f"{f.name} is corrupt"):
        open_dataset(DataConfig(path=str(ds), verify=True))  # --data.verify


def test_sharded_stream_reads_across_boundaries(reference):
    data = TokenData.open(reference)
    train = data.split("train")
    whole = np.concatenate(
        [np.fromfile(reference / f"train-{i:05d}.bin", dtype="<u2") for i in range(len(data.meta["shards"]))]
    )
    assert len(train) == len(whole) and np.array_equal(train[:], whole)
    b = int(train.bounds[1])
    assert np.array_equal(train[b - 3 : b + 3], whole[b - 3 : b + 3])
    pos = np.array([[b - 2, b - 1, b, b + 1], [0, 1, 2, 3]])
    assert np.array_equal(train[pos], whole[pos]) and train[b] == whole[b] and train[-1] == whole[-1]
    offsets = data.doc_offsets("train")
    assert len(offsets) == data.meta["splits"]["train"]["documents"] and np.all(whole[offsets[1:] - 1] == data.eot_id)


def test_bad_prepare_arguments(raw, tmp_path):
    with pytest.raises(DataError, match="--data.workers must be at least 1"):
        prepare(raw, tmp_path / "o", workers=0, quiet=True)
    with pytest.raises(DataError, match=r"--data.shard 3 is not in \[0, --data.num_shards 3\)"):
        prepare(raw, tmp_path / "o", shard=3, num_shards=3, quiet=True)
    (tmp_path / "o.partial").mkdir()
    (tmp_path / "o.partial" / "mine.txt").write_text("keep")
    with pytest.raises(DataError, match="o.partial exists and is not an interrupted prepare"):
        prepare(raw, tmp_path / "o", quiet=True)
    assert (tmp_path / "o.partial" / "mine.txt").read_text() == "keep"


def test_jsonl_byte_ranges_read_every_line_once(tmp_path, monkeypatch):
    """A JSONL file cut into many small byte ranges (pieces) yields each document exactly once, in order."""
    monkeypatch.setattr("foldtrain.data.plan.PIECE_BYTES", 97)  # ranges end mid-line, on newlines, anywhere
    rows = [{"text": f"row {i} " + "x" * (i % 37) + ("\n" if i % 5 == 0 else "")} for i in range(200)]
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps(r) + "\n" + ("\n" if i % 7 == 0 else "") for i, r in enumerate(rows))
    )
    meta = prepare(
        tmp_path / "d.jsonl", tmp_path / "out", vocab_size=300, val_fraction=0.3, seed=1, shard_mb=0.002, quiet=True
    )
    assert meta["n_documents"] == 200 and len(meta["shards"]) > 3
    from foldtrain.data import decode, load_tokenizer

    data, tok = TokenData.open(tmp_path / "out"), load_tokenizer(tmp_path / "out" / "tokenizer.json")
    got = []
    for split in ("train", "val"):
        ids = np.asarray(data.split(split)[:])
        bounds = [*data.doc_offsets(split).tolist(), len(ids)]
        got += [decode(tok, ids[a : b - 1]) for a, b in zip(bounds, bounds[1:])]
    assert sorted(got) == sorted(r["text"] for r in rows)


def test_hf_dataset_in_row_ranges(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr("foldtrain.data.plan.PIECE_BYTES", 300)
    texts = [f"document {i} " * (1 + i % 9) for i in range(120)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "hf"))
    meta = prepare(
        tmp_path / "hf", tmp_path / "out", vocab_size=300, val_fraction=0.2, seed=1, shard_mb=0.001, quiet=True
    )
    assert meta["n_documents"] == 120 and len(meta["shards"]) > 2


def test_tokenizer_sample_is_bounded_and_seeded(raw, tmp_path):
    from foldtrain.data.plan import make_plan, tokenizer_sample

    plan = make_plan(raw, "text", 1 << 30, tmp_path / "plan.jsonl")
    total = sum(len(p.read_text()) for p in raw.rglob("*.txt"))
    budget = total // 4
    a, b = list(tokenizer_sample(plan, "text", budget, 1)), list(tokenizer_sample(plan, "text", budget, 1))
    c = list(tokenizer_sample(plan, "text", budget, 2))
    longest = max(len(p.read_text()) for p in raw.rglob("*.txt"))
    assert a == b and a != c and 0 < sum(map(len, a)) < budget + longest
    assert len(list(tokenizer_sample(plan, "text", 10 * total, 1))) == 30  # a budget above the corpus: all of it
