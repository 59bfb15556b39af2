# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Ray across nodes, on a real multi-node Ray cluster started here (ray.cluster_utils.Cluster:
a head node without CPUs and two worker nodes of 2 CPUs, each with its own resource label):
PP = 2 and TP = 2 x PP = 2 with MTP spread over the nodes (one stage per node, a stage's TP
ranks on one node), checked rank by rank, with the greedy tokens and spec-decode counts of one
worker; DP = 2 on Ray (one actor per replica, its workers in its own placement group) equal to
DP = 1; a placement the cluster cannot hold is refused naming the stage; nothing of the engine
is left on the cluster after shutdown."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from tests.e2e.test_spec_decode_pp import deepseek_v3_mtp2_4l_dir  # noqa: F401 - fixture
from vllm import LLM, SamplingParams
from vllm.testing.engine_utils import make_prompts, spec_decode_counts

ray = pytest.importorskip("ray")

LENGTHS = [21, 6, 34]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
COMMON = dict(dtype="float32", max_model_len=128, max_num_seqs=4, disable_log_stats=False)
SPEC = {"method": "mtp", "adaptive_num_speculative_tokens": False, "num_speculative_tokens": 2}
NODE_LABELS = ("node_a", "node_b")


class NodeLabels(dict):
    """The cluster's node id -> label, and its address."""

    address = ""


@pytest.fixture(scope="module")
def cluster():
    """Two simulated worker nodes (2 CPUs each, resource `node_a` / `node_b`) behind a head
    without CPUs; this process is the cluster's driver. Yields node id -> label."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for label in NODE_LABELS:
            c.add_node(num_cpus=2, resources={label: 1.0})
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)
        labels = NodeLabels()
        labels.address = c.address
        for n in ray.nodes():
            for label in NODE_LABELS:
                if label in n["Resources"]:
                    labels[n["NodeID"]] = label
        assert sorted(labels.values()) == sorted(NODE_LABELS)
        yield labels
    finally:
        ray.shutdown()
        c.shutdown()


def _alive_actors() -> list[str]:
    """Class names of the cluster's live actors (the GCS's table: no dashboard needed)."""
    from ray._private import state

    return [a["ActorClassName"] for a in state.actors().values() if a["State"] == "ALIVE"]


def _held_cpus() -> float:
    """CPUs the cluster's actors and placement groups hold, once Ray has freed what ended
    (freeing is asynchronous: polled for up to 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        held = ray.cluster_resources().get("CPU", 0.0) - ray.available_resources().get("CPU", 0.0)
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def _gen(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def mtp_reference(deepseek_v3_mtp2_4l_dir):  # noqa: F811
    """One in-process worker: tokens and spec-decode counts."""
    prompts = make_prompts(512, LENGTHS, seed=11)
    llm = LLM(model=deepseek_v3_mtp2_4l_dir, speculative_config=SPEC, **COMMON)
    try:
        return prompts, _gen(llm, prompts), spec_decode_counts(llm)
    finally:
        llm.shutdown()


def _check_gone(pids: list[int]) -> None:
    procs = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    _, alive = psutil.wait_procs(procs, timeout=30)
    assert not alive, f"worker processes still running after shutdown: {alive}"
    assert not _alive_actors(), "Ray actors left after shutdown"
    assert _held_cpus() == 0, "placement groups or actors still hold CPUs after shutdown"


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)], ids=["pp2", "tp2-pp2"])
def test_mtp_spread_over_nodes_equals_one_worker(
    cluster,
    mtp_reference,
    deepseek_v3_mtp2_4l_dir,  # noqa: F811
    monkeypatch,
    tp,
    pp,
):
    prompts, ref_tokens, ref_counts = mtp_reference
    # Each stage's bundle needs 2 CPUs, so no node holds two stages: PACK spreads them.
    monkeypatch.setenv("VLLM_RAY_PER_WORKER_CPUS", str(2 // tp))
    llm = LLM(
        model=deepseek_v3_mtp2_4l_dir,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="ray",
        speculative_config=SPEC,
        **COMMON,
    )
    try:
        ex = llm.llm_engine.executor
        pids = list(ex.worker_pids)
        assert os.getpid() not in pids
        nodes = [cluster[p["node_id"]] for p in ex.placement]
        stage_nodes = [set(nodes[s * tp : (s + 1) * tp]) for s in range(pp)]
        # A stage's TP ranks on one node; the two stages on the two nodes.
        assert all(len(s) == 1 for s in stage_nodes), nodes
        assert set.union(*stage_nodes) == set(NODE_LABELS), nodes
        # Each worker's collectives listen on its own node's address.
        assert [p["node_ip"] for p in ex.placement] == [p["gloo_host"] for p in ex.placement]
        assert _gen(llm, prompts) == ref_tokens
        assert spec_decode_counts(llm) == ref_counts
        assert ref_counts[0] > 0
    finally:
        llm.shutdown()
    _check_gone(pids)


def test_dp2_on_ray_equals_dp1(cluster, llama_dir):
    prompts = make_prompts(512, [5, 17, 9, 30, 12, 3, 22, 8], seed=3)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    # Unseeded sampling draws from the engine's seed in request order: equal too.
    unseeded = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = []
    llm = LLM(model=llama_dir, **COMMON)
    try:
        for params in (GREEDY, seeded, unseeded):
            want.append(_gen(llm, prompts, params))
    finally:
        llm.shutdown()
    llm = LLM(model=llama_dir, data_parallel_size=2, data_parallel_backend="ray", **COMMON)
    try:
        engine = llm.llm_engine
        pids = [p for ps in engine.worker_pids().values() for p in ps]
        assert len(set(pids)) == 2 and os.getpid() not in pids
        assert all(r.info["node_id"] in cluster for r in engine.replicas)
        for params, w in zip((GREEDY, seeded, unseeded), want):
            assert _gen(llm, prompts, params) == w
        per_engine = {
            m.labels["engine"]: m.value
            for m in llm.get_metrics()
            if m.name == "vllm:generation_tokens" and "engine" in m.labels
        }
        # Both replicas served (fewest outstanding tokens), and the sums add up.
        assert set(per_engine) == {"0", "1"} and min(per_engine.values()) > 0
        assert sum(per_engine.values()) == 3 * len(prompts) * MAX_TOKENS
        # Replica 1's actor (its worker: one per replica here) stopped, then killed, before
        # its requests produce anything: they are retried on replica 0, same tokens.
        victim = psutil.Process(engine.replicas[1].info["pid"])
        victim.suspend()
        ids = []
        for p in prompts:
            rid = engine.next_request_id()
            engine.add_request(rid, {"prompt_token_ids": p}, seeded)
            ids.append(rid)
        assert any(engine._requests[rid].replica == 1 for rid in ids)
        victim.kill()
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        assert [done[rid] for rid in ids] == want[1]
        status = engine.replica_status()
        assert [s["alive"] for s in status] == [True, False], status
        assert "died" in status[1]["error"]
    finally:
        llm.shutdown()
    _check_gone(pids)


def test_placement_the_cluster_cannot_hold_is_refused(cluster, llama_dir, monkeypatch):
    # The engine joins the existing cluster through RAY_ADDRESS (as after `ray start`).
    ray.shutdown()
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    # A stage of 3 CPUs: no node has that many (the error lists the cluster's 2-CPU nodes).
    monkeypatch.setenv("VLLM_RAY_PER_WORKER_CPUS", "3")
    with pytest.raises(ValueError, match="pipeline stage 0.*no node of the cluster.*CPU 2"):
        LLM(
            model=llama_dir,
            pipeline_parallel_size=2,
            distributed_executor_backend="ray",
            **COMMON,
        )
    monkeypatch.setenv("VLLM_RAY_PER_WORKER_CPUS", "2")
    # Three stages of 2 CPUs: each fits a node, together more than the nodes hold.
    with pytest.raises(ValueError, match="Ray cannot place 3 pipeline stages"):
        LLM(
            model=llama_dir,
            pipeline_parallel_size=3,
            distributed_executor_backend="ray",
            **COMMON,
        )
    assert ray.is_initialized()  # joined, not started: still connected to the cluster
    assert {n["NodeID"] for n in ray.nodes() if n["Alive"]} >= set(cluster)
    assert not _alive_actors()
