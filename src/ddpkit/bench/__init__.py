"""Benchmarks behind ``ddpkit bench KIND``: each has a module here with ``main(argv) -> int``
(``ddpkit.cli.BENCHMARKS`` names them: ``engine_bench``, ``comm``, ``scaling``, ``trainer_bench``)."""
