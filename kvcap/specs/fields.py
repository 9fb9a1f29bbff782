"""Field types every spec shares: quantities that accept unit strings (``24GiB``, ``100Gbps``, ``500ms``, ``90%``)
and are held in base units, and the strict base model (unknown keys are errors, specs are frozen)."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from kvcap.errors import InputError
from kvcap.units import parse_bandwidth, parse_duration, parse_fraction, parse_size

Size = Annotated[int, BeforeValidator(lambda v: parse_size(v))]
Bandwidth = Annotated[float, BeforeValidator(lambda v: parse_bandwidth(v))]
Duration = Annotated[float, BeforeValidator(lambda v: parse_duration(v))]
OptionalDuration = Annotated[float | None, BeforeValidator(lambda v: None if v is None else parse_duration(v))]
Fraction = Annotated[float, BeforeValidator(lambda v: parse_fraction(v))]


class Strict(BaseModel):
    """A spec section: unknown keys are refused (a typo must not be silently ignored), values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def without_defaults(data: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """A spec section's serialisation less the keys added after runs were first written, where they hold their
    default: manifests and A/B fixed variables of a spec that leaves them alone stay as they were."""
    return {k: v for k, v in data.items() if k not in defaults or v != defaults[k]}


def validation_message(exc: ValidationError, where: str) -> str:
    """First pydantic error as one line: ``scenario.yaml: cluster.nodes: Input should be ≥ 1``."""
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    if isinstance(err.get("ctx", {}).get("error"), InputError):
        msg = str(err["ctx"]["error"])
    msg = msg.removeprefix("Value error, ")
    return f"{where}: {loc}: {msg}"


M = TypeVar("M", bound=BaseModel)


def validate(model: type[M], data: dict[str, Any], where: str) -> M:
    """``data`` as a ``model``, or one ``InputError`` line naming where and which key."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InputError(validation_message(exc, where)) from None
