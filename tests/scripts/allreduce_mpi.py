"""All-reduce with mpi4py across closbox GPUs; every rank checks the result."""
import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
total = comm.allreduce(rank + 1, op=MPI.SUM)
ok = total == size * (size + 1) // 2
data = comm.bcast(list(range(8)) if rank == 0 else None, root=0)
ok &= data == list(range(8))
print(f"rank {rank}/{size} on {MPI.Get_processor_name()}: {'ok' if ok else 'WRONG'}", flush=True)
sys.exit(0 if ok else 1)
