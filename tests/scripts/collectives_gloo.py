"""Every collective torch.distributed's gloo backend offers, across all ranks of a closbox job.

Run under `closbox run` (it sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
GLOO_SOCKET_IFNAME). Each rank checks every result against what it must be and prints one
line per collective ("ok" or what was wrong); exits non-zero if anything was wrong.
"""
import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    wrong = []

    def check(name, got, want):
        if not torch.equal(got, want):
            wrong.append(name)
            print(f"rank {rank}: {name} gave {got.tolist()[:8]}, want {want.tolist()[:8]}")

    # all_reduce: sum and max of per-rank values, 64 Ki elements (several packets).
    n = 1 << 16
    t = torch.full((n,), float(rank + 1))
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    check("all_reduce(sum)", t, torch.full((n,), world * (world + 1) / 2))
    t = torch.arange(n, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    check("all_reduce(max)", t, torch.arange(n, dtype=torch.float32) * world)

    # broadcast from the last rank.
    src = world - 1
    b = torch.arange(1000, dtype=torch.float32) * 3 if rank == src else torch.zeros(1000)
    dist.broadcast(b, src=src)
    check("broadcast", b, torch.arange(1000, dtype=torch.float32) * 3)

    # all_gather: rank r contributes [r, r*10].
    mine = torch.tensor([rank, rank * 10], dtype=torch.int64)
    out = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(out, mine)
    check("all_gather", torch.stack(out), torch.tensor([[r, r * 10] for r in range(world)]))

    # gather to rank 0.
    g = [torch.zeros(2, dtype=torch.int64) for _ in range(world)] if rank == 0 else None
    dist.gather(mine, gather_list=g, dst=0)
    if rank == 0:
        check("gather", torch.stack(g), torch.tensor([[r, r * 10] for r in range(world)]))

    # scatter from rank 1: rank r receives [r + 100] * 4.
    s = torch.zeros(4, dtype=torch.int64)
    chunks = [torch.full((4,), r + 100, dtype=torch.int64) for r in range(world)]
    dist.scatter(s, scatter_list=chunks if rank == 1 else None, src=1)
    check("scatter", s, torch.full((4,), rank + 100, dtype=torch.int64))

    # all_to_all_single: rank r sends r*1000 + d to rank d (one element each).
    send = torch.tensor([rank * 1000 + d for d in range(world)], dtype=torch.int64)
    recv = torch.zeros(world, dtype=torch.int64)
    dist.all_to_all_single(recv, send)
    check("all_to_all_single", recv, torch.tensor([r * 1000 + rank for r in range(world)]))

    dist.barrier()
    print(f"rank {rank}/{world} on {os.uname().nodename}: "
          + ("ok" if not wrong else "WRONG: " + ", ".join(wrong)))
    dist.destroy_process_group()
    return 0 if not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
