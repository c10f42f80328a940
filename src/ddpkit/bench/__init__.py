"""Benchmarks behind ``ddpkit bench KIND``: each ``ddpkit.bench.KIND`` module has ``main(argv) -> int``."""
