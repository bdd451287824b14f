"""DeviceAudit: what the step loop would cost on a GPU, seen on a CPU-only machine.

Run the engine on torch's `meta` device (shapes and dtypes, no data) under this dispatch mode
and it records, for every op that touches a meta tensor:
- `mixed`: a host tensor in the same op. On a GPU that is a device-mismatch error or, for an
  index, a hidden copy and wait on every call (a 0-dim host tensor is a scalar argument, which
  CUDA takes as it is);
- `syncs`: a read of a device value on the host (`.item()`, `bool()`, `.tolist()`, a boolean
  mask's `nonzero`): on a GPU each waits for all queued work; also `t[index_tensor] = 0` (a
  Python number written through a tensor index): on CUDA torch makes the number a host tensor
  that index_put_ copies over from pageable memory, a wait (on meta torch makes it on meta, so
  this one is caught one level up, at `Tensor.__setitem__`);
- `h2d` / `d2h`: explicit copies each way.
Mixed ops go on with their host tensors moved to meta, and a copy to the host or a read gives
zeros, so one run lists every offender. Each entry names the first frame in runtime/.
A dispatch mode is per thread: enter it on every thread that runs forwards (`on_thread`).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
_READS = (aten._local_scalar_dense.default, aten.nonzero.default)


def _where() -> str:
    """The innermost frame in runtime/: where the offending line is."""
    for frame in reversed(traceback.extract_stack()):
        if "/runtime/" in frame.filename:
            return f"{frame.filename.rsplit('/runtime/', 1)[1]}:{frame.lineno} {frame.line}"
    return "?"


def _is_host(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0


def _is_meta(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


class DeviceAudit(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.scalar_writes = _ScalarIndexWrites(self)
        self.mixed: list[str] = []
        self.syncs: list[str] = []
        self.h2d: list[str] = []
        self.d2h: list[str] = []

    def __enter__(self) -> DeviceAudit:
        self.scalar_writes.__enter__()
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.scalar_writes.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = tree_flatten((args, kwargs))[0]
        if not any(_is_meta(t) for t in tensors) and func.overloadpacket not in (aten._to_copy, aten.to):
            return func(*args, **kwargs)
        if func in _READS:
            self.syncs.append(f"{func}: {_where()}")
            if func is aten.nonzero.default:
                return torch.zeros((0, args[0].dim()), dtype=torch.int64, device="meta")
            return torch.zeros((), dtype=args[0].dtype).item()
        mask = _bool_index(func, args)
        if mask is not None:  # its size is data: a read as well
            self.syncs.append(f"{func} (boolean mask): {_where()}")
            return args[0].new_empty((0, *args[0].shape[mask.dim() :]))
        if func is aten.copy_.default or func.overloadpacket in (aten._to_copy, aten.to):
            copied = self._copy(func, args, kwargs)
            return func(*args, **kwargs) if copied is None else copied
        if any(_is_host(t) for t in tensors):
            self.mixed.append(f"{func}: {_where()}")
            args, kwargs = tree_map(_on_meta, (args, kwargs))
        return func(*args, **kwargs)

    def _copy(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Record an explicit copy between host and meta; a copy to the host gives zeros
        (returned), any other copy None (run as it is)."""
        src = args[0]
        if func is aten.copy_.default:
            dst_dev, src_dev = args[0].device.type, args[1].device.type
            if (dst_dev, src_dev) == ("cpu", "meta"):
                self.d2h.append(_where())
                return args[0].zero_()
            if (dst_dev, src_dev) == ("meta", "cpu"):
                self.h2d.append(_where())
            return None
        target = kwargs.get("device") or next(
            (a for a in args[1:] if isinstance(a, torch.device | str)), src.device
        )
        route = (src.device.type, torch.device(target).type)
        if route == ("meta", "cpu"):
            self.d2h.append(_where())
            return torch.zeros(src.shape, dtype=kwargs.get("dtype") or src.dtype)
        if route == ("cpu", "meta"):
            self.h2d.append(_where())
        return None

    def on_thread(self, worker: ThreadPoolExecutor) -> Callable[[], None]:
        """Enter the audit on `worker`'s (single) thread too; returns the call that leaves it."""
        worker.submit(self.__enter__).result()
        return lambda: worker.submit(self.__exit__, None, None, None).result()


class _ScalarIndexWrites(TorchFunctionMode):
    """Records `device_tensor[index_tensor] = python_number` in the audit's syncs."""

    def __init__(self, audit: DeviceAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.__setitem__:
            target, index, value = args
            indices = index if isinstance(index, tuple) else (index,)
            if (_is_meta(target) and isinstance(value, bool | int | float)
                    and any(isinstance(i, torch.Tensor) for i in indices)):
                self.audit.syncs.append(f"a Python number written through a tensor index: {_where()}")
        return func(*args, **(kwargs or {}))


def _bool_index(func: Any, args: Any) -> torch.Tensor | None:
    if func is not aten.index.Tensor:
        return None
    return next((i for i in args[1] if i is not None and i.dtype == torch.bool), None)


def _on_meta(t: Any) -> Any:
    return t.to("meta") if _is_host(t) else t
