"""Which of torch's DDP tests ``test_torch_ddp_suite.py`` runs, and which it leaves out and why.

Kept apart from ``torch_ddp_runner.py``, whose import sets up torch's distributed test module.
"""

# The DDP tests of _DistTestBase that run on a CPU machine with gloo (the rest need GPUs, NCCL
# or MPI and skip themselves), minus EXCLUDED.
SELECTED = [
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_ddp_create_graph",
    "test_grads_same_across_ranks_with_no_sync",
]

# DDP tests that run on this machine but test DDP's private internals.
EXCLUDED = {
    "test_ddp_logging_data_cpu": (
        "sets and reads DDP's private logging record "
        "(_set_ddp_runtime_logging_sample_rate, _get_ddp_logging_data)"
    ),
    "test_static_graph_api_cpu": (
        "calls the private _set_static_graph() after training and checks that "
        "_get_ddp_logging_data recorded the error"
    ),
}
