"""The base of every run-directory model: unknown keys refused, and a file's key order kept as it was written.

Why keep the order: the JSON files of a run directory are compared byte for byte across versions, and a few of
their objects are built in more than one order (a finding's ``arm`` comes first or last depending on who found
it). A model remembers the order its keys came in (and appends keys set later), so reading a file and writing it
back, or building a model from the analysis's values, gives the same bytes as the dicts it replaced.
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidatorFunctionWrapHandler,
    model_serializer,
    model_validator,
)

Number = float | int
"""A JSON number kept as it was written: an integer stays an integer (``5``, not ``5.0``)."""


class RunModel(BaseModel):
    """A run directory's object: unknown keys are errors; keys absent when built stay absent when written
    (``to_json``), in the order they came in."""

    model_config = ConfigDict(extra="forbid")
    _order: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _remember_order(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, RunModel):
            model._order = [k for k in data if k in cls.model_fields]
        return model

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in type(self).model_fields and name not in self._order:
            self._order.append(name)

    @model_serializer(mode="wrap")
    def _ordered(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        order = [k for k in self._order if k in out] + [k for k in out if k not in self._order]
        return {k: out[k] for k in order}

    def to_json(self) -> dict[str, Any]:
        """The object as the file holds it: the keys set, in their order, values as plain Python."""
        return self.model_dump(exclude_unset=True)
