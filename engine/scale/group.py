"""A data-parallel group's process groups and every collective a job needs (DeepSpeed AutoTP inside it).

Ranks of one group share one copy of the model through DeepSpeed AutoTP (`deepspeed.init_inference(...,
replace_with_kernel_inject=False)` splits q/k/v/gate/up by heads and columns and all-reduces after
o_proj, down_proj and lm_head; the engine reads its local head counts from the weight shapes, so KV
cache, attention and compressors work on each rank's own heads). The leader reads and writes; the
others follow it in lockstep, taking its tokens and gamma (`sync`, `agree`) and its requests
(`publish` / `receive`). Not here: what a job does with them (`engine.scale.run`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import logging
import os
import sys
from typing import Any, Iterable, Iterator

from engine.errors import JobError
from engine.scale import shm_allreduce
from engine.scale.topology import Topology, local_processes

CONTROL_TIMEOUT = datetime.timedelta(days=7)  # job-level waits: one group may finish hours before another


class _ParallelUnit:
    """The `mpu` DeepSpeed's InferenceEngine asks for its tensor-parallel group.

    Passing it is how AutoTP shards within *our* group: without it init_inference builds a group of
    global ranks [0, tp), which is wrong for every data-parallel group but the first.
    """

    def __init__(self, group):
        self.group = group

    def get_model_parallel_group(self):
        return self.group.tp_group

    def get_model_parallel_world_size(self) -> int:
        return self.group.topo.tp

    def get_model_parallel_rank(self) -> int:
        return self.group.topo.rank - self.group.topo.leader

    def get_data_parallel_world_size(self) -> int:
        return self.group.topo.dp

    def get_data_parallel_rank(self) -> int:
        return self.group.topo.group


class Group:
    """This process's data-parallel group, and every collective the job needs.

    Given to `engine.job.run_job` (and the Engine) as `parallel`: `shard` the models, `sync` / `agree`
    on the leader's tokens and gamma, `keeps_row` / `share_of` / `skip_ids` pick this group's rows,
    `publish` (leader) and `receive` (the others) move requests through the group.
    """

    def __init__(self, topo: Topology, device):
        import torch.distributed as dist

        self.topo = topo
        self.tp, self.dp = topo.tp, topo.dp
        self.device = device
        self.skip_ids: frozenset[str] = frozenset()
        self.dist = dist
        backend = "nccl" if device.type == "cuda" else "gloo"
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")  # no guessing
        if topo.tp > 1:
            with _deepspeed() as deepspeed:
                if device.type == "cpu":
                    shm_allreduce.prepare(deepspeed)  # never waits on a killed build's lock file
                deepspeed.init_distributed(dist_backend=backend)
            if device.type == "cpu":  # the same on every rank, so every rank meets the barrier
                dist.barrier()  # now every rank has mapped every rank's shared-memory buffer
                shm_allreduce.release_buffer(dist.get_rank())
        else:
            dist.init_process_group(backend)
        # new_group is collective over the whole world: every rank creates every group, same order.
        # The control group (gloo, long timeout) carries the job-level messages: the outputs' state
        # at the start, the shards' reports at the end.
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self.tp_group = None
        if topo.tp > 1:
            for group in range(topo.dp):
                created = dist.new_group(topo.ranks_of(group))
                if group == topo.group:
                    self.tp_group = created
            _keep_all_reduce_in_group(topo)

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()

    # -- tensor parallel ----------------------------------------------------------------------------

    def shard(self, target, draft):
        """Split each model over the group's ranks (AutoTP); a separate draft is sharded the same way."""
        if self.tp_group is None:
            return target, draft
        return self._shard(target), (self._shard(draft) if draft is not None else None)

    def _shard(self, loaded):
        from engine.core.runner import attention_shapes

        config = {"tp_size": self.tp, "tp_group": self.tp_group, "mpu": _ParallelUnit(self)}
        with _deepspeed() as deepspeed:
            engine = deepspeed.init_inference(loaded.model, tensor_parallel=config, dtype=loaded.dtype,
                                              replace_with_kernel_inject=False)
        model = engine.module  # the same transformers model, its linear layers replaced in place
        _, heads, kv_heads, _ = attention_shapes(model)
        assert kv_heads >= 1 and heads % kv_heads == 0, \
            f"rank {self.topo.rank}: AutoTP left {heads} query heads for {kv_heads} KV heads"
        return dataclasses.replace(loaded, model=model)

    def sync(self, tensor):
        """Every rank of the group gets the leader's tensor (tokens, accepted lengths)."""
        if self.tp_group is None:
            return tensor
        tensor = tensor.contiguous()
        self.dist.broadcast(tensor, src=self.topo.leader, group=self.tp_group)  # collective: whole group
        return tensor

    def agree(self, value: int) -> int:
        """Every rank of the group gets the leader's int (the gamma it picked from its own timings)."""
        if self.tp_group is None:
            return value
        import torch

        box = torch.tensor([value], dtype=torch.long, device=self.device)
        self.dist.broadcast(box, src=self.topo.leader, group=self.tp_group)  # collective: whole group
        return int(box.item())

    # -- rows and requests ----------------------------------------------------------------------------

    def keeps_row(self, index: int) -> bool:
        return index % self.dp == self.topo.group

    def share_of(self, total: int) -> int:
        """How many of rows 0..total-1 are this group's."""
        return len(range(self.topo.group, total, self.dp))

    def publish(self, requests: Iterable) -> Iterator:
        """Leader: yield each request after handing it to the group's other ranks; then the end mark.

        The engine pulls requests at points that depend only on the requests and the (synced) tokens,
        so every rank pulls in step and each pull here meets one `receive` pull there.
        """
        if self.tp_group is None:
            yield from requests
            return
        for request in requests:
            self._broadcast_request(request)
            yield request
        self._broadcast_request(None)

    def receive(self) -> Iterator:
        """Non-leader: the leader's requests, one per pull, until its end mark."""
        while (request := self._broadcast_request(None)) is not None:
            yield request

    def _broadcast_request(self, request):
        box = [request]
        self.dist.broadcast_object_list(box, src=self.topo.leader, group=self.tp_group)  # collective: group
        return box[0]

    # -- job-level messages ---------------------------------------------------------------------------

    def announce(self, work):
        """Rank 0 runs `work()`; every rank returns its result. If it raised JobError, rank 0 re-raises
        it (one line) and the other ranks exit quietly with the same code."""
        box: list[Any] = [None]
        if self.topo.rank == 0:
            try:
                box = [("ok", work())]
            except JobError as exc:
                box = [("error", exc)]
        self.dist.broadcast_object_list(box, src=0, group=self.control)  # collective: every rank
        status, value = box[0]
        if status == "error":
            if self.topo.rank == 0:
                raise value
            raise SystemExit(2)  # rank 0 reports it
        return value

    def gather(self, value) -> list | None:
        """Every rank's `value`, in rank order, on rank 0 (None elsewhere). Waits for every group."""
        out = [None] * self.topo.world if self.topo.rank == 0 else None
        self.dist.gather_object(value, out, dst=0, group=self.control)  # collective: every rank
        return out


def _keep_all_reduce_in_group(topo: Topology) -> None:
    """DeepSpeed's CPU shared-memory all-reduce (used by the sharded layers when it is built) sums over
    every rank of the world whatever group it is given, and is only set up when all ranks share one
    machine (LOCAL_SIZE == WORLD_SIZE; otherwise it crashes). Keep it only when the tensor-parallel group
    is that whole world; else DeepSpeed falls back to torch.distributed.all_reduce on the group."""
    backend = importlib.import_module("deepspeed.comm.comm").cdb
    whole_machine = topo.tp == topo.world == local_processes(0)
    if getattr(backend, "shm_comm_op", None) is not None and not whole_machine:
        backend.shm_vector_kernel_level = 0  # DeepSpeed reads this before choosing the shm kernel


@contextlib.contextmanager
def _deepspeed():
    """DeepSpeed, imported and called with its prints and INFO logs kept off stdout (--json owns it).

    Its logger writes to the stdout of import time, so it is imported under the redirect; LOCAL_SIZE
    comes from torchrun's LOCAL_WORLD_SIZE when only that is set (DeepSpeed's CPU ops read it).
    """
    if os.environ.get("LOCAL_WORLD_SIZE") and not os.environ.get("LOCAL_SIZE"):
        os.environ["LOCAL_SIZE"] = os.environ["LOCAL_WORLD_SIZE"]
    debug = os.environ.get("MAGICDEC_DEBUG") == "1"
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed
        from deepspeed.utils import logger

        if not debug:
            logger.setLevel(logging.WARNING)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(sys.stderr if debug else devnull):
        yield deepspeed
