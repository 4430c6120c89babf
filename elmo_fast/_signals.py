"""SIGINT / SIGTERM as an exception that unwinds the command (every ``finally`` runs: temporary files removed,
the trainer's last checkpoint kept), and that long loops raise again if it got lost.

The handler raises :class:`Signalled` wherever the main thread is. Python swallows an exception raised inside a
finalizer or a weakref callback (it prints "Exception ignored in ..." and goes on), and the cyclic garbage
collector runs those at arbitrary allocations: a signal arriving then would be lost, and a long command would
run to its end. So the handler also records the signal, and :func:`check_signals`, called once per item by the
long loops (embedding batches, training steps), raises it again while it is pending.
"""
from __future__ import annotations

PENDING: list[int] = []  # signals received since install(), oldest first


class Signalled(BaseException):
    """Raised by the SIGINT / SIGTERM handler, so that every ``finally`` runs on the way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def on_signal(signum, frame):
    PENDING.append(signum)
    raise Signalled(signum)


def quiet_unraisable(previous):
    """A ``sys.unraisablehook`` for while the handler is installed: a :class:`Signalled` that Python could not raise
    (inside a finalizer) is recorded in ``PENDING`` and raised again by :func:`check_signals`, so its "Exception
    ignored in ..." traceback would only confuse the one-line message that follows; anything else goes to
    ``previous``."""

    def hook(unraisable):
        if not isinstance(unraisable.exc_value, Signalled):
            previous(unraisable)

    return hook


def check_signals() -> None:
    """Raise the first pending signal again (a no-op when none is pending: one list test)."""
    if PENDING:
        raise Signalled(PENDING[0])
