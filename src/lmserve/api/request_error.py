"""The error of a request that cannot be served as sent: every module that checks a request raises it, and the API's
error handler answers it with a 400 in OpenAI's shape (api/errors.py)."""

from __future__ import annotations

import re


class RequestError(ValueError):
    """A request that cannot be served as sent (HTTP 400); `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    @classmethod
    def from_value_error(cls, error: ValueError) -> RequestError:
        """A ValueError from SamplingParams or the front-end; `param` is the field it names, if any."""
        match = re.search(r"parameter (\w+)[=.:]", str(error))
        return cls(str(error), match.group(1) if match else None)
