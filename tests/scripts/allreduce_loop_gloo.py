"""All-reduce in a loop with torch.distributed (gloo) for SECONDS seconds, with gloo's own
timeout set to TIMEOUT seconds: under a partition the job must fail within that timeout,
naming what it lost; healthy, every rank prints how many all-reduces it checked.

Usage (under `closbox run`): allreduce_loop_gloo.py SECONDS TIMEOUT
"""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    seconds, timeout = float(sys.argv[1]), float(sys.argv[2])
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        init_method="env://",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )
    want = world * (world + 1) / 2
    done = 0
    end = time.monotonic() + seconds
    while True:
        t = torch.full((1 << 14,), float(rank + 1), dtype=torch.float32)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        if not torch.all(t == want):
            print(f"rank {rank}: wrong result {t[0].item()}, want {want}")
            return 1
        done += 1
        # Stop together: a rank that left while others started another all-reduce would
        # close their connections under them.
        stop = torch.tensor([1.0 if time.monotonic() >= end else 0.0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item() > 0:
            break
    print(f"rank {rank}: {done} all-reduces ok", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
