"""`kvcache-exporter analyze`: replay a prompt trace through the simulator's cache model, explain misses."""
