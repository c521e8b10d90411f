"""A vLLM 0.32-compatible simulator driven by a model of vLLM's paged prefix cache (see docs/simulator.md)."""

from .config import Faults, SimulatorConfig
from .engine import Engine, EngineConfig, Request
from .latency import LatencyModel
from .server import Simulator, start_simulator

__all__ = [
    "Engine",
    "EngineConfig",
    "Faults",
    "LatencyModel",
    "Request",
    "Simulator",
    "SimulatorConfig",
    "start_simulator",
]
