"""EndpointPlugin, the interface of endpoint plugins: in the floor, asyncengine.interfaces.endpoint;
imported here for the name code and plugins have used."""

from __future__ import annotations

from asyncengine.interfaces.endpoint import EndpointPlugin

__all__ = ["EndpointPlugin"]
