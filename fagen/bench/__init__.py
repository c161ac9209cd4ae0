"""Benchmarks: workloads, the peers, checking, timing, the isolating runner, reports and the tuner."""
