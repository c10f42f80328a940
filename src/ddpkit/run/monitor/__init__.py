"""What a run reports: the monitor's per-rank timings, log lines, progress bar and hang watchdog
phases (monitor.py); the metrics file and its reader (metrics.py); experiment trackers (TensorBoard,
MLflow, W&B: trackers.py); the gather of a log line's values across ranks (log_gather.py); and rank
0's once-a-run notices when a loop does what one device would do differently (notices.py).
"""
