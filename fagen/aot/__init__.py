"""Ahead of time: Triton and nvcc compiles for explicit archs, parallel builds, and build directories."""
