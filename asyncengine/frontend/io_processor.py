"""IOProcessor, the interface of IO-processor plugins: in the floor, asyncengine.interfaces.io_processor;
imported here for the name code and plugins have used."""

from __future__ import annotations

from asyncengine.interfaces.io_processor import IOProcessor

__all__ = ["IOProcessor"]
