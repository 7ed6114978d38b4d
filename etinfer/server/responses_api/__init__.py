"""OpenAI's Responses API (``/v1/responses``) over the chat completions path."""

from etinfer.server.responses_api.protocol import ResponsesRequest
from etinfer.server.responses_api.serving import ResponsesServing

__all__ = ["ResponsesRequest", "ResponsesServing"]
