"""The one exception hierarchy of gradcomm.

Every error the library raises on purpose derives from :class:`GradcommError`, so
``except gradcomm.GradcommError`` catches them all. Where a standard exception has the
right meaning the subclass also derives from it (``ValueError``, ``TimeoutError``, ...),
so code written against the standard library keeps working.

Example:
    >>> from gradcomm.errors import GradcommError, MismatchError
    >>> issubclass(MismatchError, GradcommError)
    True
"""

from __future__ import annotations


class GradcommError(Exception):
    """Base class of every error gradcomm raises."""


class ConfigError(GradcommError, ValueError):
    """An unknown name or an invalid option (algorithm, op, compressor, topology...)."""


class BufferFormatError(ConfigError, BufferError):
    """A buffer whose memory cannot be read as its dtype says (a byte-swapped numpy array,
    e.g. dtype ``">f8"`` on a little-endian machine): also a BufferError, as mpi4py raises
    for such a buffer."""


class UnknownNameError(ConfigError, KeyError):
    """A name that is not in its registry (a compressor, ...): also a KeyError, as a
    registry lookup raises."""

    __str__ = Exception.__str__             # the message, not KeyError's repr of it


class UnknownOptionError(ConfigError, TypeError):
    """A keyword that the function or codec does not take: also a TypeError, as Python
    raises for an unexpected keyword argument."""


class UnsupportedError(GradcommError, NotImplementedError):
    """A valid request this combination cannot serve (e.g. op='max' with a compressor)."""


class MismatchError(GradcommError, ValueError):
    """Ranks called a collective with different arguments; raised on every rank."""


class DeadlineError(GradcommError, TimeoutError):
    """A blocking wait ran past its deadline (a peer never joined, or hung)."""


class AbortedError(GradcommError, RuntimeError):
    """This rank's wait was abandoned because another rank failed."""


class TransportError(GradcommError, RuntimeError):
    """The transport failed (message of the wrong size, closed connection, ...)."""


class PayloadError(GradcommError, ValueError):
    """A compressed payload is corrupt, truncated, of another version or hostile."""
