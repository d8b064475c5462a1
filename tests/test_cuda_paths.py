"""Paths taken only on a GPU, checked on the CPU with stand-ins: ``--profile`` times compute by waiting for the
compute stream, never for the whole device (whose NCCL streams hold receives posted early: a device-wide wait hangs
a pipeline); NCCL's waits block the CPU under either launcher."""

from __future__ import annotations

import torch

from foldtrain.engine.pipeline import compute_sync


def test_profiling_on_a_gpu_waits_for_the_compute_stream_only(monkeypatch):
    calls = []

    class Stream:
        def synchronize(self):
            calls.append("stream")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: calls.append(("current", device)) or Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("device"))
    gpu = torch.device("cuda", 1)
    sync = compute_sync(True, gpu)
    sync()
    assert calls == [("current", gpu), "stream"]


def test_no_wait_without_profiling_or_off_the_gpu():
    assert compute_sync(False, torch.device("cuda", 0)) is None
    assert compute_sync(True, torch.device("cpu")) is None


def test_nccl_waits_block_under_torchrun_and_horovodrun(monkeypatch):
    """Both launch paths pick the backend through ``_backend``, which makes NCCL's waits block the CPU (so a stalled
    peer is a DistributedError naming it) unless the user chose otherwise."""
    import inspect

    from foldtrain import distributed

    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    assert distributed._backend(torch.device("cpu")) == "gloo"
    assert "TORCH_NCCL_BLOCKING_WAIT" not in distributed.os.environ
    assert distributed._backend(torch.device("cuda", 0)) == "nccl"
    assert distributed.os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "0")
    assert distributed._backend(torch.device("cuda", 0)) == "nccl"
    assert distributed.os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "0"
    for init in (distributed.init_distributed, distributed._init_from_horovod):
        assert "_backend(device)" in inspect.getsource(init), init.__name__
