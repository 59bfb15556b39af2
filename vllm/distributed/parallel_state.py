# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Pipeline-parallel group state of this process, its setup, and stage-to-stage tensor transfer.

With P = 1 (no torch.distributed) the group is the trivial one. Worker processes of a P > 1 run
call init_distributed(...) before building the model.
"""

from __future__ import annotations

import pickle
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


_PP: PPGroup = PPGroup()


def get_pp_group() -> PPGroup:
    return _PP


def set_pp_group(group: PPGroup) -> None:
    global _PP
    _PP = group


def comm_timeout() -> timedelta:
    return timedelta(seconds=envs.VLLM_PP_COMM_TIMEOUT_S)


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str = "gloo",
    device: torch.device | None = None,
) -> PPGroup:
    """Join the stage group: the default group carries the stage-to-stage tensors, a second
    group the last stage's broadcasts (so they never queue behind the p2p traffic), and with
    nccl a gloo group carries the CPU-side metadata."""
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    timeout = comm_timeout()
    kwargs: dict[str, Any] = {}
    if backend == "nccl" and device is not None:
        kwargs["device_id"] = device
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        **kwargs,
    )
    ranks = list(range(world_size))
    world = dist.group.WORLD
    broadcast_group = dist.new_group(ranks, backend=backend, timeout=timeout)
    cpu_group = (
        world if backend == "gloo" else dist.new_group(ranks, backend="gloo", timeout=timeout)
    )
    group = PPGroup(
        rank=rank,
        world_size=world_size,
        device_group=world,
        broadcast_group=broadcast_group,
        cpu_group=cpu_group,
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
