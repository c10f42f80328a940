"""The gradient-synchronization engine: Bucket, Reducer, DataParallel, and communication hooks."""

from ddpkit.parallel.bucket import FIRST_BUCKET_BYTES, Bucket, assign_buckets
from ddpkit.parallel.compression import COMPRESSIONS, CastHook, PrescaledAllReduce, allreduce_hook, make_hook
from ddpkit.parallel.data_parallel import DataParallel
from ddpkit.parallel.errors import DataParallelError
from ddpkit.parallel.powersgd import PowerSGD
from ddpkit.parallel.reducer import Reducer
from ddpkit.parallel.torch_hooks import GradBucket, TorchCommHook

__all__ = [
    "COMPRESSIONS",
    "FIRST_BUCKET_BYTES",
    "Bucket",
    "CastHook",
    "DataParallel",
    "DataParallelError",
    "GradBucket",
    "PowerSGD",
    "PrescaledAllReduce",
    "Reducer",
    "TorchCommHook",
    "allreduce_hook",
    "assign_buckets",
    "make_hook",
]
