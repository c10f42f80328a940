"""The gradient-synchronization engine: Bucket, Reducer, DataParallel, and compression hooks."""

from ddpkit.parallel.bucket import FIRST_BUCKET_BYTES, Bucket, assign_buckets
from ddpkit.parallel.compression import COMPRESSIONS, CastHook, PrescaledAllReduce, allreduce_hook, make_hook
from ddpkit.parallel.data_parallel import DataParallel
from ddpkit.parallel.powersgd import PowerSGD
from ddpkit.parallel.reducer import Reducer

__all__ = [
    "COMPRESSIONS",
    "FIRST_BUCKET_BYTES",
    "Bucket",
    "CastHook",
    "DataParallel",
    "PowerSGD",
    "PrescaledAllReduce",
    "Reducer",
    "allreduce_hook",
    "assign_buckets",
    "make_hook",
]
