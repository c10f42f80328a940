"""The launch's environment and run folder: set for the launch, gone after it, swept when orphaned."""

from __future__ import annotations

import os
import tempfile

from ddpkit.launch.workerenv import _sweep_orphaned, environment, run_directory, worker_variables


def test_variables_are_restored_and_a_users_omp_num_threads_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    values = worker_variables(tmp_path, nproc=2, progress_s=1.0)
    assert "OMP_NUM_THREADS" not in values and values["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    monkeypatch.delenv("OMP_NUM_THREADS")
    before = dict(os.environ)
    with environment(worker_variables(tmp_path, nproc=2, progress_s=0.0)):
        assert os.environ["DDPKIT_AGENT_PID"] == str(os.getpid()) and "OMP_NUM_THREADS" in os.environ
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM"  # as torch's launch_agent does
    assert dict(os.environ) == before


def test_run_folders_of_dead_launchers_are_swept_unless_they_hold_a_report(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # what TMPDIR sets in a new process
    dead = 2**22 + 1  # above the kernel's default pid_max: no such process
    for name in (f"ddpkit-run-{dead}-a", f"ddpkit-run-{dead}-b", f"ddpkit-run-{os.getpid()}-c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "progress-0").write_text("")
    (tmp_path / f"ddpkit-run-{dead}-b" / "hang-report.txt").write_text("report")
    _sweep_orphaned(tmp_path)
    kept = {f"ddpkit-run-{dead}-b", f"ddpkit-run-{os.getpid()}-c"}
    assert {p.name for p in tmp_path.iterdir()} == kept
    with run_directory() as run_dir:
        assert run_dir.parent == tmp_path and run_dir.name.startswith(f"ddpkit-run-{os.getpid()}-")
    assert not run_dir.exists()
