"""Cross-field rules, each written once and enforced in two places.

The API server checks them at admission as CEL (`x-kubernetes-validations` in the CRD); the
policy parser checks the same rules in Python, so a policy file given to `batchpilot run` or
`batchpilot explain` is held to exactly the same contract as a `kubectl apply`. A unit test
evaluates every CEL expression with a CEL interpreter against the same documents as the Python
predicate, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class CrossFieldRule:
    """A validation that spans several fields of one object."""

    cel: str
    """The rule as CEL, evaluated by the API server with `self` bound to the object."""
    message: str
    """What is wrong, naming the field path from `spec`."""
    holds: Callable[[Any], bool]
    """The same rule in Python, given the parsed model object."""
    field_path: str | None = None
    """Where the API server reports the error, relative to the object (e.g. `.end`)."""

    def as_cel_validation(self) -> dict[str, str]:
        rendered = {"rule": self.cel, "message": self.message}
        if self.field_path:
            rendered["fieldPath"] = self.field_path
        return rendered
