"""A pipeline rank's checkpoint state under the single-process names, and the full model for export.

The chunks keep the full model's parameter names (``parts.3.attn.qkv.weight``), so the DCP
checkpoint of any 3D layout holds exactly the keys of a single-process one and loads either way
(DCP reshards). Two mappings make the optimizer state match too: the last rank's copy of the
tied weight saves its moments under the embedding's key (the two copies' states are identical),
and ``param_groups`` list the full model's names as the single-process engine saves them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from foldtrain import collectives
from foldtrain.model.gpt import GPT, GPTShape
from foldtrain.optim import restore_lr
from foldtrain.parallel.pipeline.stage import Chunk, part_ranges
from foldtrain.parallel.pipeline.zero_pieces import STATE_KEYS, load_masters, segment_pieces, sharded


def _is_dtensor(t) -> bool:
    return hasattr(t, "_local_tensor") and hasattr(t, "device_mesh")


class ChunkStates:
    def __init__(
        self,
        full_params: list[tuple[str, int]],
        n_parts: int,
        steps,
        precision,
        topo,
        split_tie: bool,
        executor,
    ):
        """``full_params``: (name, ndim) of the full model's parameters in order, the tied weight once
        (taken before the pipeline split unties it); ``steps``: the rank's
        :class:`~foldtrain.engine.pipeline_steps.ChunkOptimizers`, whose ``state_views`` hold the weights of
        record and AdamW's state under the chunks' names."""
        self.steps = steps
        self.precision, self.topo, self.split_tie, self.executor = precision, topo, split_tie, executor
        self.full_decay = [n for n, dim in full_params if dim >= 2]
        self.full_no_decay = [n for n, dim in full_params if dim < 2]
        self.emb_fqn = "parts.0.wte.weight"
        self.head_fqn = f"parts.{n_parts - 1}.lm_head.weight"

    def _save_fqn(self, fqn: str) -> str:
        """The checkpoint key of a chunk parameter's optimizer state: the last rank's copy of the tied
        weight shares the embedding's key (their states are identical), as in a single-process run."""
        return self.emb_fqn if (self.split_tie and fqn == self.head_fqn) else fqn

    def _master_keys(self, shards, fqn: str) -> tuple[str, ...]:
        """The model keys a chunk's fp32 master slice is saved under: its own, or where the two ends of the pipeline
        step halves of the tied copy (``ChunkShards.tied_halves``), both names of the tied weight (the single-process
        state dict has both, and each end holds half of either)."""
        if shards.tied_halves and fqn in (self.emb_fqn, self.head_fqn):
            return (self.emb_fqn, self.head_fqn)
        return (fqn,)

    def _loaded_state(self, sd: dict, fqn: str) -> dict:
        """A chunk parameter's loaded optimizer state. The head's tied copy reads the embedding's entry, cloned:
        where one rank holds both copies (the V placement) two optimizers sharing its moments would step them
        twice."""
        key = self._save_fqn(fqn)
        st = sd["optim"]["state"][key]
        if key == fqn:
            return st
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}

    def _full_param_groups(self, optimizers: dict) -> list[dict]:
        """The optimizer's param_groups as the single-process engine saves them (full-model names),
        identical on every rank."""
        groups = []
        for g in optimizers[min(optimizers)].param_groups:
            decay = g["weight_decay"] > 0
            hyper = {k: v for k, v in g.items() if k != "params"}
            groups.append({**hyper, "params": list(self.full_decay if decay else self.full_no_decay)})
        return groups

    def state_dict(self, iteration: int) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        if self.steps.shards is not None:
            return self._sliced_state_dict(iteration)
        model_sd, optim_state = {}, {}
        modules, optimizers = self.steps.state_views()
        for s, c in modules.items():
            model_sd.update(get_model_state_dict(c))
            osd = get_optimizer_state_dict(c, optimizers[s])
            for fqn, st in osd["state"].items():
                optim_state[self._save_fqn(fqn)] = st
        return {
            "model": model_sd,
            "optim": {"state": optim_state, "param_groups": self._full_param_groups(optimizers)},
            "lr_scheduler": {"last_epoch": iteration},
            "scaler": self.precision.scaler.state_dict(),
        }

    def _sliced_state_dict(self, iteration: int) -> dict:
        """The distributed optimizer's state, this rank's slices only (:mod:`~foldtrain.parallel.pipeline.
        zero_pieces`): the chunks' fp32 weights as they are (every dp rank holds them whole), the fp32 masters of
        half ones and AdamW's moments as rectangles of the single-process tensors, views into the live state, so
        the same dict is what a load fills in place."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        model_sd, optim_state, steps = {}, {}, self.steps
        for s, z in sorted(steps.shards.items()):
            steps.weights_ready(s)
            chunk = steps.chunks[s]
            names = {id(p): n for n, p in chunk.named_parameters()}
            model_sd.update(get_model_state_dict(chunk))  # the fp32 weights of record
            for b in (b for b in z.buckets if b.owns_copies):  # half weights: their masters are, in slices below
                for p in b.params:
                    model_sd.pop(names[id(p)], None)
            for fqn, parts in segment_pieces(z, names).items():
                if "master" in parts:
                    for key in self._master_keys(z, fqn):
                        model_sd[key] = sharded(parts["master"], parts["part"])
                state = {"step": parts["step"][0]}
                state.update({k: sharded(parts[k], parts["part"]) for k in STATE_KEYS})
                optim_state[self._save_fqn(fqn)] = state
        hyper = {k: v for k, v in steps.optimizers[min(steps.optimizers)].param_groups[-1].items() if k != "params"}
        groups = [
            {**hyper, "weight_decay": steps.cfg.optim.weight_decay, "params": list(self.full_decay)},
            {**hyper, "weight_decay": 0.0, "params": list(self.full_no_decay)},
        ]
        return {
            "model": model_sd,
            "optim": {"state": optim_state, "param_groups": groups},
            "lr_scheduler": {"last_epoch": iteration},
            "scaler": self.precision.scaler.state_dict(),
        }

    def _load_sliced(self) -> None:
        """After DCP filled :meth:`_sliced_state_dict`'s views: every segment's step count is the loaded one, and
        the chunks' half weights take the loaded masters."""
        steps = self.steps
        for s, z in steps.shards.items():
            states = [z.optimizer.state[sg.tensor] for b in z.buckets for sg in b.segments]
            loaded = [st["step"] for st in states if st]
            for st in states:
                if st and loaded:
                    st["step"].copy_(loaded[0])
            load_masters(z, lambda w, s=s: steps.wait_collective(w, f"all-gather of chunk {s}'s loaded weights"))

    def load_state_dict(self, sd: dict) -> int:
        """Load ``sd`` into the chunks, their optimizers and schedules; returns the iteration."""
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        self.executor.reset()
        if self.steps.shards is not None:  # sd is this rank's slices, loaded in place
            self._load_sliced()
        else:
            modules, optimizers = self.steps.state_views(weights=False, moments=False)  # sd overwrites both
            for s, c in modules.items():
                keys = set(c.state_dict().keys())
                set_model_state_dict(c, {k: v for k, v in sd["model"].items() if k in keys})
                osd = get_optimizer_state_dict(c, optimizers[s])
                osd["state"] = {fqn: self._loaded_state(sd, fqn) for fqn in osd["state"]}
                set_optimizer_state_dict(c, optimizers[s], osd)
            self.steps.load_views(modules, optimizers)  # the chunks (and masters) take the loaded state
        iteration = int(sd["lr_scheduler"]["last_epoch"])
        for s, o in self.steps.optimizers.items():
            restore_lr(o, self.steps.lr_schedulers[s], self.steps.schedule, iteration)
        self.precision.scaler.load_state_dict(sd["scaler"])
        return iteration

    def full_model(self, shape: GPTShape, device: torch.device, layers) -> nn.Module | None:
        """Collective: the full fp32 model with the current weights on global rank 0, None elsewhere.

        Streamed tensor by tensor, nothing pickled: every rank turns its chunks' weights into full
        tensors (DTensors gathered over TP), and the ranks of data-parallel replica 0 and TP rank 0
        send theirs to rank 0 in chunk order; rank 0 knows every pipeline rank's keys in that order
        from the layout and receives straight into a fresh GPT. A closing barrier keeps every sender
        alive until rank 0 holds everything.
        """
        mine = []
        modules, _ = self.steps.state_views(moments=False)
        for _, c in sorted(modules.items()):
            for k, v in c.state_dict().items():
                if self.split_tie and k == self.head_fqn:
                    continue  # the last rank's copy of the tied weight: the embedding's value
                mine.append((k, v.full_tensor() if _is_dtensor(v) else v))
        topo = self.topo
        if topo.rank != 0:
            if topo.dp_rank == 0 and topo.tp_rank == 0:
                for _, v in mine:
                    collectives.send(v.detach().float().to(device).contiguous(), dst=0)
            dist.barrier()
            return None
        with torch.device("meta"):
            full = GPT(shape)
        full.to_empty(device="cpu")
        full.head.lm_head.weight = full.embedding.wte.weight
        target = full.state_dict()
        for k, v in mine:
            target[k].copy_(v.detach().float())
        ranges = part_ranges(shape.n_layer, layers)
        for p in range(1, topo.pp):
            src = topo.pipeline_peer(p)
            for s in (s for s in range(len(ranges)) if self.executor.rank_of(s) == p):
                for k in Chunk(s, [(i, full.parts[i]) for i in ranges[s]]).state_dict():
                    if self.split_tie and k == self.head_fqn:
                        continue
                    buf = torch.empty(target[k].shape, dtype=torch.float32, device=device)
                    collectives.recv(buf, src=src)
                    target[k].copy_(buf)
        dist.barrier()
        return full.to(device)
