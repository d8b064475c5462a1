"""The simulated step of ``--dp.strategy fsdp``: FSDP2 (``fully_shard``, ZeRO-3) over ``N = --parallel.dp`` ranks,
as ``foldtrain/parallel/dp/fsdp.py`` applies it.

Units: every transformer block is one, and the root (the model: embedding, final norm, tied head) another;
with ``--dp.shard_vocab`` (``Setup.shard_vocab``) the tied weight is no unit's: split by rows, never gathered or
reduce-scattered, its gradient a 1/N slice, and each micro-batch's embedding and head exchange rows of
activations instead (:func:`vocab_exchanges`), collectives the compute waits for.
Every rank keeps 1/N of each parameter, gradient and AdamW moment in fp32. A unit's all-gather moves its
parameters in the gathered dtype (the run's ``weight_bytes``: 2 under ``bf16-master`` / ``fp16-master``, whose
``MixedPrecisionPolicy`` gathers half-precision weights; 4 otherwise, autocast runs over the fp32 weights); its
reduce-scatter moves fp32 gradients (the policy's ``reduce_dtype``, or the fp32 parameters' own).

Per micro-batch, in FSDP2's order (``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``):

* **forward**: the root's all-gather, exposed (nothing computes before it), then embedding, blocks, head;
  the all-gather of the next unit is issued as a unit starts (FSDP2's implicit forward prefetch: the host
  runs ahead of the device), so a unit takes ``max(compute, next all-gather)``. The root is not resharded
  after the forward (FSDP2 keeps the root's parameters for the backward);
* **backward** (the head's backward is in the forward: the cost model's fused head): with
  ``--dp.reshard_after_forward true`` each block is all-gathered again, prefetched one unit ahead (FSDP2's
  explicit backward prefetch, issued as a block's backward starts, so the last block's overlaps the head);
  with ``false`` the blocks stay gathered from their forward and nothing is all-gathered. Other systems' FSDP1
  runs with ``BackwardPrefetch.BACKWARD_POST`` (``Setup.backward_prefetch == "post"``) issue a block's
  all-gather only once the block after it is done with its backward, before that block's reduce-scatter, so
  the compute waits for every backward all-gather;
* **reduce-scatter**: as a unit's backward ends, its gradients; FSDP2 keeps one reduce-scatter in flight
  (``reduce_scatter_max_input_buffers = 1``): before issuing the next, the compute stream waits for the
  previous, so a reduce-scatter overlaps the next unit's backward only. The root's goes last (at the end of
  the backward) and is exposed, as the final callback waits for it. With gradient accumulation foldtrain
  calls ``set_requires_gradient_sync(False)`` on every micro-batch but the last (``no_sync``), so the
  gradients are reduce-scattered once per step, in the last backward; the all-gathers happen in every
  micro-batch (the parameters are resharded after each backward).

Collectives: one link lane per rank, all-gathers and reduce-scatters one after another in issue order (both go
through the one process group, whose NCCL collectives run on one internal stream per device). Each is a
ring: ``(N-1)/N x bytes / busbw + (N-1) x hop`` (half of ``CostModel.ring_allreduce_time``'s all-reduce; no
separate summation term, as there), with the link's ``ag_bw`` / ``rs_bw`` bus bandwidth (``bw`` when 0) and
``coll`` hop; the node's NIC when the ranks span nodes (``Placement.dp_spans_nodes``; the ring crosses a node
boundary once per channel, so the node's NIC carries one rank's ring bytes). While a collective is on the
link the compute beside it runs ``1 + device.overlap_slowdown`` times slower (NCCL's kernels hold SMs and
memory bandwidth; :func:`stretched`). Not modelled: the copy-in/copy-out and casts around each collective,
and the host: a pass's launches are in its compute time, and the prefetches assume the host is
ahead.

After the backward: the fp16 overflow vote (fp16), the gradient-norm all-reduce (always: the norm is logged,
and clipping uses it), AdamW on this rank's 1/N (28 bytes per parameter: the sharded fp32 parameters are the
masters, there is no half copy to write), the loss all-reduce; each small all-reduce up and down a tree.

On a cluster whose ranks share the host's cores (``node.shared_cores``: CPU ranks on gloo) FSDP2's
collectives run synchronously on the training thread (``unshard_async_op`` is false, and a CPU has no
streams), so nothing overlaps; every rank computes at ``min(threads, cores / N)`` of a core, less
``oversubscribed_efficiency`` beyond one rank per core, as the event engine's shared cores give it.

Memory per rank: the fp32 shards (parameters, gradients, AdamW's two moments: 16 bytes per parameter / N; no
separate masters) and the unsharded buffers at the turn of the last micro-batch (``comm_buffers``): the root
and two blocks gathered (the current and the prefetched; every block with ``reshard_after_forward false``), the
root's and a block's gradient in the gathered dtype and one fp32 reduce-scatter input in flight (on shared cores,
where foldtrain turns the prefetch off and frees each input at once, :func:`.pipeline_fsdp.on_thread`: one
block gathered, not two, and of the block's own fp32 input only its excess over the block's weights, which
FSDP2 reshards before copying the gradients in), or, if more, at the
embedding's backward the root's parameters and three copies of the tied weight's gradient (the head's, the
embedding's and their sum; none with ``shard_vocab``, whose one slice is the sharded gradient) beside block 0's
reduce-scatter input (freed already on shared cores); with
gradient accumulation instead every unit's gradient accumulated unsharded in fp32 (4 bytes per parameter,
not sharded: the price of ``no_sync``), plus the current units' gradients before they are added in the
master modes. Activations and runtime as every data-parallel strategy (:func:`.memory.rank_memory`). With one
micro-batch a step the peak is the larger of two moments (:func:`rank_bytes`): the backward's start (every
activation, no gradient shard yet) and its end (every gradient shard, the buffers above, the activations freed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from foldtrain.errors import ConfigError
from foldtrain.schedules import build_schedule

from .cluster import Cluster
from .costs import CostModel, Placement, block_params, model_params, tied_params
from .memory import GB, format_breakdown, rank_memory
from .pipeline_fsdp import on_thread, root_host, unit_host
from .setup import Setup

REDUCE_BYTES = 4  # fp32 gradients on the wire and in the accumulation buffer


@dataclass(frozen=True)
class Phases:
    """Seconds of one unit's parts: collectives, computes (one micro-batch), and the step's tail."""

    ag_root: float
    ag_block: float
    rs_root: float
    rs_block: float
    embed_f: float
    block_f: float
    head: float  # the fused head: forward and backward of head and loss
    block_b: float
    embed_b: float
    optim: float
    before_step: float  # the fp16 overflow vote and the gradient-norm all-reduce
    loss: float  # the loss all-reduce after the step
    # --dp.shard_vocab: the activations' exchanges of the vocabulary-sharded embedding (forward, backward) and
    # head (forward and backward, with the cross entropy's all-reduces); they block the compute
    vocab_embed_f: float = 0.0
    vocab_head: float = 0.0
    vocab_embed_b: float = 0.0
    # FSDP2's host work in one pass of a block's unit and of the root, kept gathered and gathered
    # (.pipeline_fsdp.unit_host, root_host) at the rank's share of the cores
    host_block: float = 0.0
    host_block_gathered: float = 0.0
    host_root: float = 0.0
    host_root_gathered: float = 0.0


@dataclass(frozen=True)
class Item:
    """One compute of a micro-batch: the all-gather it needs first (s), the reduce-scatter it issues as it ends."""

    name: str
    op: str
    compute: float
    gather: float = 0.0
    reduce: float = 0.0
    first: bool = False  # the micro-batch's first: its all-gather cannot be prefetched
    exchange: float = 0.0  # a collective of activations (--dp.shard_vocab) the compute waits for


@dataclass
class FSDPStep:
    step_time: float
    events: list[list[dict]]  # one rank (every rank is the same), in the format of foldtrain.profile.timeline
    memory: list[dict[str, float]]  # one rank
    comm: float  # seconds per step the compute waits for all-gathers and reduce-scatters
    notes: list[str] = field(default_factory=list)


def root_params(s: Setup) -> float:
    """The root unit's parameters: the tied embedding/head (unless ``shard_vocab`` keeps it out), the positions, the
    final norm."""
    return model_params(s) - s.n_layer * block_params(s) - (tied_params(s) if s.shard_vocab else 0.0)


def vocab_exchanges(s: Setup, c: Cluster) -> tuple[float, float, float]:
    """Seconds of ``--dp.shard_vocab``'s collectives per micro-batch, (embedding forward, head forward and
    backward, embedding backward): each rank's rows of activations gathered from or summed to every rank (N x
    rows x d), the token ids and targets gathered, the cross entropy's three all-reduces of a float per row."""
    if not s.shard_vocab or s.dp <= 1:
        return 0.0, 0.0, 0.0
    every_row = s.dp * s.micro_batch * s.seq  # rows of all ranks
    acts = every_row * s.d_model * s.act_bytes
    ids = collective(s, c, every_row * 8, "ag")
    per_row = 3 * 2 * collective(s, c, every_row * 4, "rs")  # an all-reduce is a reduce-scatter and an all-gather
    embed_f = ids + collective(s, c, acts, "rs")
    head = ids + collective(s, c, acts, "ag") + per_row + collective(s, c, acts, "rs")
    return embed_f, head, collective(s, c, acts, "ag")


def collective(s: Setup, c: Cluster, nbytes: float, kind: str) -> float:
    """A ring all-gather (``kind`` "ag") or reduce-scatter ("rs") of ``nbytes`` unsharded bytes over the dp ranks."""
    n = s.dp
    if n <= 1:
        return 0.0
    link = c.inter if Placement(s, c).dp_spans_nodes() else c.intra
    bw = (link.ag_bw if kind == "ag" else link.rs_bw) or link.bw
    return (n - 1) / n * nbytes / bw + (n - 1) * link.coll


def cpu_rate(s: Setup, c: Cluster) -> float:
    """Cores per rank while all ``N`` ranks compute on ``shared_cores`` (1 on own devices)."""
    cores, n = c.shared_cores, s.dp
    if cores <= 0:
        return 1.0
    cap = float(max(1, int(cores) // max(n, 1)))
    bw = cores
    if c.oversubscribed < 1.0 and n > cores:
        bw *= 1.0 - (1.0 - c.oversubscribed) * min(1.0, (n - cores) / cores)
    return min(cap, bw / n)


def phases(s: Setup, c: Cluster) -> Phases:
    cm = CostModel(s, c)
    wb, L = s.weight_bytes, s.n_layer
    root, block = root_params(s), block_params(s)
    rate = cpu_rate(s, c)
    pl = Placement(s, c)
    small = pl.world_latency()  # one small all-reduce over every rank
    # the sharded fp32 parameters are the masters: AdamW's 28 bytes per parameter, no half copy
    optim = CostModel(dataclasses.replace(s, master=False), c).optim(0, 1.0 / s.dp)
    vocab_embed_f, vocab_head, vocab_embed_b = vocab_exchanges(s, c)
    return Phases(
        ag_root=collective(s, c, root * wb, "ag"),
        ag_block=collective(s, c, block * wb, "ag"),
        rs_root=collective(s, c, root * REDUCE_BYTES * s.wire_factor, "rs"),  # (--dp.compression: half)
        rs_block=collective(s, c, block * REDUCE_BYTES * s.wire_factor, "rs"),
        embed_f=cm.t_embed_f / rate,
        block_f=cm.t_block_f / rate,
        head=cm.t_head / rate,
        block_b=(cm.backward(0) - 2 * cm.t_embed_f) / L / rate,
        embed_b=2 * cm.t_embed_f / rate,
        optim=optim / rate,
        before_step=small * (2 if s.fp16_scaler else 1),
        loss=small,
        vocab_embed_f=vocab_embed_f,
        vocab_head=vocab_head,
        vocab_embed_b=vocab_embed_b,
        host_block=unit_host(c, False) / rate,
        host_block_gathered=unit_host(c, True) / rate,
        host_root=root_host(c, root > 0, False) / rate,
        host_root_gathered=root_host(c, root > 0, True) / rate,
    )


def items(s: Setup, ph: Phases) -> list[Item]:
    """Every compute of the step in order, with the collectives FSDP2 ties to it."""
    L, again = s.n_layer, s.reshard_after_forward
    out: list[Item] = []
    for m in range(s.microbatches):
        sync = m == s.microbatches - 1  # no_sync on the others: no reduce-scatter
        f_embed = ph.embed_f + ph.host_root_gathered
        out.append(Item(f"F embed mb{m}", "F", f_embed, gather=ph.ag_root, first=True, exchange=ph.vocab_embed_f))
        out += [
            Item(f"F block {i} mb{m}", "F", ph.block_f + ph.host_block_gathered, gather=ph.ag_block) for i in range(L)
        ]
        out.append(Item(f"F head mb{m}", "F", ph.head, exchange=ph.vocab_head))
        out += [
            Item(
                f"B block {i} mb{m}",
                "B",
                ph.block_b + (ph.host_block_gathered if again else ph.host_block),
                gather=ph.ag_block if again else 0.0,
                reduce=ph.rs_block if sync else 0.0,
            )
            for i in reversed(range(L))
        ]
        out.append(
            Item(
                f"B embed mb{m}",
                "B",
                ph.embed_b + ph.host_root,
                reduce=ph.rs_root if sync else 0.0,
                exchange=ph.vocab_embed_b,
            )
        )
    return out


def _event(name: str, kind: str, start: float, end: float, **args) -> dict:
    return {"name": name, "kind": kind, "rank": 0, "start": start, "end": end, "step": 0, "args": args}


class _Lanes:
    """The rank's compute stream and its link, and the events they record; ``slowdown``: compute's extra time
    while a collective is on the link (``Cluster.overlap_slowdown``)."""

    def __init__(self, slowdown: float = 0.0):
        self.t = self.link = self.last_rs = self.waited = 0.0
        self.slowdown = slowdown
        self.busy: list[tuple[float, float]] = []  # the link's collectives, in time order
        self.events: list[dict] = []

    def compute(self, work: float) -> float:
        """Run ``work`` seconds of compute from now, slower where the link's collectives overlap it; its end."""
        return stretched(self.t, work, self.busy, self.slowdown)

    def wait(self, until: float, what: str) -> None:
        if until > self.t:
            self.events.append(_event(f"wait {what}", "reduce_wait", self.t, until))
            self.waited += until - self.t
            self.t = until

    def issue(self, name: str, dur: float, after: float) -> float:
        """A collective on the link, once it is free and ``after``; returns its end."""
        start = max(self.link, after)
        self.link = start + dur
        self.busy.append((start, self.link))
        self.events.append(_event(name, "reduce", start, self.link))
        return self.link


def stretched(start: float, work: float, busy: list[tuple[float, float]], slowdown: float) -> float:
    """The end of ``work`` seconds of compute from ``start`` that runs ``1 + slowdown`` times slower inside the
    ``busy`` intervals (sorted, disjoint)."""
    t = start
    for b0, b1 in busy:
        if b1 <= t or slowdown <= 0:
            continue
        if b0 > t:  # alone until the next collective
            if t + work <= b0:
                return t + work
            work -= b0 - t
            t = b0
        if t + work * (1 + slowdown) <= b1:
            return t + work * (1 + slowdown)
        work -= (b1 - t) / (1 + slowdown)
        t = b1
    return t + work


def timeline(s: Setup, ph: Phases, overlap: bool = True, slowdown: float = 0.0) -> tuple[float, list[dict], float]:
    """``(step time, events, seconds waited for collectives)``; ``overlap=False``: every collective blocks.
    ``s.backward_prefetch == "post"``: a block's backward all-gather is issued once the block after it is done
    with its backward (before that block's reduce-scatter), the first block's of the backward when it starts."""
    post = s.backward_prefetch == "post"
    todo = items(s, ph)
    ln = _Lanes(slowdown if overlap else 0.0)
    ready: dict[int, float] = {}  # item -> end of its all-gather
    for k, it in enumerate(todo):
        if it.gather and k not in ready:  # not prefetched: issued now
            ready[k] = ln.issue(f"all-gather for {it.name}", it.gather, ln.t)
        ln.wait(ready.get(k, 0.0), "all-gather")
        if it.exchange:
            ln.wait(ln.issue(f"vocabulary exchange of {it.name}", it.exchange, ln.t), "vocabulary exchange")
        start = ln.t
        nxt = todo[k + 1] if k + 1 < len(todo) else None
        prefetch = overlap and nxt is not None and nxt.gather and not nxt.first
        after = post and nxt is not None and nxt.op == "B"  # BACKWARD_POST: issued as this backward ends
        if prefetch and not after:
            ready[k + 1] = ln.issue(f"all-gather for {nxt.name}", nxt.gather, start)
        ln.t = ln.compute(it.compute)
        ln.events.append(_event(it.name, "compute", start, ln.t, op=it.op))
        if prefetch and after and it.op == "B":  # before this unit's reduce-scatter (FSDP1's post-backward hook)
            ready[k + 1] = ln.issue(f"all-gather for {nxt.name}", nxt.gather, ln.t)
        if it.reduce:
            if overlap:
                ln.wait(ln.last_rs, "reduce-scatter")  # one reduce-scatter in flight
            ln.last_rs = ln.issue(f"reduce-scatter after {it.name}", it.reduce, ln.t)
            if not overlap:
                ln.wait(ln.last_rs, "reduce-scatter")
    ln.wait(ln.last_rs, "reduce-scatter")  # the root's final callback waits for every reduce-scatter
    t = ln.t + ph.before_step
    ln.events.append(_event("optimizer", "optim", t, t + ph.optim))
    t += ph.optim + ph.loss
    ln.events.append(_event("step", "step", 0.0, t))
    return t, ln.events, ln.waited


def unsharded_bytes(s: Setup, thread: bool = False) -> float:
    """The unsharded parameters and gradients a rank holds at the turn of the last micro-batch (the module
    docstring says which); ``thread``: :func:`.pipeline_fsdp.on_thread`."""
    wb, L = s.weight_bytes, s.n_layer
    root, block = root_params(s), block_params(s)
    gathered = wb * (root + (L if not s.reshard_after_forward else min(L, 1 if thread else 2)) * block)
    in_flight = REDUCE_BYTES * block  # one reduce-scatter's fp32 input
    if s.microbatches > 1:  # no_sync: every unit's gradient accumulated unsharded in fp32
        fresh = wb * (root + block) if wb != REDUCE_BYTES else 0.0  # this micro-batch's, before it is added
        return gathered + REDUCE_BYTES * model_params(s) + fresh + in_flight
    # the fp32 reduce-scatter input: on a GPU the last one, kept beside the next unit's gradients; on shared cores
    # only the block's own, filled after FSDP2 has resharded the block's weights (so only its excess over them)
    during_blocks = gathered + wb * (root + block) + (max(0.0, REDUCE_BYTES - wb) * block if thread else in_flight)
    # The embedding's backward comes last: autograd adds its dense gradient of the tied weight to the head's out
    # of place (as it does in plain torch with a tied head), so the root's parameters and three tied-weight-sized
    # gradients (foldtrain bench fsdp-memory: the peak at GPT-2's vocabulary, where the tied weight is 5.6
    # blocks) are alive at once, beside block 0's reduce-scatter input, which FSDP2 keeps for a GPU stream
    # still reading it; on shared cores foldtrain's synchronous reduce-scatter has freed it
    # (--dp.shard_vocab: one copy of this rank's slice, its sharded gradient itself)
    tied_copies = 0.0 if s.shard_vocab else 3 * wb * tied_params(s)
    at_embedding = wb * root + tied_copies + (0.0 if thread else in_flight)
    return max(during_blocks, at_embedding)


def backward_start_bytes(s: Setup, thread: bool = False) -> float:
    """The unsharded buffers as the backward starts (the head's): the root gathered (kept from the forward), the
    head's unsharded gradient of the tied weight (in the root's unit only), and on a GPU the last block's
    all-gather, prefetched as the head's backward starts."""
    wb = s.weight_bytes
    tied_grad = 0.0 if s.shard_vocab else wb * tied_params(s)
    return wb * root_params(s) + tied_grad + (0.0 if thread else wb * block_params(s))


def rank_bytes(s: Setup, c: Cluster) -> dict[str, float]:
    """Bytes by category on every rank, at its peak moment. With one micro-batch a step the backward frees the
    activations as it makes the sharded gradients (``zero_grad`` set them to None): at its start every activation
    is alive and no gradient shard, at its end every gradient shard and the units' buffers
    (:func:`unsharded_bytes`), the activations freed; the larger is the peak (``foldtrain bench fsdp-memory``: at
    GPT-2's vocabulary over 2 x 32 tokens per rank, the end). With accumulation the unsharded fp32 gradients are
    alive throughout: everything is counted at once."""
    n, w = model_params(s), s.dp
    sched = build_schedule("1f1b", 1, 1, s.microbatches)
    base = rank_memory(s, CostModel(s, c), sched, 0, c.runtime)
    thread = on_thread(c)
    shards = {"params": 4 * n / w, "optimizer": 8 * n / w, "masters": 0.0, "runtime": base["runtime"]}
    end = {"grads": REDUCE_BYTES * n / w, "comm_buffers": unsharded_bytes(s, thread), "activations": 0.0}
    if s.microbatches > 1:
        moment = {**end, "activations": base["activations"]}
    else:
        start = {"grads": 0.0, "comm_buffers": backward_start_bytes(s, thread), "activations": base["activations"]}
        moment = max(start, end, key=lambda m: sum(m.values()))
    out = {**shards, **moment}
    return {**out, "total": sum(out.values())}


def simulate_fsdp(s: Setup, c: Cluster, check_memory: bool = True) -> FSDPStep:
    """The step of ``s`` (``strategy == "fsdp"``, ``dp`` ranks) on ``c``; ConfigError (``check_memory``) when a
    rank runs out of memory."""
    mem = rank_bytes(s, c)
    if check_memory and mem["total"] > c.memory:
        accumulated = (
            f"; its {s.microbatches} micro-batches per step keep every gradient unsharded in fp32 "
            f"({REDUCE_BYTES * model_params(s) / GB:.2f} GB), fewer and larger ones avoid that"
            if s.microbatches > 1
            else ""
        )
        raise ConfigError(
            f"does not fit: an fsdp rank needs {mem['total'] / GB:.2f} GB but a {c.name} device has "
            f"{c.memory / GB:.2f} GB ({format_breakdown(mem)}); use more --parallel.dp ranks"
            f"{'' if s.ac else ', --ac full'} or a larger device{accumulated}"
        )
    ph = phases(s, c)
    overlap = not on_thread(c)
    step, events, waited = timeline(s, ph, overlap, c.overlap_slowdown)
    gathers = sum(it.gather for it in items(s, ph))
    reduces = sum(it.reduce for it in items(s, ph))
    ms = lambda x: f"{x * 1e3:.3g} ms"  # noqa: E731
    notes = [
        f"fsdp over {s.dp} ranks, per step: all-gathers {ms(gathers)} and reduce-scatters {ms(reduces)}, the "
        f"compute waiting {ms(waited)} for them (the root's all-gather per micro-batch {ms(ph.ag_root)}, its "
        f"reduce-scatter at the end {ms(ph.rs_root)}); optimizer on 1/{s.dp} {ms(ph.optim)}; "
        f"reshard_after_forward {str(s.reshard_after_forward).lower()}"
        + (
            f"; the tied weight split by rows (shard_vocab): its exchanges of activations "
            f"{ms(s.microbatches * (ph.vocab_embed_f + ph.vocab_head + ph.vocab_embed_b))} per step, blocking"
            if s.shard_vocab
            else ""
        )
        + ("" if overlap else "; gloo on shared cores: every collective blocks the training thread")
    ]
    return FSDPStep(step, [events], [mem], waited, notes)
