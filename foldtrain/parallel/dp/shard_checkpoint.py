"""sharded-ps' checkpoint entries.

``model`` is the full fp32 model under the single-process names (gathered from the shards, so
``eval``/``generate`` read it like any other checkpoint); ``optim`` holds each rank's moments under
``shard<r>of<W>``: resuming needs the same world size, bucket and slice sizes, which the
``shard_layout`` entry records (:func:`layout_record`) and loading checks.
"""

from __future__ import annotations

import zlib

import torch

from foldtrain.errors import CheckpointError
from foldtrain.optim import TrainState, adamw_state, load_adamw_state
from foldtrain.parallel.dp.shard_gather import GatherQueue
from foldtrain.parallel.dp.shard_layout import ShardLayout


def layout_record(layout: ShardLayout) -> torch.Tensor:
    """Which element of which parameter every rank's shard holds, in four numbers: a CRC of the buckets'
    parameters and slices, the world size, the slice length, the number of buckets."""
    buckets = layout.buckets
    desc = [(b.decay.idx, b.decay.slices, b.plain.idx, b.plain.slices) for b in buckets]
    step = buckets[0].decay.slices[0] if buckets[0].decay.slices else (0, 0)
    return torch.tensor(
        [zlib.crc32(repr(desc).encode()), layout.world, step[1] - step[0], len(buckets)], dtype=torch.int64
    )


class ShardCheckpoint:
    """The ``model``, ``optim`` and ``shard_layout`` entries of ``state``'s model and of this rank's
    ``decay_shard`` / ``plain_shard`` (the parameters ``state``'s optimizer steps)."""

    def __init__(
        self,
        state: TrainState,
        layout: ShardLayout,
        gathers: GatherQueue,
        decay_shard: torch.nn.Parameter,
        plain_shard: torch.nn.Parameter,
    ):
        self.state, self.layout, self.gathers = state, layout, gathers
        self.decay_shard, self.plain_shard = decay_shard, plain_shard
        self.params = [p for _, p in state.named_params]
        self.key = f"shard{layout.rank}of{layout.world}"

    def fp32_full(self) -> dict[int, torch.Tensor]:
        """Parameter storage address -> its fp32 values (gathered from every rank's shard)."""
        values = [torch.empty(p.shape, dtype=torch.float32, device=p.device) for p in self.params]
        self.layout.unpack(self.gathers.gather_rows(torch.float32), values)
        return {p.data_ptr(): v for p, v in zip(self.params, values)}

    def save(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        views = self.fp32_full()
        model = {k: views.get(v.data_ptr(), v) for k, v in get_model_state_dict(self.state.model).items()}
        optimizer = self.state.optimizer
        optim = {
            self.key: {
                "decay": adamw_state(optimizer, self.decay_shard),
                "plain": adamw_state(optimizer, self.plain_shard),
            }
        }
        return {"model": model, "optim": optim, "shard_layout": layout_record(self.layout)}

    @torch.no_grad()
    def load(self, sd: dict) -> None:
        """Check the layout, then this rank's shards from the full model, the replica from it, and the moments."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        self.gathers.land_all()
        mine, saved = layout_record(self.layout).tolist(), sd["shard_layout"].tolist()
        if saved != mine:
            raise CheckpointError(
                f"this checkpoint's sharded-ps shards (world {saved[1]}, {saved[3]} buckets, slices of {saved[2]} "
                f"elements) are laid out unlike this run's (world {mine[1]}, {mine[3]} buckets, slices of {mine[2]}); "
                "resume with the world size, "
                "--dp.first_bucket_mb, --dp.shard_bucket_mb and --dp.shard_slice_mb it was saved with"
            )
        by_ptr = {v.data_ptr(): sd["model"][k] for k, v in get_model_state_dict(self.state.model).items()}
        full = [by_ptr[p.data_ptr()].float() for p in self.params]
        self.decay_shard.copy_(self.layout.my_part(full, "decay").view(1, -1))
        self.plain_shard.copy_(self.layout.my_part(full, "plain"))
        for p, v in zip(self.params, full):
            p.copy_(v)
        saved = sd["optim"][self.key]
        for key, p in (("decay", self.decay_shard), ("plain", self.plain_shard)):
            load_adamw_state(self.state.optimizer, p, saved[key])
