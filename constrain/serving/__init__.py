"""Serving: one engine thread for continuous batching, OpenAI's protocol, the HTTP server, the command line."""

from constrain.serving.cli import main
from constrain.serving.engine import Engine
from constrain.serving.protocol import ChatCompletionRequest, CompletionRequest
from constrain.serving.server import create_app, serve

__all__ = ["ChatCompletionRequest", "CompletionRequest", "Engine", "create_app", "main", "serve"]
