"""A machine's teardown never hides the failure that ended its example.

Hypothesis runs a state machine's ``teardown`` in a ``finally`` (hypothesis/stateful.py
``run_state_machine``), so it also runs while a step's or an invariant's failure is on its way out,
on the state that failure left. A clean-up that fails on that state (``clear_all`` releasing a
payload that a broken eviction already freed: ``RuntimeError: double release of payload #2``)
raised from teardown replaced the failure: the gate reported property ``crash`` with an untidied
program where the failure was ``refcount``, and Hypothesis shrank toward the teardown's error.

So a machine marks its rules and invariants with :func:`noted`, which keeps on the machine
(``step_failure``) the exception that escaped one; teardown runs its clean-up in stages
(:func:`stages`: one failing stage does not skip the next, so a server is still closed) and hands
their errors to :func:`settle`. After a failure, each is kept beside it (:func:`teardown_errors`
reads them: the gate's ``Failure.teardown``; a comment note on the exception for a reader of its
traceback) and teardown returns, so the failure goes on as it was raised, to Hypothesis' shrinker
too. With no failure before it, teardown's own first error is the example's failure, as strict as
it was.

May import: nothing of the project (a helper of the machines in ``properties``).
"""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable
from typing import Any, TypeVar, cast

__all__ = ["NOTE", "describe", "noted", "settle", "stages", "teardown_errors"]

F = TypeVar("F", bound=Callable[..., Any])

# the note put on a failure for each teardown error kept beside it: a comment, so that a program made
# by joining an exception's notes (the llama-cpp-python cache backend's) still runs as pasted
NOTE = "# teardown also failed, after the failure above (kept beside it): "


def noted(fn: F) -> F:
    """A rule or invariant that keeps an exception escaping it on the machine (``step_failure``), then re-raises it.

    Placed under ``@rule``/``@invariant``, so that Hypothesis calls it as the rule's function.
    """

    @functools.wraps(fn)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except BaseException as e:  # an interrupt too: teardown must not replace it either
            self.step_failure = e
            raise

    return cast(F, step)


def stages(*steps: Callable[[], None]) -> list[Exception]:
    """Run each clean-up step, each one even after an earlier one failed; the errors they raised, in order."""
    errors: list[Exception] = []
    for fn in steps:
        try:
            fn()
        except Exception as e:
            errors.append(e)
    return errors


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def describe(e: BaseException) -> str:
    """``Type: message (file:line in function)``, the line where it was raised (a project file by its
    path in the repository)."""
    where = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ is not None else []
    if not where:
        return f"{type(e).__name__}: {e}"
    path = where[0].filename
    if path.startswith(_ROOT + os.sep):
        path = os.path.relpath(path, _ROOT)
    return f"{type(e).__name__}: {e} ({path}:{where[0].lineno} in {where[0].name})"


def _keep(failure: BaseException, errors: list[Exception]) -> None:
    kept: list[str] = list(getattr(failure, "teardown_errors", []))
    for e in errors:
        line = describe(e)
        kept.append(line)
        failure.add_note(NOTE + line)
    failure.teardown_errors = kept  # type: ignore[attr-defined]  # read by teardown_errors()


def settle(failure: BaseException | None, errors: list[Exception]) -> None:
    """The end of a teardown whose clean-up raised ``errors``.

    After ``failure`` (what escaped a step or check), each error is kept beside it and this returns:
    the ``finally`` that runs teardown goes on raising ``failure``. Without one, the first error is
    raised (any further ones kept beside it): a teardown that fails on its own fails the example.
    """
    if not errors:
        return
    if failure is None:
        first, rest = errors[0], errors[1:]
        if rest:
            _keep(first, rest)
        raise first
    _keep(failure, errors)


def teardown_errors(e: BaseException) -> list[str]:
    """What teardown raised after ``e`` (each :func:`describe`\\ d), kept beside it; empty when nothing was."""
    kept = getattr(e, "teardown_errors", None)
    return [str(x) for x in kept] if isinstance(kept, list) else []
