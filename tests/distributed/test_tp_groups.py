# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""init_distributed with TP = 2 x PP = 2 on 4 real processes (gloo): vLLM's rank layout (TP
inner), each worker's TP group and PP group, the TP collectives (all-reduce sums over the
stage only, all-gather in rank order, broadcast makes TP rank 0's value everyone's), and
stage-to-stage sends reaching the same TP rank of the next stage."""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out) -> None:
    try:
        import torch

        from vllm.distributed.parallel_state import (
            destroy_distributed,
            get_tp_group,
            init_distributed,
            recv_tensor_dict,
            send_tensor_dict,
        )

        pp = init_distributed(rank, 4, f"tcp://127.0.0.1:{port}", tensor_parallel_size=2)
        tp = get_tp_group()
        got: dict = {"tp": (tp.rank, tp.world_size, tp.ranks), "pp": (pp.rank, pp.world_size)}
        x = torch.tensor([float(rank + 1)])
        got["sum"] = float(tp.all_reduce(x.clone())[0])
        got["gather"] = tp.all_gather(torch.tensor([[float(rank)]]), dim=-1).tolist()
        got["bcast"] = int(tp.broadcast(torch.tensor([100 + rank]), src=0)[0])
        if pp.is_first_rank:
            send_tensor_dict({"h": torch.full((2, 3), float(rank))}, pp.next_rank).wait()
        else:
            buf = {"h": torch.zeros(4, 3)}
            got["recv"] = float(recv_tensor_dict(pp.prev_rank, buf)["h"][0, 0])
        destroy_distributed()
        out.put((rank, got))
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put((rank, traceback.format_exc()))


def test_tp2_pp2_groups_and_collectives():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(4)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for r, got in results.items():
        assert isinstance(got, dict), got
        tp_rank, pp_rank = r % 2, r // 2
        stage = (2 * pp_rank, 2 * pp_rank + 1)
        assert got["tp"] == (tp_rank, 2, stage)
        assert got["pp"] == (pp_rank, 2)
        assert got["sum"] == sum(s + 1 for s in stage)
        assert got["gather"] == [[float(s) for s in stage]]
        assert got["bcast"] == 100 + stage[0]
        if pp_rank == 1:
            assert got["recv"] == float(tp_rank)  # from stage 0's rank with the same tp_rank
