"""One lineage's step on several processes: data-parallel over a base model replicated on every
rank, or sharded over them with FSDP2 (`shard_base`: the frozen base only; the adapter stays whole
on each rank, so everything below holds for both).

Under `torchrun` or `accelerate launch` (WORLD_SIZE > 1) TRL's Accelerator joins the process
group when the engine is built (gloo on CPU, NCCL on GPUs). A claimed batch is one batch: its
advantages are built once over the whole claim (task groups, baselines); then each rank trains
its `shard`, and after the backward passes `average_gradients` makes every rank's LoRA gradient
the average of theirs, which, with each piece's loss scaled by `trainer/microbatch.share`, is
exactly the gradient one process would get from the whole batch (dapo's global token count
included; tests/trainer/learner/test_distributed.py checks it with 2 gloo processes). Every rank
then takes the
same optimizer step from the same weights, so the adapter stays identical everywhere.

Why not DDP's wrapper: adapters are added to the model as lineages appear (`Engine.beside`), and
DDP registers only the parameters it saw when it wrapped; it would also all-reduce every
lineage's adapter on every step. One flat all-reduce of the active adapter's gradients is DDP's
arithmetic (sum, then divide by the world) for exactly what trained.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from trainer.data.batch import Sample
from trainer.learner.correction import Correction, Tally
from trainer.learner.sft import Demo

Row = TypeVar("Row", Sample, Demo)  # what a step deals out: GRPO samples, or demonstrations

log = logging.getLogger("flywheel.trainer")


@dataclass(frozen=True)
class World:
    rank: int
    size: int

    @classmethod
    def current(cls) -> World:
        """The process group this process is in (one process alone: rank 0 of 1)."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))

    @property
    def leader(self) -> bool:
        return self.rank == 0


def join(timeout_s: float = 1800.0) -> World:
    """Join the process group the launcher describes (WORLD_SIZE > 1): NCCL on GPUs, each rank on
    its LOCAL_RANK's device; gloo on CPUs. TRL's Accelerator then uses this group. A collective
    that waits longer than `timeout_s` fails (a follower waiting for rank 0's next command, which
    rank 0 sends at least once a turn)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s))
        else:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return World.current()


def from_launcher(env: Mapping[str, str]) -> dict[str, Any]:
    """The settings an `accelerate launch` config asks for (its choices arrive as environment
    variables): FSDP2 shards the base model (`shard_base`) and its activation checkpointing is
    our gradient checkpointing. What this trainer does not do is refused, not ignored."""

    def on(name: str) -> bool:
        return env.get(name, "").lower() in ("1", "true")

    if on("ACCELERATE_USE_DEEPSPEED"):
        raise SystemExit(
            "flywheel trainer: DeepSpeed is not supported; shard the base with FSDP2 "
            "(deploy/accelerate/fsdp2.yaml) or replicate it (deploy/accelerate/ddp.yaml)"
        )
    if not on("ACCELERATE_USE_FSDP"):
        return {}
    if env.get("FSDP_VERSION", "1") != "2":
        raise SystemExit(
            "flywheel trainer: FSDP version 1 is not supported; set fsdp_version: 2 "
            "(deploy/accelerate/fsdp2.yaml)"
        )
    refused = {
        "FSDP_OFFLOAD_PARAMS": "true",  # the base's shards stay on the GPU
        "FSDP_RESHARD_AFTER_FORWARD": "false",  # the point is not holding the whole base
    }
    for name, value in refused.items():
        if env.get(name, "").lower() == value:
            raise SystemExit(f"flywheel trainer: {name}={value} is not supported with FSDP2")
    return {"shard_base": True} | (
        {"gradient_checkpointing": True} if on("FSDP_ACTIVATION_CHECKPOINTING") else {}
    )


def shard_base(model: torch.nn.Module, world: World) -> None:
    """FSDP2 over the ranks for the frozen base model: each decoder layer (the model's
    `_no_split_modules`) and then the rest hold 1/size of their weights per rank, gathered for
    the layer's forward and backward and freed after. LoRA weights are left out (`ignored_params`):
    every rank keeps the whole adapter, and `average_gradients` averages its gradients as with a
    replicated base; so saving, loading and undoing a step stay a rank's own business, and an
    adapter added later (another lineage) is an ordinary one."""
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise RuntimeError("sharding the base needs the ranks' process group (join())")
    # Rank 0 read the weights; the others built the model on the meta device (no memory). Rank 0
    # keeps its whole tensors until every rank has its shard of them.
    whole = _tensors(model) if world.leader else {}
    lora = {p for name, p in model.named_parameters() if "lora_" in name}
    mesh = _mesh(world.size)
    layers = set(getattr(model, "_no_split_modules", None) or [])
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layers (_no_split_modules)")
    for module in model.modules():
        if type(module).__name__ in layers:
            fully_shard(module, mesh=mesh, ignored_params=lora)
    fully_shard(model, mesh=mesh, ignored_params=lora)
    device = _device()
    if not world.leader:
        model.to_empty(device=device)
    _hand_out(model, whole, device)
    log.info("the base model sharded over %d ranks (FSDP2)", world.size)


def reshard(model: torch.nn.Module) -> None:
    """Every FSDP2 unit's weights back to this rank's shard. A forward pass without gradient (the
    promotion gate's scoring) leaves the root unit's weights gathered (FSDP2 frees a root's only
    after the backward pass), and rank 0 alone saving the adapter then reshards its own: the
    next step's forward on the ranks gathered different units and gloo failed ("Received data
    size doesn't match expected size")."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def base_held(model: torch.nn.Module) -> tuple[int, int]:
    """How many of the base model's weights this rank holds, of how many (sharded: its part)."""
    from torch.distributed.tensor import DTensor

    base = [p for name, p in model.named_parameters() if "lora_" not in name]
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in base)
    return held, sum(p.numel() for p in base)


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters()) | dict(model.named_buffers())


def _hand_out(model: torch.nn.Module, whole: dict[str, torch.Tensor], device: torch.device) -> None:
    """Rank 0's `whole` tensors into every rank's model, a tensor at a time: each rank keeps its
    shard of a sharded weight, all of the rest (the adapter, buffers such as rotary frequencies)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, mine in _tensors(model).items():
            if name in whole:
                t = whole[name].detach().to(device)
            else:
                t = torch.empty(mine.shape, dtype=mine.dtype, device=device)
            dist.broadcast(t, src=0)
            if isinstance(mine, DTensor):
                t = distribute_tensor(t, mine.device_mesh, mine.placements, src_data_rank=None)
            mine.copy_(t)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@functools.cache
def _mesh(size: int) -> Any:
    """The ranks as FSDP's one-dimensional mesh (one per process: engines share it)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(_device().type, (size,))


def everyone(value: Any, world: World) -> list[Any]:
    """Every rank's `value` (a small Python object), in rank order."""
    if world.size == 1:
        return [value]
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, value)
    return out


def leave() -> None:
    """Leave the process group before the process exits (gloo's threads abort it otherwise).
    Engines dropped by then are collected first: FSDP2's hooks tie a model into reference
    cycles, and tensors freed only at the interpreter's finalization can abort it."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def end(code: int = 0) -> NoReturn:
    """A worker's last act: leave the group and exit at once, skipping the interpreter's
    finalization, where a rank that sharded a base with FSDP2 sometimes aborted (SIGABRT,
    "terminate called without an active exception", after all its work was done)."""
    leave()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shard(samples: Sequence[Row], world: World) -> list[Row]:
    """This rank's rows of a batch (GRPO samples or demonstrations): longest first, dealt in
    turn (so ranks get similar token counts), topped up with ballast (a copy of a real row that
    no token of is learned from) so every rank has the same number of rows, at least one: TRL's
    gathers need equal shapes, and a rank with no rows would skip collectives its peers wait
    in."""
    if not samples:
        raise ValueError("an empty batch has nothing to shard")
    order = sorted(
        range(len(samples)),
        key=lambda i: -(len(samples[i].prompt_ids) + len(samples[i].completion_ids)),
    )
    mine = [samples[i] for i in order[world.rank :: world.size]]
    rows = -(-len(samples) // world.size)
    ballast = dataclasses.replace(samples[order[-1]], ballast=True)  # the shortest row
    return mine + [ballast] * (rows - len(mine))


def average_gradients(params: Sequence[torch.nn.Parameter], world: World) -> None:
    """Every rank's gradients of `params` (the same parameters in the same order on every rank)
    replaced by their average over the ranks, in one all-reduce."""
    if world.size == 1 or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = parameters_to_vector(grads)
    dist.all_reduce(flat)  # a sum: gloo has no average
    flat /= world.size
    for p, part in zip(params, _split(flat, params), strict=True):
        p.grad = part.clone()


def average(value: float, world: World, device: torch.device) -> float:
    """A number's mean over the ranks (a step's loss: each rank's is its shard's part)."""
    if world.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / world.size


def broadcast_parameters(params: Sequence[torch.nn.Parameter], world: World) -> None:
    """Rank 0's values of `params` on every rank (a new adapter starts the same everywhere)."""
    if world.size == 1 or not params:
        return
    with torch.no_grad():
        flat = parameters_to_vector(params)
        dist.broadcast(flat, src=0)
        for p, part in zip(params, _split(flat, params), strict=True):
            p.copy_(part)


def _split(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`flat` (a `parameters_to_vector` of tensors shaped as `like`) cut back into their shapes."""
    parts = torch.split(flat, [t.numel() for t in like])
    return [part.view_as(t) for part, t in zip(parts, like, strict=True)]


def gather_correction(mine: Correction, world: World) -> Correction:
    """The step's correction report over every rank's shard (each rank saw only its own): token
    tallies summed, the ratio range widened, the mean weight over all kept tokens."""
    if world.size == 1:
        return mine
    kept = int(mine.keep_BT.sum())
    summary = (mine.by_staleness, mine.ratio_min, mine.ratio_max, mine.weight_mean, kept)
    theirs: list[Any] = [None] * world.size
    dist.all_gather_object(theirs, summary)
    out = Correction(weights_BT=mine.weights_BT, keep_BT=mine.keep_BT)
    for by_staleness, _, _, _, _ in theirs:
        for bucket, tally in by_staleness.items():
            total = out.by_staleness.setdefault(bucket, Tally())
            total.tokens += tally.tokens
            total.truncated += tally.truncated
            total.rejected += tally.rejected
    out.ratio_min = min(t[1] for t in theirs)
    out.ratio_max = max(t[2] for t in theirs)
    kept_all = sum(t[4] for t in theirs)
    out.weight_mean = sum(t[3] * t[4] for t in theirs) / kept_all if kept_all else 1.0
    return out
