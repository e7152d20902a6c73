"""The base of every config model: unknown keys and non-finite or boolean numbers are errors.

Its own module so that config sections kept in modules of their own (:mod:`rlpipe.schemas.lora`) share it
with :mod:`rlpipe.schemas.config`, which imports them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def refuse_bool_for_number(model: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """YAML's ``true`` is not a number: a bool given for an int/float field (``total_steps: true``,
    which pydantic would read as 1) is an error naming the field. A quoted string for an integer field
    (``total_steps: "5"``) is refused too. Strings stay allowed for floats: YAML 1.1 reads ``1e-5``
    (no dot) as a string, and pydantic parses it, as users expect."""
    if isinstance(value, (bool, str)) and info.field_name:
        annotation = model.model_fields[info.field_name].annotation
        kinds = {annotation, *getattr(annotation, "__args__", ())}
        if isinstance(value, bool) and bool not in kinds and kinds & {int, float}:
            raise ValueError(f"expected a number, got the boolean {str(value).lower()}; write a number")
        if isinstance(value, str) and int in kinds and not kinds & {str, float, bool}:
            raise ValueError(f"expected an integer, got the string {value!r}; write the number without quotes")
    return value


class Strict(BaseModel):
    """Base of every config model: unknown keys are errors, field docstrings are descriptions,
    ``inf``/``nan`` are refused wherever a float is configured (``allow_inf_nan=False``), so a
    non-finite learning rate never reaches the optimizer, and booleans are refused for numbers."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_bool_for_number(cls, value, info)
