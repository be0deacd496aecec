"""`Refusal`: the one exception for a request the server will not run, raised by any process.

It carries what the client is answered with: the HTTP `status`, a `message`, the request field (`param`) it
names and a machine-readable `code` (e.g. "model_not_found"), as OpenAI's error body does. The api turns it
into that body; the tokenizer and scheduler send it to the api as a `RequestRejected` message.
"""

from __future__ import annotations


class Refusal(ValueError):
    """A request refused with HTTP `status` (400 unless said), naming the field `param` where one is at fault."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


class ModelLoadError(ValueError):
    """The model cannot be found or loaded (unknown name, missing file, unsupported architecture, an adapter
    this server does not run)."""
