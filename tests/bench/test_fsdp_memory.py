"""``bench fsdp-memory``'s exact peak of tensors alive: the profiler's allocator events, held to known tensors."""

import torch

from foldtrain.bench.fsdp_memory import allocated_peak, tensors_alive

MB = 2**20


def test_allocated_peak_is_the_most_bytes_alive_at_once():
    kept = torch.zeros(MB // 4)  # 1 MB alive before and throughout: counted once, through Python
    before = tensors_alive()
    assert before >= MB

    def run() -> None:
        a = torch.empty(4 * MB, dtype=torch.uint8)  # +4
        b = torch.empty(8 * MB, dtype=torch.uint8)  # +8: 12 MB at once
        del a
        c = torch.empty(6 * MB, dtype=torch.uint8)  # 14 MB at once: the peak
        del b, c
        d = torch.empty(13 * MB, dtype=torch.uint8)  # 13 MB alone: below it
        del d

    peak = allocated_peak(run)
    assert peak - before == 14 * MB  # exact: no sampling can miss it, no freed block counts
    assert kept.numel()
