"""An unmodified torch.distributed program timing itself, for `closbox run --fabric-clock`.

Prints, per rank: its own timing of a 16 MiB all_reduce (mean of 3, after one warm-up) by
time.perf_counter, how long a 0.5 ms threading.Event wait and a 0.2 s time.sleep took in
wall time (read from /proc/uptime, which no clock library dilates).
"""
import os
import threading
import time

import torch
import torch.distributed as dist


def wall() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


dist.init_process_group("gloo", init_method="env://")
rank = dist.get_rank()
x = torch.ones(4 << 20)
dist.all_reduce(x)
assert torch.all(x == dist.get_world_size()), "wrong all_reduce result"
dist.barrier()
t = time.perf_counter()
for _ in range(3):
    dist.all_reduce(x)
took = (time.perf_counter() - t) / 3
w = wall()
threading.Event().wait(0.0005)
waited = wall() - w
w = wall()
time.sleep(0.2)
slept = wall() - w
print(f"rank {rank}: allreduce_us={took * 1e6:.1f} wait_wall_s={waited:.2f} sleep_wall_s={slept:.2f}")
dist.destroy_process_group()
