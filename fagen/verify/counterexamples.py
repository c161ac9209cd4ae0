"""Counterexamples: a shrunk failing example, encoded as a blob that `fagen verify --reproduce` replays exactly."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math

from fagen.spec.kernel import KernelSpec, SpecError
from fagen.verify.mutants import MUTANTS
from fagen.verify.properties import BY_NAME
from fagen.verify.strategies import Problem


class BlobError(ValueError):
    """A --reproduce blob does not decode; the message says what is wrong with it."""


@dataclasses.dataclass(frozen=True)
class Counterexample:
    """A shrunk failing example: enough to replay it exactly (`fagen verify --reproduce <blob>`)."""

    spec: KernelSpec
    problem: Problem
    property: str
    message: str = ""
    mutant: str | None = None

    def blob(self) -> str:
        """urlsafe base64 of compact JSON {spec, problem, property, mutant?}, '=' padding dropped."""
        data = {"spec": self.spec.to_dict(), "problem": dataclasses.asdict(self.problem), "property": self.property}
        if self.mutant:
            data["mutant"] = self.mutant
        raw = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    def command(self, device: str = "cpu") -> str:
        return f"fagen verify --reproduce {self.blob()}" + (" --device cuda" if device == "cuda" else "")

    @classmethod
    def from_blob(cls, blob: str) -> Counterexample:
        try:
            data = json.loads(base64.urlsafe_b64decode(blob.strip() + "=" * (-len(blob.strip()) % 4)))
        except (binascii.Error, ValueError, UnicodeDecodeError):
            raise BlobError("not a fagen reproduce blob (expected urlsafe base64 of JSON); "
                            "copy the whole blob from the failure report") from None
        if not isinstance(data, dict) or not {"spec", "problem", "property"} <= set(data):
            raise BlobError("the blob decodes, but lacks spec, problem or property")
        if data["property"] not in BY_NAME:
            raise BlobError(f"unknown property {data['property']!r}; known: {', '.join(BY_NAME)}")
        if data.get("mutant") is not None and data["mutant"] not in {m.name for m in MUTANTS}:
            raise BlobError(f"unknown mutant {data['mutant']!r}")
        try:
            spec = KernelSpec.from_dict(data["spec"])
            problem = _checked(Problem.from_json(json.dumps(data["problem"])))
        except (SpecError, TypeError, ValueError) as e:
            raise BlobError(f"the blob's spec or problem is invalid: {e}") from None
        return cls(spec, problem, data["property"], mutant=data.get("mutant"))


def _checked(p: Problem) -> Problem:
    """A problem read from outside: plain non-negative ints, lengths within the shapes, parents before children."""
    def count(name, v, hi=None):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (hi is not None and v > hi):
            raise ValueError(f"{name} must be an integer in [0, {hi if hi is not None else 'inf'}], got {v!r}")

    for name in ("batch", "heads_kv", "seq_q", "seq_k", "seed"):
        count(name, getattr(p, name))
    for name, lens, hi in (("seqlens_q", p.seqlens_q, p.seq_q), ("seqlens_k", p.seqlens_k, p.seq_k)):
        if lens is not None:
            if len(lens) != p.batch:
                raise ValueError(f"{name} needs {p.batch} lengths, got {len(lens)}")
            for v in lens:
                count(name, v, hi)
    for tree in p.parents or ():
        if len(tree) != p.seq_q or any(not isinstance(x, int) or not -1 <= x < i for i, x in enumerate(tree)):
            raise ValueError(f"parents must be {p.seq_q} indices, each -1 or an earlier node, got {list(tree)}")
    if not isinstance(p.magnitude, (int, float)) or not math.isfinite(p.magnitude):
        raise ValueError(f"magnitude must be a finite number, got {p.magnitude!r}")
    return p
