"""Point-to-point and collective communication, every result checked (PyTorch's dist_tuto walkthrough).

    ddpkit run --nproc 2 examples/collectives.py      # any --nproc works; 1 skips point-to-point

Each rank r starts from the value r + 1, so every expected result has a closed form.
"""

import math

import torch
import torch.distributed as dist
from torch.testing import assert_close

import ddpkit


def point_to_point(rank: int, world_size: int, device: torch.device) -> None:
    """Pass each rank's value to the next rank around a ring, blocking and then non-blocking."""
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    mine, got = torch.tensor([rank + 1.0], device=device), torch.zeros(1, device=device)
    # send/recv block until the peer takes part. Even ranks send first and odd ranks receive
    # first, so the ring never has every rank stuck in send at once.
    if rank % 2 == 0:
        dist.send(mine, dst=nxt)
        dist.recv(got, src=prv)
    else:
        dist.recv(got, src=prv)
        dist.send(mine, dst=nxt)
    assert_close(got, torch.tensor([prv + 1.0], device=device))

    # isend/irecv return at once with a work handle; ``got`` must not be read before wait().
    got = torch.zeros(1, device=device)
    for work in [dist.isend(mine, dst=nxt), dist.irecv(got, src=prv)]:
        work.wait()
    assert_close(got, torch.tensor([prv + 1.0], device=device))


def collectives(rank: int, n: int, device: torch.device) -> None:
    """broadcast, scatter, gather, reduce, all_reduce with each op, and all_gather."""
    every = torch.arange(1.0, n + 1, device=device)  # (n,): every rank's value, in rank order

    def mine() -> torch.Tensor:  # a fresh copy each time: collectives overwrite their input
        return torch.tensor([rank + 1.0], device=device)

    t = mine()
    dist.broadcast(t, src=0)  # everyone gets rank 0's value
    assert_close(t, every[:1])

    t = torch.zeros(1, device=device)
    dist.scatter(t, list(every.chunk(n)) if rank == 0 else None, src=0)  # rank i gets piece i
    assert_close(t, mine())

    slots = [torch.zeros(1, device=device) for _ in range(n)] if rank == 0 else None
    dist.gather(mine(), slots, dst=0)  # rank 0 collects one value per rank
    if rank == 0:
        assert_close(torch.cat(slots), every)

    t = mine()
    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)  # only rank 0's result is defined
    if rank == 0:
        assert_close(t, every.sum().view(1))

    expected = {
        dist.ReduceOp.SUM: n * (n + 1) / 2,
        dist.ReduceOp.PRODUCT: math.factorial(n),
        dist.ReduceOp.MAX: n,
        dist.ReduceOp.MIN: 1,
    }
    for op, value in expected.items():
        t = mine()
        dist.all_reduce(t, op=op)  # every rank gets the reduction
        assert_close(t, torch.tensor([float(value)], device=device), msg=f"all_reduce {op}")

    slots = [torch.zeros(1, device=device) for _ in range(n)]
    dist.all_gather(slots, mine())  # every rank collects one value per rank
    assert_close(torch.cat(slots), every)


def main() -> None:
    env = ddpkit.init_distributed()
    try:
        if env.world_size > 1:
            point_to_point(env.rank, env.world_size, env.device)
        collectives(env.rank, env.world_size, env.device)
        dist.barrier()  # report only once every rank has passed its checks
        if env.is_rank0:
            print(f"collectives: every result checked on {env.world_size} ranks ({env.backend})")
    finally:
        ddpkit.destroy()


if __name__ == "__main__":
    main()
