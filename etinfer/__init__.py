"""etinfer: an LLM inference engine in which predictive entropy is a first-class control signal."""

from etinfer.config import EngineConfig
from etinfer.llm import LLM
from etinfer.outputs import Logprob, RequestMetrics, RequestOutput
from etinfer.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "Logprob", "RequestMetrics", "RequestOutput", "SamplingParams"]
