"""etinfer: an LLM inference engine in which predictive entropy is a first-class control signal."""

from etinfer.config import EngineConfig
from etinfer.control.block_selection import PruningConfig
from etinfer.control.config import ControlConfig
from etinfer.control.drafting import SpeculativeConfig
from etinfer.control.stress import StressConfig
from etinfer.llm import LLM
from etinfer.outputs import Logprob, RequestMetrics, RequestOutput
from etinfer.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "ControlConfig",
    "EngineConfig",
    "Logprob",
    "PruningConfig",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "StressConfig",
]
