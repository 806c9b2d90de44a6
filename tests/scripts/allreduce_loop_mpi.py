"""All-reduces with mpi4py in a loop for SECONDS (argv[1]), checking each result; every rank
prints how many it did. Ranks agree on when to stop (rank 0 decides), so none leaves
while the others are mid-operation."""
import sys
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
seconds = float(sys.argv[1])
start = time.monotonic()
done = 0
while True:
    go = comm.bcast(time.monotonic() - start < seconds if rank == 0 else None, root=0)
    if not go:
        break
    total = comm.allreduce(rank + 1, op=MPI.SUM)
    if total != size * (size + 1) // 2:
        print(f"rank {rank}: WRONG sum {total}", flush=True)
        sys.exit(1)
    done += 1
    if done % 50 == 0:
        print(f"rank {rank}: {done} all-reduces", flush=True)
print(f"rank {rank}/{size}: {done} all-reduces ok", flush=True)
