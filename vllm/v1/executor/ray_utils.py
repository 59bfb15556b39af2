# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Ray placement shared by the Ray executor and the data-parallel front end.

One placement group per engine replica, one bundle per pipeline stage holding that stage's
tensor_parallel_size workers (VLLM_RAY_PER_WORKER_CPUS CPUs each, and a GPU each on CUDA):
a bundle always lands on one node, so a stage's TP ranks - whose all-reduces run every layer -
share a node, while stages, which exchange one activation per step, may spread over nodes.
The PACK strategy uses as few nodes as fit (vLLM's rule: TP within a node, PP across nodes).
A placement no node set could ever hold fails at once, naming what is missing; one the
cluster could hold but whose resources are taken fails after VLLM_RAY_PLACEMENT_TIMEOUT_S.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from vllm import envs
from vllm.config import ParallelConfig
from vllm.logger import init_logger

logger = init_logger(__name__)

Bundle = dict[str, float]


def ensure_ray(num_cpus: float) -> bool:
    """Connect to Ray: the one already initialised in this process, else RAY_ADDRESS's
    cluster ('auto': the one `ray start --head` started here), else a local Ray with
    num_cpus CPUs. Returns whether this call started a local Ray (the caller stops it)."""
    import ray

    if ray.is_initialized():
        return False
    address = envs.RAY_ADDRESS
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    ray.init(num_cpus=max(1, int(-(-num_cpus // 1))), include_dashboard=False, log_to_driver=True)
    return True


def per_worker_cpus() -> float:
    return envs.VLLM_RAY_PER_WORKER_CPUS


def stage_bundles(pc: ParallelConfig, use_gpu: bool) -> list[Bundle]:
    """One bundle per pipeline stage: its TP workers' CPUs (and GPUs)."""
    bundle: Bundle = {"CPU": pc.tensor_parallel_size * per_worker_cpus()}
    if use_gpu:
        bundle["GPU"] = float(pc.tensor_parallel_size)
    return [dict(bundle) for _ in range(pc.pipeline_parallel_size)]


def _fmt(res: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(res.items()) if k in ("CPU", "GPU")) or "-"


def _nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def describe_nodes() -> str:
    return "; ".join(f"{n['NodeManagerAddress']}: {_fmt(n['Resources'])}" for n in _nodes())


def _fits(bundle: Bundle, free: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items() if v > 0)


def check_placement_feasible(groups: list[tuple[str, list[Bundle]]]) -> None:
    """Refuse at once what no set of the cluster's nodes could hold, even empty: a bundle
    larger than every node, or all bundles together more than the nodes pack (first fit,
    largest first). groups: (what the bundles place, e.g. "replica 0", its bundles)."""
    nodes = _nodes()
    totals = [dict(n["Resources"]) for n in nodes]
    for what, bundles in groups:
        for i, b in enumerate(bundles):
            if not any(_fits(b, t) for t in totals):
                raise ValueError(
                    f"Ray cannot place {what}'s pipeline stage {i}: it needs {_fmt(b)} on one "
                    f"node (its tensor-parallel workers share a node) and no node of the "
                    f"cluster has that ({describe_nodes()}). Add a larger node, or lower "
                    "tensor_parallel_size or VLLM_RAY_PER_WORKER_CPUS."
                )
    flat = [(what, i, b) for what, bundles in groups for i, b in enumerate(bundles)]
    flat.sort(key=lambda x: (-x[2].get("GPU", 0.0), -x[2].get("CPU", 0.0)))
    free = [dict(t) for t in totals]
    for what, i, b in flat:
        for f in free:
            if _fits(b, f):
                for k, v in b.items():
                    f[k] = f.get(k, 0.0) - v
                break
        else:
            need: dict[str, float] = {}
            for _, _, bb in flat:
                for k, v in bb.items():
                    need[k] = need.get(k, 0.0) + v
            raise ValueError(
                f"Ray cannot place {len(flat)} pipeline stages ({_fmt(need)} in all, one "
                f"stage's workers per node at most): the cluster's nodes hold "
                f"{describe_nodes()}; {what}'s stage {i} is left without a node. Add nodes, or "
                "lower data_parallel_size, pipeline_parallel_size or VLLM_RAY_PER_WORKER_CPUS."
            )


def create_placement_group(bundles: list[Bundle], what: str) -> Any:
    """A PACK placement group of these bundles, ready; a clear error when Ray cannot place it
    within VLLM_RAY_PLACEMENT_TIMEOUT_S (the caller checked it is feasible at all)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy="PACK")
    timeout = envs.VLLM_RAY_PLACEMENT_TIMEOUT_S
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(
            f"Ray could not place {what} ({len(bundles)} stage bundles of "
            f"{_fmt(bundles[0])}) within {timeout:.0f} s (VLLM_RAY_PLACEMENT_TIMEOUT_S): the "
            f"cluster could hold it, but its resources are taken (available now: "
            f"{_fmt(ray.available_resources())}; nodes: {describe_nodes()})"
        ) from None
    return pg


def bundle_nodes(pg: Any) -> list[str]:
    """The node id each bundle of a ready placement group was placed on."""
    from ray.util import placement_group_table

    table = placement_group_table(pg)
    by_index = table.get("bundles_to_node_id", {})
    return [by_index.get(i, "") for i in range(len(pg.bundle_specs))]


def host_key() -> str:
    """Identity of the physical machine this process runs on: Ray nodes simulated on one
    machine share it (and so its cores), real nodes do not."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def node_ip() -> str:
    """This Ray worker's node IP (what its collectives bind to)."""
    import ray

    return ray.util.get_node_ip_address()


def placement_info() -> dict[str, Any]:
    """Where the calling Ray actor runs: node IP and id, pid, physical host."""
    import ray

    return {
        "node_ip": node_ip(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
        "host": host_key(),
    }
