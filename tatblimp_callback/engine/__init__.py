"""The scoring engine: row layouts, forward passes, the tiled head, memory, devices, processes."""
