"""Typed errors. Every error says what was wrong and where (argument, field, record, line)."""

from __future__ import annotations


class CreditlabError(Exception):
    """Base class of every error creditlab raises on purpose."""


class InputError(CreditlabError, ValueError):
    """A tensor, record or field is malformed (wrong shape, dtype, NaN, missing field...).

    Subclasses ``ValueError`` so that callers catching the builtin keep working.
    """


class ConfigError(CreditlabError, ValueError):
    """An impossible configuration (e.g. ``C > T``, ``k < 1``, an unknown arm name)."""

    def __init__(self, parameter: str, message: str):
        self.parameter = parameter
        self.message = message
        super().__init__(f"{parameter}: {message}")

    def __reduce__(self):
        # rebuilt from both arguments when pickled: raised in a Ray worker (a trainer's loss), it reaches
        # the driver as itself
        return type(self), (self.parameter, self.message)
