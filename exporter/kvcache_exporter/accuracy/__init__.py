"""How often the miss attribution names the right cause: a seeded workload where every request carries
one known injected change (or none), run through the simulator or a real vLLM, and the sidecar's own
attribution compared with the truth (docs/accuracy.md). A tool: `serve` never imports it."""
