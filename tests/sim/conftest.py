from __future__ import annotations

import pytest

from foldtrain.sim.cluster import from_dict


def cluster_dict(**over) -> dict:
    d = {
        "name": "test",
        "node": {"gpus": 4},
        "device": {
            "memory_gb": 16,
            "fp32_tflops": 10,
            "bf16_tflops": 100,
            "fp16_tflops": 100,
            "mem_bw_gbs": 1000,
            "efficiency": 1.0,
            "half_size": 1e-9,
            "layer_overhead_us": 1e-9,
        },
        "intra": {"bw_gbs": 10, "latency_us": 10},
        "inter": {"bw_gbs": 1, "latency_us": 50},
    }
    for k, v in over.items():
        sec, key = k.split("__")
        d[sec][key] = v
    return d


@pytest.fixture
def cluster():
    return from_dict(cluster_dict())
