"""Errors that cross a service boundary: each says what was wrong and names the culprit.

They deliberately do not derive from ValueError: pydantic turns a ValueError raised inside a validator
into a ValidationError and loses the parameter's name, while these pass through intact.
"""


class InvalidRequestError(Exception):
    """A request or one of its options is out of range; `param` names the field, as OpenAI's errors do."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidCommandError(Exception):
    """A command's kind or arguments are not valid; `field` names the culprit (e.g. "args.bits")."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
