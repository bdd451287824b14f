"""baton serving runtime.

`from runtime import Engine` is the offline API. The import is lazy so that torch-free parts of
the package (the router, the CLI's operator subcommand) never pull torch in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.offline import Engine

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from runtime.offline import Engine

        return Engine
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
