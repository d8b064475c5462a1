"""The cases the 3D-engine worker runs, per world size (torch-free; shared by worker and pytest).

Equivalence cases: EVERY schedule x dp_sync on each layout ``(dp, pp, tp, V)``, except the
combinations a schedule cannot run, skipped here explicitly:

* ``1f1b`` runs one chunk per rank: only ``V == 1``;
* ``interleaved-1f1b`` needs ``V >= 2`` (and ``M`` a multiple of ``P``: every layout here uses
  ``M = 4``, a multiple of every ``P``);
* ``fold`` with ``--fold.defer_reduce`` (only meaningful with ``dp_sync per-chunk``, and only with
  ``--optim.grad_clip 0``) is one extra case per layout.

The split-backward (zero-bubble) schedules run per-chunk on every layout, ``fold-zb`` with deferral too
(:func:`zero_bubble_cases`): ``zb-h1`` where ``V == 1``, ``interleaved-zb`` and ``fold-zb`` where ``V >= 2``,
``zbv`` (the V placement: the turn on the last rank and the tie on rank 0 without transfers) where ``V == 2``.
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "fold")
DP_SYNCS = ("after-flush", "per-chunk")
STEPS = 5
MICRO = 2  # rows per micro-batch
M = 4  # micro-batches per data-parallel rank
M32 = dict(precision="bf16-master", masters_in_fp32=True)  # the masters' machinery with fp32 for the half dtype


def valid(schedule: str, v: int) -> bool:
    if schedule in ("1f1b", "zb-h1"):
        return v == 1  # 1F1B runs one chunk per rank
    if schedule in ("interleaved-1f1b", "interleaved-zb"):
        return v >= 2  # interleaving needs several chunks per rank
    if schedule == "zbv":
        return v == 2  # the V placement: two chunks per rank
    return True


def zero_bubble_cases(layout: tuple[int, int, int, int], n_layer: int = 8, tag: str = "zb", **extra) -> list[dict]:
    """The split-backward schedules on ``layout``: per-chunk reduction, and fold-zb with deferral."""
    v = layout[3]
    names = [n for n in ("zb-h1", "zbv", "interleaved-zb", "fold-zb") if valid(n, v)]
    out = [_one(layout, n, "per-chunk", tag, n_layer=n_layer, **extra) for n in names]
    if v >= 2:
        out.append(_one(layout, "fold-zb", "per-chunk", tag, defer=True, n_layer=n_layer, **extra))
    return out


def _cases_for(layout: tuple[int, int, int, int], n_layer: int = 8, tag: str = "", **extra) -> list[dict]:
    dp, pp, tp, v = layout
    out = []
    for sched in SCHEDULES:
        if not valid(sched, v):
            continue  # explicitly skipped: see the module docstring
        for sync in DP_SYNCS:
            out.append(dict(layout=layout, schedule=sched, dp_sync=sync, defer=False, n_layer=n_layer, **extra))
    out.append(dict(layout=layout, schedule="fold", dp_sync="per-chunk", defer=True, n_layer=n_layer, **extra))
    for c in out:
        c["id"] = case_id(c, tag)
    return out


def case_id(c: dict, tag: str = "") -> str:
    dp, pp, tp, v = c["layout"]
    s = f"dp{dp}-pp{pp}-tp{tp}-v{v}-{c['schedule']}-{c['dp_sync']}" + ("-defer" if c["defer"] else "")
    return s + (f"-{tag}" if tag else "")


def _one(layout, schedule, dp_sync, tag, defer=False, n_layer=8, **extra) -> dict:
    c = dict(layout=layout, schedule=schedule, dp_sync=dp_sync, defer=defer, n_layer=n_layer, **extra)
    c["id"] = case_id(c, tag)
    return c


# --dp.strategy fsdp: every chunk fully sharded over dp (FSDP2), 4 micro-batches (2 under tp) accumulated
# before each chunk's reduce-scatter; the blocks' weights freed after the forward (reshard) or kept
FSDP = dict(fsdp=True)
FSDP_DP_PP = [
    _one((2, 2, 1, 1), "1f1b", "after-flush", "fsdp", **FSDP),
    _one((2, 2, 1, 1), "gpipe", "per-chunk", "fsdp-keep", reshard=False, **FSDP),
    _one((2, 2, 1, 2), "interleaved-1f1b", "per-chunk", "fsdp", **FSDP),
    _one((2, 2, 1, 2), "fold", "per-chunk", "fsdp-keep", reshard=False, **FSDP),
    _one((2, 2, 1, 2), "fold", "after-flush", "fsdp-noclip", clip=0.0, **FSDP),  # early steps at each WR
    _one((2, 2, 1, 2), "fold", "per-chunk", "fsdp-m32", **FSDP, **M32),
    _one((2, 2, 1, 2), "fold", "per-chunk", "fsdp-bf16m", precision="bf16-master", **FSDP),
    _one((2, 2, 1, 2), "interleaved-1f1b", "after-flush", "fsdp-bf16", precision="bf16", **FSDP),
    _one((2, 2, 1, 1), "1f1b", "per-chunk", "fsdp-fp16", precision="fp16", **FSDP),
    # loss scaling over fp32 shards at the fp32 tolerance (real fp16-master reduces in fp32, more exactly than the
    # single process's fp16 gradients: its norms differ by about 1.4e-3)
    _one((2, 2, 1, 1), "1f1b", "after-flush", "fsdp-fp16m32", precision="fp16-master", masters_in_fp32=True, **FSDP),
    _one((2, 2, 1, 2), "fold", "per-chunk", "fsdp-ac", ac="full", **FSDP),
    _one((2, 2, 1, 2), "fold", "per-chunk", "fsdp-wire", wire="bf16", **FSDP),  # bf16 reduce-scatters
    # no pipeline: FSDP over tensor-parallel DTensors (torchtitan's 2D), the tied embedding one parameter
    _one((2, 1, 2, 1), "gpipe", "per-chunk", "fsdp-2d", n_layer=2, m=2, **FSDP),
    # the split backward: each I gathers its chunk's weights first (resharded after a forward or kept), the W
    # accumulates on them; zbv's two tied copies, both on rank 0, summed there; bf16 weights, fp32 gradients;
    # recomputation
    _one((2, 2, 1, 1), "zb-h1", "per-chunk", "fsdp", **FSDP),
    _one((2, 2, 1, 2), "interleaved-zb", "after-flush", "fsdp-keep", reshard=False, **FSDP),
    _one((2, 2, 1, 2), "fold-zb", "per-chunk", "fsdp", **FSDP),
    _one((2, 2, 1, 2), "zbv", "per-chunk", "fsdp", **FSDP),
    _one((2, 2, 1, 2), "zbv", "per-chunk", "fsdp-bf16m", precision="bf16-master", **FSDP),
    _one((2, 2, 1, 2), "fold-zb", "per-chunk", "fsdp-ac", ac="full", **FSDP),  # recomputed inside the I
]
# with tensor parallelism: 2D (dp, tp) DTensors; the norm over shards of both really clips (every step)
FSDP_DP_PP_TP = [
    _one((2, 2, 2, 1), "1f1b", "per-chunk", "fsdp-clip", n_layer=2, m=2, grad_clip=0.05, **FSDP),
    _one((2, 2, 2, 2), "interleaved-1f1b", "after-flush", "fsdp-keep", n_layer=4, m=2, reshard=False, **FSDP),
    _one((2, 2, 2, 2), "fold", "per-chunk", "fsdp", n_layer=4, m=2, **FSDP),
    _one((2, 2, 2, 2), "zbv", "per-chunk", "fsdp", n_layer=4, m=2, **FSDP),  # the split over 2D DTensors
]


def equivalence_cases(world: int) -> list[dict]:
    if world == 2:
        return [
            *_cases_for((1, 2, 1, 1)),
            *_cases_for((1, 2, 1, 2)),
            *_cases_for((1, 1, 2, 1), n_layer=2, m=2),  # TP (DTensor) steps are slow on CPU: shallow, 2 micro-batches
            _one(
                (1, 1, 2, 1), "gpipe", "after-flush", "tpclip", n_layer=2, m=2, grad_clip=0.05
            ),  # TP clipping really clips
            # uneven split: 7 layers in 4 segments (2, 2, 2, 1), and explicit counts
            _one((1, 2, 1, 2), "fold", "per-chunk", "7layers", n_layer=7),
            _one((1, 2, 1, 2), "interleaved-1f1b", "after-flush", "7layers", n_layer=7),
            _one((1, 2, 1, 2), "gpipe", "per-chunk", "split1321", n_layer=7, layers_per_chunk=[1, 3, 2, 1]),
            # activation recomputation, and autocast precisions (looser tolerance)
            _one((1, 2, 1, 2), "fold", "per-chunk", "ac", ac="full"),
            _one((1, 2, 1, 1), "1f1b", "after-flush", "bf16", precision="bf16"),
            _one((1, 2, 1, 1), "1f1b", "per-chunk", "fp16", precision="fp16"),
            # half-precision weights with fp32 masters (half activations between stages, half reductions); the
            # masters' machinery alone at the fp32 tolerance (fp32 in place of the half dtype, both sides)
            _one((1, 2, 1, 2), "fold", "per-chunk", "bf16m", precision="bf16-master"),
            _one((1, 2, 1, 2), "fold", "per-chunk", "m32", **M32),
            _one((1, 2, 1, 1), "1f1b", "after-flush", "fp16m", precision="fp16-master"),
            _one((1, 1, 2, 1), "gpipe", "after-flush", "bf16m", n_layer=2, m=2, precision="bf16-master"),
            _one((1, 1, 2, 1), "gpipe", "after-flush", "m32", n_layer=2, m=2, **M32),
            # no clipping: every chunk steps as soon as its reduction lands (executor.early_steps)
            _one((1, 2, 1, 2), "fold", "per-chunk", "noclip", clip=0.0),
            # a vocabulary not divisible by tp: padded to 64 rows, against one process's unpadded 63
            _one((1, 1, 2, 1), "gpipe", "after-flush", "pad63", n_layer=2, m=2, vocab_pad=63),
            # split backward: I / W with the fused head, segment 0's whole-backward W, recomputation, fp16 scaling
            *zero_bubble_cases((1, 2, 1, 1)),
            *zero_bubble_cases((1, 2, 1, 2)),
            _one((1, 2, 1, 1), "zb-h1", "after-flush", "zb"),
            _one((1, 2, 1, 2), "fold-zb", "per-chunk", "zb-ac", ac="full"),
            _one((1, 2, 1, 1), "zb-h1", "per-chunk", "zb-fp16", precision="fp16"),
            _one((1, 2, 1, 2), "fold-zb", "per-chunk", "zb-bf16", precision="bf16"),
            _one((1, 2, 1, 2), "interleaved-zb", "per-chunk", "zb-m32", **M32),
        ]
    if world == 4:
        return [
            *_cases_for((1, 4, 1, 2)),
            *_cases_for((2, 2, 1, 2)),
            _one((4, 1, 1, 1), "gpipe", "per-chunk", "dponly"),
            # deferral with clipping: the global norm waits for every chunk, the steps stay deferred
            _one((2, 2, 1, 2), "fold", "per-chunk", "clip", defer=True, clip=1.0),
            # a vocabulary the step's tokens touch less than half of: the embedding's rows go sparse over dp
            # and between the two ends (tie.py: 2 x 128 tokens <= 300 words). (With 256 or 512 words and AdamW's
            # eps at 1e-8 the data drawn put this model's fc bias at 1.1e-5 after 5 steps at dp 2 x pp 2 under
            # every schedule, gpipe with V = 1 and after-flush sync too: Adam-amplified float noise of that draw,
            # not the tie, which equivalence.make_cfg's eps now bounds; 300 words: 3e-6.)
            _one((2, 2, 1, 2), "fold", "per-chunk", "sparsetie", vocab=300),
            _one((2, 2, 1, 2), "fold", "per-chunk", "sparsetie", defer=True, vocab=300),
            # the master precisions with dp: deferred half-precision reductions, early steps; pp x tp
            _one((2, 2, 1, 2), "fold", "per-chunk", "bf16m", defer=True, precision="bf16-master"),
            _one((2, 2, 1, 2), "fold", "per-chunk", "m32", defer=True, **M32),
            _one((2, 2, 1, 2), "interleaved-1f1b", "per-chunk", "m32", precision="fp16-master", masters_in_fp32=True),
            _one((4, 1, 1, 1), "gpipe", "per-chunk", "fp16m", precision="fp16-master"),
            _one((1, 2, 2, 1), "1f1b", "after-flush", "bf16m", n_layer=2, m=2, precision="bf16-master"),
            _one((1, 2, 2, 1), "1f1b", "after-flush", "m32", n_layer=2, m=2, **M32),
            # the distributed optimizer (AdamW's state and masters sliced over dp): per-chunk and deferred
            # reductions, early steps, clipping, the tie's copies in their own slices, master precisions
            _one((2, 2, 1, 2), "fold", "per-chunk", "zero", zero=True),
            _one((2, 2, 1, 2), "fold", "per-chunk", "zero", defer=True, zero=True),
            _one((2, 2, 1, 2), "fold", "per-chunk", "zero-whole", defer=True, zero=True, split_tied=False),
            _one((2, 2, 1, 2), "fold", "per-chunk", "zero-clip", defer=True, clip=1.0, zero=True),
            _one((2, 2, 1, 2), "interleaved-1f1b", "after-flush", "zero", zero=True),
            _one((4, 1, 1, 1), "gpipe", "per-chunk", "zero", zero=True),
            _one((2, 2, 1, 2), "fold", "per-chunk", "zero-m32", defer=True, zero=True, **M32),
            _one(
                (2, 2, 1, 1),
                "1f1b",
                "after-flush",
                "zero-fp16m32",
                zero=True,
                precision="fp16-master",
                masters_in_fp32=True,
            ),
            _one((2, 2, 1, 2), "fold", "per-chunk", "zero-bf16m", zero=True, precision="bf16-master"),
            # --optim.shard_tied: the tied copies' state sliced too; the tie exchanges slices (the head's copy
            # reduce-scattered, the embedding's touched rows added into the head's slice: a 300-word vocabulary)
            _one((2, 2, 1, 2), "fold", "per-chunk", "zero-tied", defer=True, zero=True, shard_tied=True, vocab=300),
            # split backward with dp: deferred and deadline-ordered reductions, clipping, the distributed optimizer
            *zero_bubble_cases((2, 2, 1, 2)),
            *zero_bubble_cases((1, 4, 1, 1)),
            _one((2, 2, 1, 2), "fold-zb", "per-chunk", "zb-clip", defer=True, clip=1.0),
            _one((2, 2, 1, 2), "fold-zb", "per-chunk", "zb-zero", defer=True, zero=True),
            # pp x tp: the weights' groups of DTensor parameters
            *zero_bubble_cases((1, 2, 2, 1), n_layer=2, m=2),
            _one((1, 2, 2, 2), "interleaved-zb", "per-chunk", "zb", n_layer=4, m=2),
            # zbv: the V turn on rank 3, the tie on rank 0 (after-flush: every reduction after the flush); pp x tp
            _one((1, 4, 1, 2), "zbv", "after-flush", "zb"),
            _one((2, 2, 1, 2), "zbv", "per-chunk", "zb-zero", zero=True),
            _one((2, 2, 1, 2), "zbv", "per-chunk", "zb-zero-tied", zero=True, shard_tied=True),
            _one((1, 2, 2, 2), "zbv", "per-chunk", "zb", n_layer=4, m=2),
            # --dp.compression: deferred and urgent buckets, the tie's sparse rows and dense head in bf16; the V
            # placement's summed tie in fp16
            _one((2, 2, 1, 2), "fold-zb", "per-chunk", "wire-bf16", defer=True, wire="bf16", vocab=300),
            _one((2, 2, 1, 2), "zbv", "per-chunk", "wire-fp16", wire="fp16"),
            *FSDP_DP_PP,
        ]
    if world == 8:  # 8 processes on few cores: 2 micro-batches; the last case pads a 63-word vocabulary to 64
        return [
            *_cases_for((2, 2, 2, 1), n_layer=2, m=2),
            _one((2, 2, 2, 1), "fold", "per-chunk", "pad63", n_layer=2, m=2, vocab_pad=63),
            _one((2, 2, 2, 1), "1f1b", "per-chunk", "m32", n_layer=2, m=2, **M32),
            _one((2, 2, 2, 1), "fold", "per-chunk", "zero", n_layer=2, m=2, zero=True),
            _one((2, 2, 2, 1), "1f1b", "per-chunk", "zero-tied", n_layer=2, m=2, zero=True, shard_tied=True),
            _one((2, 2, 2, 1), "1f1b", "per-chunk", "zero-m32", n_layer=2, m=2, zero=True, **M32),
            *zero_bubble_cases((2, 2, 2, 1), n_layer=2, m=2),
            _one((2, 2, 2, 2), "interleaved-zb", "per-chunk", "zb", n_layer=4, m=2),
            _one((2, 2, 2, 2), "zbv", "per-chunk", "zb", n_layer=4, m=2),
            *FSDP_DP_PP_TP,
        ]
    return []


# checkpoint / resume cases (world 4): save at step 3 of 6, reload, continue
CKPT_CASES = [
    dict(
        id="ckpt-dp2-pp2-tp1-v2-fold-per-chunk",
        layout=(2, 2, 1, 2),
        schedule="fold",
        dp_sync="per-chunk",
        defer=False,
        n_layer=8,
    ),
    dict(
        id="ckpt-dp2-pp2-tp1-v2-fold-per-chunk-defer",
        layout=(2, 2, 1, 2),
        schedule="fold",
        dp_sync="per-chunk",
        defer=True,
        n_layer=8,
    ),
    # DTensor (TP-sharded) weights and optimizer states, the tied copy's state under the embedding's key
    dict(
        id="ckpt-dp1-pp2-tp2-v1-1f1b-after-flush",
        layout=(1, 2, 2, 1),
        schedule="1f1b",
        dp_sync="after-flush",
        defer=False,
        n_layer=2,
    ),
    # the master precisions: the fp32 masters are the checkpoint's weights, the chunks take them on load
    dict(
        id="ckpt-dp2-pp2-tp1-v2-fold-per-chunk-bf16-master",
        layout=(2, 2, 1, 2),
        schedule="fold",
        dp_sync="per-chunk",
        defer=False,
        n_layer=8,
        precision="bf16-master",
    ),
    # the distributed optimizer: the slices gathered into the single-process names, and back
    dict(
        id="ckpt-dp2-pp2-tp1-v2-fold-per-chunk-defer-zero",
        layout=(2, 2, 1, 2),
        schedule="fold",
        dp_sync="per-chunk",
        defer=True,
        n_layer=8,
        zero=True,
    ),
    # --optim.shard_tied: the tied copies' state in slices too
    {
        **_one((2, 2, 1, 2), "fold", "per-chunk", "", zero=True, shard_tied=True),
        "id": "ckpt-dp2-pp2-tp1-v2-fold-per-chunk-zero-tied",
    },
    # the master precisions: the fp32 masters are the weights of record, saved and loaded in slices too; the
    # save in the background (--checkpoint.async: staged by DCP's blocking stager)
    {
        **_one((2, 2, 1, 2), "fold", "per-chunk", "", zero=True, precision="bf16-master", background=True),
        "id": "ckpt-dp2-pp2-tp1-v2-fold-per-chunk-zero-bf16m",
    },
    # the V placement (zbv): rank 0's two chunks (first and last segment), the tied copy's state on rank 0
    dict(
        id="ckpt-dp2-pp2-tp1-v2-zbv-per-chunk",
        layout=(2, 2, 1, 2),
        schedule="zbv",
        dp_sync="per-chunk",
        defer=False,
        n_layer=8,
    ),
]

# FSDP: the sharded chunks saved under the single-process names, resumed, and loaded by one process
CKPT_CASES.append(
    dict(
        id="ckpt-dp2-pp2-tp1-v2-fold-per-chunk-fsdp",
        layout=(2, 2, 1, 2),
        schedule="fold",
        dp_sync="per-chunk",
        defer=False,
        n_layer=8,
        fsdp=True,
    )
)

# deadline-ordered reductions (world 4): fold V=4 with deferral, profiled; also checked against one process
DEADLINE_CASES = [
    dict(
        id="deadline-dp2-pp2-tp1-v4-fold-defer",
        layout=(2, 2, 1, 4),
        schedule="fold",
        dp_sync="per-chunk",
        defer=True,
        n_layer=8,
    ),
]

# profile cases (world 2): sleep-based blocks of fixed duration
PROFILE_CASES = [
    dict(id="profile-gpipe-p2-m4", layout=(1, 2, 1, 1), schedule="gpipe", n_layer=2),
    dict(id="profile-1f1b-p2-m4", layout=(1, 2, 1, 1), schedule="1f1b", n_layer=2),
    dict(id="profile-fold-p2-v2-m4", layout=(1, 2, 1, 2), schedule="fold", n_layer=4),
]


def all_ids(world: int) -> list[str]:
    ids = [c["id"] for c in equivalence_cases(world)]
    if world == 4:
        ids += [c["id"] for c in CKPT_CASES] + [c["id"] for c in DEADLINE_CASES]
    if world == 2:
        ids += [c["id"] for c in PROFILE_CASES]
    return ids


# launch order (worlds 2 and 4): each rank's communication, in the order the executor launches it, against the
# simulator's on the same schedule (the tie and deferral included; three profiled steps)
ORDER_CASES = {
    2: [
        _one((1, 2, 1, 2), "fold", "per-chunk", "order"),
        _one((1, 2, 1, 2), "fold", "after-flush", "order"),
        _one((1, 2, 1, 2), "interleaved-1f1b", "per-chunk", "order-noclip", clip=0.0),
        _one((1, 2, 1, 1), "1f1b", "after-flush", "order"),
        _one((1, 2, 1, 1), "zb-h1", "per-chunk", "order"),
    ],
    4: [
        _one((2, 2, 1, 2), "fold", "per-chunk", "order", defer=True),
        _one((2, 2, 1, 2), "fold", "per-chunk", "order-clip", defer=True, clip=1.0),
        _one((1, 4, 1, 1), "gpipe", "per-chunk", "order"),
        _one((2, 2, 1, 2), "fold-zb", "per-chunk", "order", defer=True),
        _one((2, 2, 1, 2), "interleaved-zb", "per-chunk", "order"),
        _one((2, 2, 1, 2), "zbv", "per-chunk", "order"),
    ],
}
