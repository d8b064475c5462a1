"""The simulated step of ``--dp.strategy dataparallel``: ``torch.nn.DataParallel``, one process driving the
``N = --parallel.dp`` GPUs of one node (HP3C'22's "single parameter server").

Per forward (``--train.micro_batch`` rows, ``b = rows / N`` per device), in this order, nothing overlapping
the next part:

* **replicate**: the micro-batch's token ids scattered from device 0, then the parameters broadcast from
  device 0 to the others (``broadcast_coalesced``: buckets of 10 MiB, each an NCCL broadcast, which
  pipelines the bytes along a ring, so the source sends each byte once: ``bytes / bw`` plus ``N - 1`` hops
  per bucket);
* **forward**: every replica runs in its own Python thread, and the threads share the interpreter's lock,
  so the host work of launching a pass (the cost model's host part: ``launch_us`` per kernel and
  ``layer_overhead`` per block) is paid once per device, one device after another: the pass takes
  ``max(device + host, N x host)``, the devices computing ``device`` of it;
* **gather**: the replicas' logits ``(b, L, V)`` copied to device 0 (``N - 1`` copies into device 0's link,
  at the link's point-to-point bandwidth), and in the backward their gradient scattered back as many;
* **backward**: autograd's per-device threads run the replicas' backward without the interpreter's lock,
  so it takes what it takes on one device;
* **reduce**: every replica's gradients summed onto device 0's parameters (``reduce_add_coalesced``,
  10 MiB NCCL reduces), once every replica's backward is done.

After the last forward, device 0 alone clips and steps the optimizer. The loss runs on device 0 over the
whole micro-batch; the cost model prices the head and the loss as one pass, so each replica is charged its
rows' share of the loss (device 0's extra ``(N - 1) / N`` of the loss, a few percent of a step, is not on
the critical path here). Not modelled: ``replicate``'s own Python work of copying the module objects and the
threads' start-up per forward.

Memory: device 0 holds the model, its gradients, the optimizer state (and fp32 masters), its replica's
gradients until the reduce, and the loss's fp32 ``(b, L, V)`` buffers of the whole micro-batch; the others
hold a replica, its gradients and their rows' activations, with their logits' gradient instead of the loss.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from foldtrain.errors import ConfigError
from foldtrain.schedules import build_schedule

from .cluster import Cluster
from .costs import CostModel, model_params
from .memory import GB, format_breakdown, rank_memory
from .setup import Setup

BUCKET = 10 * 2**20  # torch's buffer size of broadcast_coalesced and reduce_add_coalesced
TOKEN_BYTES = 8  # int64 token ids


@dataclass(frozen=True)
class Phases:
    """Seconds of one forward-backward's parts (``*_busy``: what one device computes of it) and of the update."""

    replicate: float
    forward: float
    forward_busy: float
    host_forward: float  # the host's launch work of one device's forward
    gather: float
    backward: float
    backward_busy: float
    reduce: float
    optim: float
    optim_busy: float


@dataclass
class DataParallelStep:
    step_time: float
    events: list[list[dict]]  # per device, in the format of foldtrain.profile.timeline
    memory: list[dict[str, float]]  # per device
    comm: float  # seconds per step every device waits for replicate, gather and reduce
    notes: list[str] = field(default_factory=list)


def _link(c: Cluster, nbytes: float, hops: float, p2p: bool = False) -> float:
    bw = (c.intra.p2p_bw or c.intra.bw) if p2p else c.intra.bw
    return hops * c.intra.coll + nbytes / bw


def phases(s: Setup, c: Cluster) -> Phases:
    """The parts of one forward-backward over ``s.dp`` devices, ``s.micro_batch`` rows each."""
    n = s.dp
    cm, dev = CostModel(s, c), CostModel(s, dataclasses.replace(c, layer_overhead=0.0, launch=0.0))
    f, (f_dev, host) = cm.forward(0), cm.forward_parts(0)  # host: launching the pass's kernels, its fixed costs
    b, b_dev = cm.backward(0), dev.backward(0)
    weights = model_params(s) * s.weight_bytes
    grads = model_params(s) * s.grad_bytes
    rows_in = (n - 1) * s.micro_batch * s.seq * TOKEN_BYTES
    logits = (n - 1) * s.micro_batch * s.seq * s.vocab * s.act_bytes
    return Phases(
        replicate=_link(c, rows_in, 1, p2p=True) + _link(c, weights, math.ceil(weights / BUCKET) * (n - 1)),
        forward=max(f, n * host),
        forward_busy=f_dev,
        host_forward=host,
        gather=2 * _link(c, logits, 1, p2p=True),
        backward=b,
        backward_busy=b_dev,
        reduce=_link(c, grads, math.ceil(grads / BUCKET) * (n - 1)),
        optim=cm.optim(0),
        optim_busy=dev.optim(0),
    )


def _event(name: str, kind: str, rank: int, start: float, end: float) -> dict:
    return {"name": name, "kind": kind, "rank": rank, "start": start, "end": end, "step": 0, "args": {}}


def timeline(s: Setup, ph: Phases) -> tuple[float, list[list[dict]]]:
    """``(step time, events per device)``: every forward-backward's parts one after another on every device,
    then device 0's optimizer step."""
    parts = [
        ("replicate", ph.replicate, 0.0),
        ("F", ph.forward, ph.forward_busy),
        ("gather logits", ph.gather, 0.0),
        ("B", ph.backward, ph.backward_busy),
        ("reduce gradients", ph.reduce, 0.0),
    ]
    events: list[list[dict]] = [[] for _ in range(s.dp)]
    t = 0.0
    for _ in range(s.microbatches):
        for name, dur, busy in parts:
            for r, evs in enumerate(events):
                if busy > 0:  # the device computes at the end of a pass whose launches it waited for
                    evs.append(_event(name, "compute", r, t + dur - busy, t + dur))
                else:
                    evs.append(_event(name, "reduce_wait", r, t, t + dur))
            t += dur
    events[0].append(_event("optimizer", "optim", 0, t, t + ph.optim_busy))
    t += ph.optim
    for r, evs in enumerate(events):
        evs.append(_event("step", "step", r, 0.0, t))
    return t, events


def device_memory(s: Setup, c: Cluster) -> list[dict[str, float]]:
    """Bytes by category on device 0 and on each other device."""
    n = s.dp
    sched = build_schedule("1f1b", 1, 1, s.microbatches)
    base = rank_memory(s, CostModel(s, c), sched, 0, c.runtime)
    rows_logits = s.micro_batch * s.seq * s.vocab
    loss = c.loss_buffers * rows_logits * 4  # a replica's rows of the fp32 buffers memory.py holds at the loss
    first = {**base, "comm_buffers": base["grads"], "activations": base["activations"] + (n - 1) * loss}
    other = {
        **base,
        "optimizer": 0.0,
        "masters": 0.0,
        "activations": base["activations"] - loss + rows_logits * s.act_bytes,  # the logits' gradient instead
    }
    out = []
    for mem in [first] + [other] * (n - 1):
        mem = {k: v for k, v in mem.items() if k != "total"}
        out.append({**mem, "total": sum(mem.values())})
    return out


def simulate_dataparallel(s: Setup, c: Cluster, check_memory: bool = True) -> DataParallelStep:
    """The step of ``s`` (``strategy == "dataparallel"``, ``dp`` devices) on ``c``; ConfigError when the devices
    are more than one node has, or (``check_memory``) device 0 runs out of memory."""
    n = s.dp
    if n > c.gpus_per_node:
        raise ConfigError(
            f"--dp.strategy dataparallel drives the GPUs of one node from one process, but --parallel.dp {n} is "
            f"more than a {c.name} node's {c.gpus_per_node}; use --parallel.dp {c.gpus_per_node} or less, "
            "or ddp across nodes"
        )
    memory = device_memory(s, c)
    if check_memory and memory[0]["total"] > c.memory:
        raise ConfigError(
            f"does not fit: dataparallel's device 0 needs {memory[0]['total'] / GB:.2f} GB but a {c.name} device "
            f"has {c.memory / GB:.2f} GB ({format_breakdown(memory[0])}); use a smaller --train.micro_batch, "
            "--ac full, or a strategy that spreads the optimizer (sharded-ps, fsdp)"
        )
    ph = phases(s, c)
    step, events = timeline(s, ph)
    comm = s.microbatches * (ph.replicate + ph.gather + ph.reduce)
    ms = lambda x: f"{x * s.microbatches * 1e3:.3g} ms"  # noqa: E731 - per step, over every forward
    notes = [
        f"dataparallel over {n} GPUs, per step: replicate {ms(ph.replicate)}, forward {ms(ph.forward)} "
        f"(of which the devices compute {ms(ph.forward_busy)}; the host launches {n} x {ms(ph.host_forward)}), "
        f"logits gathered and their gradient scattered {ms(ph.gather)}, backward {ms(ph.backward)}, "
        f"gradients reduced onto device 0 {ms(ph.reduce)}, optimizer on device 0 {ph.optim * 1e3:.3g} ms"
    ]
    return DataParallelStep(step, events, memory, comm, notes)
