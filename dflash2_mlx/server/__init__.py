"""An OpenAI-compatible HTTP server over `stream_cycles` (the library behind `dflash2 serve`).

`protocol`: the JSON body of a request parsed and validated into a `CompletionRequest` and its
`GenerationArguments`.
"""

from .protocol import ApiError, CompletionRequest, GenerationArguments, RequestParser

__all__ = ["ApiError", "CompletionRequest", "GenerationArguments", "RequestParser"]
