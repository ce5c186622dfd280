"""Did an attempt train what it had left? A resumed job that exits cleanly without training
(veRL #7401) must fail, not succeed: the launcher compares the steps an attempt trained with
the ones between its resume point and the run's end."""

from __future__ import annotations

from collections.abc import Iterable


class IncompleteRun(RuntimeError):
    """The engine returned without training every remaining step: the attempt fails loudly
    instead of recording a success built on steps that never ran. Final: another attempt from
    the same checkpoint would do the same."""

    retryable = False


def check_trained(start: int, total: int, trained: Iterable[int]) -> list[int]:
    """Raise :class:`IncompleteRun` unless ``trained`` (the steps this attempt completed) is
    exactly start + 1 ... total; return them sorted."""
    got = sorted(trained)
    want = list(range(start + 1, total + 1))
    if got == want:
        return got
    if not got:
        raise IncompleteRun(f"the attempt resumed at step {start} of {total} and trained "
                            "nothing; refusing to report it as a success")
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    raise IncompleteRun(f"the attempt resumed at step {start} of {total} but trained steps "
                        f"{got[0]}..{got[-1]} ({len(got)}); missing {missing[:10]}"
                        + (f", unexpected {extra[:10]}" if extra else ""))
