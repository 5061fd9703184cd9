"""Where this process sits in a multi-process job: its global rank in the tp x dp grid, and whether
that layout can work (checked before any weights load).

`tp * dp` ranks; ranks `[g * tp, (g + 1) * tp)` form data-parallel group g, whose first rank is its
*leader*. Read from RANK / WORLD_SIZE (set by torchrun, DeepSpeed's launcher, or `engine.scale.launch`).
No process groups are created here (`engine.scale.group` does that).
"""

from __future__ import annotations

import dataclasses
import os

from engine.errors import JobError


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this process sits: global rank, and the tp x dp grid (groups of consecutive ranks)."""

    rank: int
    tp: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def group(self) -> int:
        return self.rank // self.tp

    @property
    def leader(self) -> int:
        """Global rank of this group's leader (tensor-parallel rank 0)."""
        return self.group * self.tp

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def ranks_of(self, group: int) -> list[int]:
        return list(range(group * self.tp, (group + 1) * self.tp))


def topology(tp: int, dp: int | None) -> Topology:
    """This process's Topology from RANK / WORLD_SIZE; dp None = world size / tp (external launcher)."""
    world = world_size()
    if dp is None:
        if world % tp:
            raise JobError(f"--tp {tp} does not divide the {world} processes the launcher started (WORLD_SIZE)")
        dp = world // tp
    if tp * dp != world:
        raise JobError(f"--tp {tp} x --dp {dp} = {tp * dp} processes, but the launcher started {world} "
                       "(WORLD_SIZE); make them equal")
    return Topology(rank=int(os.environ.get("RANK", "0") or 0), tp=tp, dp=dp)


def local_processes(default: int) -> int:
    """Processes of this job on this machine (the launchers' LOCAL_SIZE / LOCAL_WORLD_SIZE)."""
    for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        if os.environ.get(name):
            return int(os.environ[name])
    return default

def check_tensor_parallel(recipe, tp: int, dp: int, local: int) -> None:
    """One JobError line, before any weights load, if the tp x dp layout cannot work.

    Every rank must hold at least one whole KV head of every model (AutoTP splits by KV heads, also
    unevenly: 3 KV heads on 2 ranks become 2 + 1), and on CUDA each local process needs its own device.
    """
    from engine.models.loading import model_shapes, resolve_device

    models = [("model", recipe.model)]
    if recipe.draft.method != "none" and recipe.draft.model:
        models.append(("draft.model", recipe.draft.model))
    if tp > 1:
        for key, spec in models:
            kv_heads = model_shapes(spec)["kv_heads"]
            if tp > kv_heads:
                raise JobError(f"--tp {tp}: {key} {spec} has {kv_heads} KV heads and tensor parallelism gives "
                               f"every process whole KV heads; use --tp {kv_heads} or less")
    if resolve_device(recipe.device).type == "cuda":
        import torch

        count = torch.cuda.device_count()
        if local > count:
            raise JobError(f"--tp {tp} --dp {dp} puts {local} processes on this machine, one per CUDA device, "
                           f"but it has {count}")
