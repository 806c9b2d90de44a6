"""All-reduce with torch.distributed (gloo) across closbox GPUs; every rank checks the result.

Run under `closbox run`, which sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
GLOO_SOCKET_IFNAME. Exits non-zero on a wrong result.
"""
import os
import sys

import torch
import torch.distributed as dist


def say(line: str) -> None:
    """One write(2) per line: workers that share a pipe (torchrun's two per GPU) would
    otherwise interleave, since an unbuffered print writes its text and its newline apart."""
    os.write(1, (line + "\n").encode())


def main() -> int:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    ok = True
    for n in (1, 1000, 1 << 18):
        t = torch.full((n,), float(rank + 1), dtype=torch.float32)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        want = world * (world + 1) / 2
        if not torch.all(t == want):
            say(f"rank {rank}: all_reduce of {n} floats gave {t[0].item()}, want {want}")
            ok = False
    b = torch.arange(8, dtype=torch.float32) if rank == 0 else torch.zeros(8)
    dist.broadcast(b, src=0)
    ok &= bool(torch.all(b == torch.arange(8, dtype=torch.float32)))
    dist.barrier()
    say(f"rank {rank}/{world} on {os.uname().nodename}: {'ok' if ok else 'WRONG'}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
