"""``foldtrain calibrate --out FILE [--network RATE --nodes N --ranks_per_node R]``: measure this machine.

Writes a cluster file (:mod:`foldtrain.sim.cluster`) for ``foldtrain simulate --cluster FILE``. With
``--device cuda`` (or ``--device cpu --probes kernels``, its twin on a CPU) the per-operation probes of
:mod:`.device` measure it: each kernel of a step at the models' shapes (:mod:`.gpu`) and the collectives among
torchrun's ranks (:mod:`.nccl`). Otherwise (``--probes fitted``, the CPU default), the CPU cost model's fit:

* compute: matrix products ``(512 x n) @ (n x 4n)`` for ``n`` in 32..512 per dtype, run by
  ``min(N x R, cores)`` processes at once (each on a core of its own, as busy as the runs'
  ranks; ``node.shared_cores`` tells the simulator that more ranks than cores share them), fitted to
  ``rate(n) = peak * n / (n + half_size)``; memory bandwidth from a 64 MB copy, the fixed
  cost of a transformer block from a tiny one, a real block's backward / forward time ratio (2 by FLOPs;
  blocks timed as a pipeline chunk runs them: several distinct ones, several micro-batches in flight),
  the element-wise bandwidth that makes the cost model's block forward equal a
  real one (on a CPU, exp/erf/tanh bind it, not memory), and what the real fused head costs beyond its
  matrix products, per logit (log-softmax, copies) and per weight element (streaming it, accumulating
  its gradient), fitted at two shapes, the optimizer step per parameter (fused AdamW and the
  clipping norm: on a CPU compute-bound, not memory-bound), under
  the same concurrency; the loss's ``(b, L, V)`` buffers the resident peak holds (real training
  steps at two token counts: the host allocator's holes included);
* oversubscription (when the runs have more ranks than cores): blocks timed with ``cores`` and with
  ``N x R`` single-threaded processes at once; the share of the cores' work left when twice as many
  ranks as cores are busy (``node.oversubscribed_efficiency``, 0.8-0.9 here: context switches and
  caches), which the simulator's shared cores apply;
* communication: gloo point-to-point latency (ping-pong), and all-reduce bandwidth (and the CPU
  time per byte sent its threads take, which on shared cores comes out of compute) over the
  ``R`` ranks of one node (``torchrun --standalone``): the ``intra`` link;
* the pipeline executor's own host work per action (``device.action_overhead_us``): a real 2-rank
  pipeline of a negligible model, its step against the simulator's (the core-seconds per action that make
  them equal);
* FSDP2's own host work (``device.fsdp_unit_us``, ``device.fsdp_root_us``, ``device.fsdp_gather_us``): chunks
  of tiny blocks sharded over one rank, forward and backward, against them unsharded, kept gathered and
  resharded (:mod:`.fsdp`);
* with ``--network RATE``: the same over ``N`` emulated nodes on throttled links
  (:mod:`foldtrain.netem`, one rank per node): the ``inter`` link. Needs root and iproute2.

Above :mod:`foldtrain.sim` (it imports torch and the benchmark's namespaces); the simulator
itself stays pure.
"""

from .cli import main
from .comm import check_network_prerequisites, links, measure_loopback, measure_network
from .compute import (
    DTYPES,
    HEAD_SHAPES,
    RATIO_SHAPES,
    SIZES,
    _block_times,
    _fit_cluster,
    fit_elem_bw,
    fit_half_size,
    fit_head,
    fit_rate,
    measure_compute,
    measure_oversubscription,
)
from .executor import EXECUTOR_PROBE, EXECUTOR_STEPS, measure_action_overhead
from .fsdp import FIELDS as FSDP_FIELDS
from .fsdp import measure_fsdp_host
from .memory import LOSS_SHAPE, LOSS_TOKENS, measure_loss_buffers

__all__ = [
    "DTYPES",
    "EXECUTOR_PROBE",
    "EXECUTOR_STEPS",
    "HEAD_SHAPES",
    "LOSS_SHAPE",
    "LOSS_TOKENS",
    "RATIO_SHAPES",
    "SIZES",
    "_block_times",
    "_fit_cluster",
    "check_network_prerequisites",
    "fit_elem_bw",
    "fit_half_size",
    "fit_head",
    "fit_rate",
    "links",
    "main",
    "measure_action_overhead",
    "measure_compute",
    "measure_fsdp_host",
    "FSDP_FIELDS",
    "measure_loopback",
    "measure_loss_buffers",
    "measure_network",
    "measure_oversubscription",
]
