"""What ``OPTIONS`` answers on the API."""

from __future__ import annotations

from typing import Any

from rest_framework.metadata import SimpleMetadata
from rest_framework.request import Request


class BodyWhereKnownMetadata(SimpleMetadata):
    """DRF's metadata, describing a POST/PUT body only where the view has a serializer for
    it. Actions that parse their own bodies (described in the OpenAPI document instead) have
    none, and DRF's metadata asserts on that: an OPTIONS on ``…/checkpoints/<id>/promote``
    was a 500 (found by the API fuzz run)."""

    def determine_actions(self, request: Request, view: Any) -> dict[str, Any]:
        # Imported here: DRF imports this module while rest_framework.views is half loaded.
        from rest_framework.generics import GenericAPIView  # noqa: PLC0415

        if (getattr(view, "serializer_class", None) is None
                and type(view).get_serializer_class is GenericAPIView.get_serializer_class):
            return {}
        return super().determine_actions(request, view)
