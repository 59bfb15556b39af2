# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Tensor- and pipeline-parallel group state of this process, its setup, the tensor-parallel
collectives, and stage-to-stage tensor transfer.

With one worker (no torch.distributed) both groups are the trivial ones. Worker processes of a
TP x PP > 1 run call init_distributed(...) before building the model. Ranks are laid out as
vLLM does, tensor parallelism inner: rank = pp_rank * tp_size + tp_rank. Each worker is in one
TP group (the tp_size workers of its stage) and one PP group (the workers with its tp_rank,
one per stage): a stage's TP rank t sends to and receives from TP rank t of its neighbours.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from vllm import envs


@dataclass
class PPGroup:
    rank: int = 0
    world_size: int = 1
    device_group: Any = field(default=None, repr=False)  # torch.distributed group for p2p
    broadcast_group: Any = field(default=None, repr=False)  # separate group for last-stage results
    cpu_group: Any = field(default=None, repr=False)  # gloo group for metadata (= device on CPU)

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.world_size

    @property
    def last_rank(self) -> int:
        return self.world_size - 1


@dataclass
class TPGroup:
    """The tensor-parallel workers of this pipeline stage. rank / world_size are within the
    group; ranks are their global ranks (ranks[0] is the group's source of decisions)."""

    rank: int = 0
    world_size: int = 1
    ranks: tuple[int, ...] = (0,)
    device_group: Any = field(default=None, repr=False)  # all-reduce / all-gather
    cpu_group: Any = field(default=None, repr=False)  # gloo group for CPU-side broadcasts
    # Seconds spent in this group's collectives and how many (benchmarks: comm_stats).
    comm_s: float = 0.0
    num_collectives: int = 0

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the group (in place; x itself is returned)."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.device_group)
        self._count(t0)
        return x

    def _count(self, t0: float) -> None:
        self.comm_s += time.perf_counter() - t0
        self.num_collectives += 1

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along dim, in rank order."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        t0 = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.device_group)
        out = torch.cat(parts, dim=dim)
        self._count(t0)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x of group rank src on every rank (in place)."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        t0 = time.perf_counter()
        group = self.cpu_group if x.device.type == "cpu" else self.device_group
        dist.broadcast(x, src=self.ranks[src], group=group)
        self._count(t0)
        return x


_PP: PPGroup = PPGroup()
_TP: TPGroup = TPGroup()


def get_tp_group() -> TPGroup:
    return _TP


def set_tp_group(group: TPGroup) -> None:
    global _TP
    _TP = group


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _TP.all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _TP.all_gather(x, dim)


def tp_pp_ranks(rank: int, tp_size: int) -> tuple[int, int]:
    """(tp_rank, pp_rank) of a global rank (TP inner)."""
    return rank % tp_size, rank // tp_size


def get_pp_group() -> PPGroup:
    return _PP


def set_pp_group(group: PPGroup) -> None:
    global _PP
    _PP = group


def comm_timeout() -> timedelta:
    return timedelta(seconds=envs.VLLM_PP_COMM_TIMEOUT_S)


# The address gloo groups of this process bind to (see bind_gloo_to); one per process.
_GLOO_HOST: str | None = None
_BOUND_GLOO = "vllm_gloo"


def _bound_gloo(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """A gloo backend whose device listens on, and advertises, _GLOO_HOST."""
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=_GLOO_HOST)]
    return ProcessGroupGloo(store, rank, size, options)


def gloo_host() -> str | None:
    """The address this process's gloo groups were bound to (None: gloo's default)."""
    return _GLOO_HOST


def bind_gloo_to(host: str) -> str:
    """The torch.distributed backend name of gloo bound to `host` in this process.

    gloo's default device listens on the address the machine's hostname resolves to; where
    that is a loopback address (a common /etc/hosts entry) peers on other nodes cannot
    connect. Bound here, each worker listens on its own node's address and advertises it."""
    import socket

    import torch.distributed as dist

    global _GLOO_HOST
    try:
        socket.getaddrinfo(host, None)
    except OSError as e:
        raise ValueError(f"VLLM_HOST_IP / node address {host!r} does not resolve: {e}") from e
    _GLOO_HOST = host
    if not hasattr(dist.Backend, _BOUND_GLOO.upper()):
        dist.Backend.register_backend(_BOUND_GLOO, _bound_gloo, devices=["cpu"])
    return _BOUND_GLOO


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str = "gloo",
    device: torch.device | None = None,
    tensor_parallel_size: int = 1,
    host_ip: str | None = None,
) -> PPGroup:
    """Join the world of TP x PP workers and build this worker's groups. The PP group's
    device group carries the stage-to-stage tensors, a second group the last stage's
    broadcasts (so they never queue behind the p2p traffic), and with nccl a gloo group
    carries the CPU-side metadata; the TP group carries the layers' all-reduces / gathers.
    Every worker creates every group, in the same order (torch.distributed requires it).
    host_ip: the address this worker's gloo groups listen on (its node's; None: gloo's
    default, the hostname's address)."""
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    gloo = bind_gloo_to(host_ip) if host_ip else "gloo"
    tp = tensor_parallel_size
    if tp < 1 or world_size % tp:
        raise ValueError(f"world_size={world_size} is not a multiple of tensor_parallel_size={tp}")
    pp_size = world_size // tp
    tp_rank, pp_rank = tp_pp_ranks(rank, tp)
    timeout = comm_timeout()
    kwargs: dict[str, Any] = {}
    if backend == "nccl" and device is not None:
        kwargs["device_id"] = device
    dist.init_process_group(
        gloo if backend == "gloo" else backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        **kwargs,
    )
    world = dist.group.WORLD

    def new(ranks: list[int], be: str) -> Any:
        return dist.new_group(ranks, backend=gloo if be == "gloo" else be, timeout=timeout)

    # PP groups: one per tp_rank (with TP = 1 the world itself carries the p2p traffic).
    pp_groups: dict[str, Any] = {}
    for t in range(tp):
        ranks = [p * tp + t for p in range(pp_size)]
        device_group = world if tp == 1 else new(ranks, backend)
        broadcast_group = new(ranks, backend)
        cpu_group = device_group if backend == "gloo" else new(ranks, "gloo")
        if t == tp_rank:
            pp_groups = {"d": device_group, "b": broadcast_group, "c": cpu_group}
    tp_group = TPGroup()
    if tp > 1:
        for p in range(pp_size):
            ranks = [p * tp + t for t in range(tp)]
            device_group = new(ranks, backend)
            cpu_group = device_group if backend == "gloo" else new(ranks, "gloo")
            if p == pp_rank:
                tp_group = TPGroup(tp_rank, tp, tuple(ranks), device_group, cpu_group)
    set_tp_group(tp_group)
    group = PPGroup(
        rank=pp_rank,
        world_size=pp_size,
        device_group=pp_groups["d"],
        broadcast_group=pp_groups["b"],
        cpu_group=pp_groups["c"],
    )
    set_pp_group(group)
    return group


def destroy_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a dead peer must not stop our own teardown
            pass
    set_pp_group(PPGroup())
    set_tp_group(TPGroup())


# ---- stage-to-stage transfer of named tensors ---------------------------------------------

_TAG = 0


class PendingSend:
    """Posted sends of one tensor dict; holds the tensors until the transfer completes."""

    def __init__(self, works: list, tensors: list[torch.Tensor]) -> None:
        self.works = works
        self._keep = tensors

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self._keep = []


def send_tensor_dict(
    tensors: dict[str, torch.Tensor],
    dst: int,
    device_group: Any = None,
    cpu_group: Any = None,
) -> PendingSend:
    """Post (non-blocking) the metadata (keys, shapes, dtypes), then each tensor, to rank dst.

    The receiver checks the metadata against its buffers before posting its receives: gloo
    corrupts or aborts on a size mismatch, so sizes are never guessed.
    """
    pp = get_pp_group()
    device_group = device_group if device_group is not None else pp.device_group
    cpu_group = cpu_group if cpu_group is not None else (pp.cpu_group or device_group)
    items = [(k, t.contiguous()) for k, t in tensors.items()]
    meta = pickle.dumps(
        [(k, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in items]
    )
    payload = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
    header = torch.tensor([len(meta)], dtype=torch.int64)
    works = [cpu_group.send([header], dst, _TAG), cpu_group.send([payload], dst, _TAG)]
    works += [device_group.send([t], dst, _TAG) for _, t in items]
    return PendingSend(works, [header, payload] + [t for _, t in items])


def recv_tensor_dict(
    src: int,
    buffers: dict[str, torch.Tensor],
    device_group: Any = None,
    cpu_group: Any = None,
    on_metadata: Callable[[], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Receive what send_tensor_dict posted from rank src (blocking) into views of `buffers`:
    the receiving stage's persistent tensors, made once by its model's
    make_empty_intermediate_tensors. on_metadata is called once the metadata arrived (the
    sender has finished computing), for timing. Returns the views of what arrived."""
    pp = get_pp_group()
    device_group = device_group if device_group is not None else pp.device_group
    cpu_group = cpu_group if cpu_group is not None else (pp.cpu_group or device_group)
    header = torch.empty(1, dtype=torch.int64)
    cpu_group.recv([header], src, _TAG).wait()
    payload = torch.empty(int(header.item()), dtype=torch.uint8)
    cpu_group.recv([payload], src, _TAG).wait()
    meta = pickle.loads(payload.numpy().tobytes())
    if on_metadata is not None:
        on_metadata()
    out = receive_views(meta, buffers)
    works = [device_group.recv([t], src, _TAG) for t in out.values()]
    for w in works:
        w.wait()
    return out


def receive_views(
    meta: list[tuple[str, tuple[int, ...], str]], buffers: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The views of `buffers` the announced tensors (key, shape, dtype) land in. What the
    buffers cannot hold is refused, naming it, before any receive is posted: gloo corrupts or
    aborts the process on a size mismatch."""
    out: dict[str, torch.Tensor] = {}
    for key, shape, dtype in meta:
        buf = buffers.get(key)
        if buf is None:
            raise RuntimeError(
                f"the previous stage sent {key!r}, for which this stage's receive buffer (from "
                f"its model's make_empty_intermediate_tensors) has no slot: {sorted(buffers)}"
            )
        have = str(buf.dtype).removeprefix("torch.")
        if have != dtype or tuple(buf.shape[1:]) != tuple(shape[1:]) or shape[0] > buf.shape[0]:
            raise RuntimeError(
                f"the previous stage sent {key!r} as {dtype} {tuple(shape)}, which this "
                f"stage's receive buffer, {have} {tuple(buf.shape)}, cannot hold"
            )
        out[key] = buf[: shape[0]]
    return out
