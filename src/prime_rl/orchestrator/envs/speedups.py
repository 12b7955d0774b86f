"""One cache for pydantic, installed once by the env side: measured, it was half the CPU of a turn.

verifiers builds its trace graph with `model_construct`, and pydantic (2.14) asks, for every field
with a `default_factory`, whether that factory takes the validated data: `inspect.signature` of the
factory, parsed from its text signature for a builtin such as `list` (`_signature_fromstr`), on every
construct. A factory's signature never changes, so the answer is memoized per factory.
(`benchmarks/generation.py`'s group runner: 3.0 ms of CPU per single-turn rollout, 1.4 after.)

Invariant: the answer for every factory is the one pydantic computes; factories that cannot be
hashed are asked every time, as before.
"""

from __future__ import annotations

import functools


def cache_default_factory_signatures() -> None:
    """Memoize pydantic's per-construct signature check of default factories (idempotent)."""
    from pydantic._internal import _fields

    check = _fields.takes_validated_data_argument
    if getattr(check, "_prime_rl_cached", False):
        return
    answers: dict = {}

    @functools.wraps(check)
    def cached(factory):
        try:
            return answers[factory]
        except KeyError:
            answer = answers[factory] = check(factory)
            return answer
        except TypeError:  # unhashable: asked each time
            return check(factory)

    cached._prime_rl_cached = True
    _fields.takes_validated_data_argument = cached
