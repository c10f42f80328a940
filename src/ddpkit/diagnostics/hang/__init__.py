"""Hang diagnostics: when a collective does not complete in time, name the ranks that have not
reached it and show where every rank is.

One record of a rank's progress and one attribution over the records (``record.py``), filled by
two collectors: inside each rank of a ``ddpkit.Run`` or the Trainer, a watchdog thread
(``watchdog.py``, with ``desync.py`` for ranks waiting in different collectives and ``stacks.py``
for the stack it shows); outside, for scripts that know nothing of ddpkit, the launcher's monitor
(``monitor.py``), which reads its workers (``workers.py``) from what each worker's boot hook
writes (``boot_progress.py``, standard library only, also the one place torch's private state is
read). The collectors talk through one store conversation (``exchange.py``) and write one report
(``report.py``); every timing is in ``timings.py``. Nothing is imported here, so the launcher,
which imports ``monitor.py``, never loads the watchdog.

Files written (``RUN_DIR`` is the launcher's run folder, ``ddpkit-run-PID-*`` under ``TMPDIR``
(``launch/workerenv.py``), removed after the launch but for its reports):

    RUN_DIR/progress-RANK      a worker's collective count, group timeout and pid, one fixed-size
                               line rewritten when it changes (``boot_progress.py``).
    RUN_DIR/stacks-RANK.txt    faulthandler's dump of a worker's threads, appended at each
                               ``boot_progress.STACK_SIGNAL`` from its launcher
                               (``workers.dump_stacks``).
    RUN_DIR/exit-RANK.txt      the same dump when the agent stops the worker with SIGTERM (read by
                               ``launch/failures.write_exit_stacks``).
    RUN_DIR/hang-report.txt    the launcher's report (``monitor.py``).
    OUT/hang-report.txt        a watchdog's report, in the run's folder (``report_path``); both
                               reports are written as ``NAME.tmpPID`` and renamed.

The monitor deletes the first three before each round (and the files the launcher names to it:
a worker's ``config-error-RANK``).

Environment variables, set by the launcher for its workers (``launch/workerenv.py``) and read by
their boot hook (``launch/workerboot/sitecustomize.py``):

    DDPKIT_RUN_DIR        where the files above go.
    DDPKIT_PROGRESS_S     how often a worker looks at its collective count; 0: not at all
                          (``ddpkit run --collective-timeout 0``).
    DDPKIT_AGENT_PID      marks the launcher's own workers (the boot hook takes it out of the
                          environment so that their children are not taken for workers).

Read besides, never set: ``RANK`` (which files a worker writes) and ``WORLD_SIZE`` (written into
``progress-RANK``), both torch's.
"""
