"""pulsegate: an OpenAI-compatible LLM gateway that routes by how healthy each backend really is."""

__version__ = "0.1.0"
