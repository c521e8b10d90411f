"""What ships beside the sidecar for people and CI: the launcher of test stacks, benchmarks, the soak."""
