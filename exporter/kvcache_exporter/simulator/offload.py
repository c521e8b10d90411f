"""A CPU offload tier after vLLM 0.33's OffloadingConnector (`vllm/distributed/kv_transfer/kv_connector/v1/
offloading/`, `vllm/v1/kv_offload/cpu/`): CPU offload cannot run on vLLM's CPU backend, so its events and
metrics here are built from that code, not captured.

Every block the GPU caches is stored to the tier (GPU -> CPU); the tier evicts least recently used blocks.
A request's blocks past its GPU prefix hit that the tier holds are loaded back (an external hit). Events,
without `self_describing_kv_events` (the default): one placeholder `BlockStored` per stored block (medium
"CPU", no token ids, block_size 0, no spec kind) and one `BlockRemoved` per evicting step and group.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from .blocks import BlockRemoved, BlockStored
from .stats import Histogram

MEDIUM = "CPU"
TRANSFER_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
PCIE_BYTES_PER_SECOND = 25e9


@dataclass
class OffloadStats:
    load_bytes: float = 0.0
    load_time: float = 0.0
    store_bytes: float = 0.0
    store_time: float = 0.0
    allocation_failures: int = 0
    external_queries: int = 0
    external_hits: int = 0
    load_sizes: Histogram = field(default_factory=lambda: Histogram(TRANSFER_SIZE_BUCKETS))
    store_sizes: Histogram = field(default_factory=lambda: Histogram(TRANSFER_SIZE_BUCKETS))


class CpuTier:
    def __init__(self, capacity_blocks: int, block_bytes: int, record_events: bool = True) -> None:
        if capacity_blocks < 1:
            raise ValueError("the CPU offload tier holds no block: raise --offload-cpu-bytes")
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.record_events = record_events
        self.blocks: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.events: list = []
        self.stats = OffloadStats()

    def store(self, hashes: Sequence[int], group_idx: int = 0) -> None:
        """One store job: the blocks the tier lacks are written; what they displace is removed."""
        new = [h for h in hashes if (group_idx, h) not in self.blocks]
        for h in hashes:
            if (group_idx, h) in self.blocks:
                self.blocks.move_to_end((group_idx, h))
        if not new:
            return
        evicted: dict[int, list[int]] = {}
        while len(self.blocks) + len(new) > self.capacity_blocks and self.blocks:
            (group, old), _ = self.blocks.popitem(last=False)
            evicted.setdefault(group, []).append(old)
        new = new[-self.capacity_blocks :]
        for h in new:
            self.blocks[(group_idx, h)] = None
        size = len(new) * self.block_bytes
        self.stats.store_bytes += size
        self.stats.store_time += size / PCIE_BYTES_PER_SECOND
        self.stats.store_sizes.observe(size)
        if self.record_events:
            self.events += [BlockRemoved(hs, group, MEDIUM) for group, hs in evicted.items()]
            self.events += [BlockStored([h], None, [], 0, group_idx, None, None, medium=MEDIUM) for h in new]

    def held(self, hashes: Sequence[int], group_idx: int = 0) -> int:
        """How many of `hashes` (the blocks past a GPU hit) the tier holds in a row from the first."""
        count = 0
        for h in hashes:
            if (group_idx, h) not in self.blocks:
                break
            count += 1
        return count

    def load(self, hashes: Sequence[int], group_idx: int = 0) -> None:
        """Load these blocks (all held) back to the GPU: one load job."""
        for h in hashes:
            self.blocks.move_to_end((group_idx, h))
        size = len(hashes) * self.block_bytes
        self.stats.load_bytes += size
        self.stats.load_time += size / PCIE_BYTES_PER_SECOND
        self.stats.load_sizes.observe(size)

    @property
    def usage(self) -> float:
        return len(self.blocks) / self.capacity_blocks

    def take_events(self) -> list:
        events, self.events = self.events, []
        return events
