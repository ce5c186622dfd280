"""Serializer behaviour shared by the API's input documents."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rest_framework import serializers


class StrictSerializer(serializers.Serializer):
    """Refuses fields it does not declare, naming each (``{"evil": ["unknown field"]}``),
    as the run config's own schema does: a typo in a launch must not be silently ignored."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, Mapping):
            unknown = sorted(str(k) for k in data if k not in self.fields)
            if unknown:
                raise serializers.ValidationError({k[:100]: ["unknown field"]
                                                   for k in unknown[:20]})
        return super().to_internal_value(data)
