"""The KV tensor's memory, shared between the actors that touch it.

The Worker owns the device KV tensor; the Transfer actor copies blocks in and out of
it. On CPU the tensor lives in a named shared-memory segment of the run
(``rf-<run>-kv.device.<rank>``), so the Transfer actor maps the same bytes; on CUDA
it is a device tensor exported by CUDA IPC. Either way the owner describes it with a
:class:`KVHandle` (a plain message field) and a peer opens it with
:func:`open_kv`. The layout is block-major, ``[num_blocks, layers, 2, block_size,
kv_heads, head_dim]`` (docs/design.md, "Blocks and tiers"), so one block is one
contiguous run of ``block_bytes`` bytes.

The segment's name belongs to the run: the supervisor unlinks every name of the run
when it ends, and a restarted Worker maps the segment its predecessor created (same
name, same size), so a peer's mapping stays valid across the restart.

torch is imported where a tensor is made, not with the module: the messages that carry a
:class:`KVHandle` are read by the supervisor and the Engine, which never touch a tensor
and should not pay for importing torch.
"""

from __future__ import annotations

import base64
import contextlib
import os
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import orjson
import posix_ipc

from ringfence.actors.model.dtypes import ITEMSIZE, known_dtype, torch_dtype
from ringfence.shm.errors import NameMissing, SegmentLayoutError
from ringfence.shm.names import SHM_DIR
from ringfence.shm.segment import Segment

if TYPE_CHECKING:
    import torch
    from torch import Tensor

LAYOUT_NAME = "block-major-v1"  # the Fingerprint's kv_layout of this layout

# The KV tensors this process made and shared, by handle: a peer in the same process (a lane
# hosted in the Worker's process, runtime/hosting.py) opens the tensor itself. CUDA cannot
# open an IPC handle in the process that exported it, and on the CPU a second mapping of
# the segment would only cost address space. Weak: the tensor lives as long as its owner's.
_OWN: weakref.WeakValueDictionary[str, Tensor] = weakref.WeakValueDictionary()


@dataclass(frozen=True, slots=True, kw_only=True)
class KVLayout:
    """Shape and element type of a block-major KV tensor."""

    num_blocks: int
    layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str  # "float32", "bfloat16" or "float64"

    def __post_init__(self) -> None:
        for field in ("num_blocks", "layers", "block_size", "kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"KV layout: {field} must be >= 1, got {getattr(self, field)}")
        known_dtype(self.dtype)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_blocks, self.layers, 2, self.block_size, self.kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def block_elements(self) -> int:
        return self.layers * 2 * self.block_size * self.kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        return self.block_elements * ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class KVHandle:
    """How a peer process opens a KV tensor: a shared-memory name, or a CUDA IPC export."""

    layout: KVLayout
    device: str  # "cpu" or "cuda:N"
    shm: str = ""  # POSIX name of the segment (CPU); "" for a process-private tensor
    cuda_ipc: str = ""  # JSON of torch's CUDA IPC record (CUDA): plain data, see cuda_args
    owner_pid: int = 0


class SharedKV:
    """A KV tensor. The tensor owns its memory: a mapping made by torch itself (CPU) or
    the device allocation (CUDA), freed when the last tensor viewing it is gone.

    The creator (the Worker) builds it with :func:`create_kv`, a peer with
    :func:`open_kv`. Nothing here unlinks the segment's name: it belongs to the run.
    """

    def __init__(self, tensor: Tensor, handle: KVHandle) -> None:
        self.tensor: Tensor | None = tensor
        self.handle = handle
        self.layout = handle.layout

    @property
    def kv(self) -> Tensor:
        if self.tensor is None:
            raise ValueError("the KV tensor is closed")
        return self.tensor

    def poison(self, block_ids: Iterable[int]) -> None:
        """Fill whole blocks with NaN: freed blocks under the debug aid ``cache.poison_freed``,
        and always the blocks a failed op was writing (see ``actors/executors/transfer.py``)."""
        import torch

        ids = list(block_ids)
        if ids:
            index = torch.tensor(ids, dtype=torch.long, device=self.kv.device)
            self.kv.index_fill_(0, index, float("nan"))
            if self.kv.is_cuda:  # landed before a watermark may say so
                torch.cuda.current_stream(self.kv.device).synchronize()

    def close(self) -> None:
        """Drop this object's reference. Idempotent. Views a caller still holds stay valid:
        the mapping goes away with the last of them, never under one."""
        self.tensor = None


def create_kv(layout: KVLayout, device: str, *, shm_name: str = "") -> SharedKV:
    """The KV tensor of ``layout`` on ``device``, shareable with peer processes.

    CPU with ``shm_name``: the named segment (mapped again when it exists with this
    layout's size, recreated when its size differs). CPU without a name: a private
    tensor (local runs and tests). CUDA: a device tensor exported by CUDA IPC.
    Contents are unspecified until written.
    """
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"model.device is {device!r} but torch sees no CUDA device")
        tensor = torch.empty(layout.shape, dtype=layout.torch_dtype, device=dev)
        handle = KVHandle(
            layout=layout,
            device=str(tensor.device),
            cuda_ipc=_export_cuda(tensor),
            owner_pid=os.getpid(),
        )
        _OWN[_own_key(handle)] = tensor
        return SharedKV(tensor, handle)
    if dev.type != "cpu":
        raise ValueError(f"KV device {device!r} is neither cpu nor cuda")
    if not shm_name:
        tensor = torch.empty(layout.shape, dtype=layout.torch_dtype)
        return SharedKV(tensor, KVHandle(layout=layout, device="cpu", owner_pid=os.getpid()))
    _ensure_segment(shm_name, layout.nbytes)
    handle = KVHandle(layout=layout, device="cpu", shm=shm_name, owner_pid=os.getpid())
    tensor = _map(shm_name, layout)
    _OWN[_own_key(handle)] = tensor
    return SharedKV(tensor, handle)


def open_kv(handle: KVHandle) -> SharedKV:
    """Open the KV tensor a peer created (the Transfer actor's side): the creator's own
    tensor when it was made in this process and still lives, else through its shared name
    or CUDA IPC export."""
    layout = handle.layout
    own = _OWN.get(_own_key(handle)) if handle.owner_pid == os.getpid() else None
    if own is not None and tuple(own.shape) == layout.shape and own.dtype == layout.torch_dtype:
        return SharedKV(own, handle)
    if handle.cuda_ipc:
        tensor = _import_cuda(handle.cuda_ipc)
        if tuple(tensor.shape) != layout.shape or tensor.dtype != layout.torch_dtype:
            raise SegmentLayoutError(
                f"CUDA KV tensor is {tuple(tensor.shape)} {tensor.dtype}, the handle says "
                f"{layout.shape} {layout.dtype}"
            )
        return SharedKV(tensor, handle)
    if not handle.shm:
        raise ValueError("this KV tensor is private to its process: it has no shared name")
    size = _segment_size(handle.shm)
    if size is None:
        raise NameMissing(f"shared-memory segment {handle.shm} does not exist")
    if size != layout.nbytes:
        raise SegmentLayoutError(
            f"KV segment {handle.shm} has {size} bytes; the layout needs {layout.nbytes}"
        )
    return SharedKV(_map(handle.shm, layout), handle)


def _own_key(handle: KVHandle) -> str:
    return handle.cuda_ipc or handle.shm


def _shm_file(name: str) -> Path:
    """The file of POSIX shared-memory object ``name``: one slash, then one path component
    (a handle from a message names nothing outside the shared-memory folder)."""
    base = name[1:] if name.startswith("/") else ""
    if not base or "/" in base or "\0" in base or base in (".", ".."):
        raise ValueError(f"{name!r} is not a POSIX shared-memory name")
    return SHM_DIR / base


def _segment_size(name: str) -> int | None:
    try:
        return _shm_file(name).stat().st_size
    except FileNotFoundError:
        return None


def _ensure_segment(name: str, nbytes: int) -> None:
    """Make ``name`` a segment of ``nbytes``: keep one of that size, else create it anew.

    Safe when several processes do it at once (the swap and store lanes both map the
    host tier): the segment is made whole under a private name, then linked into place,
    and a link fails if the name exists. A racing process never sees it half-sized.
    """
    size = _segment_size(name)
    if size == nbytes:
        return
    if size is not None:
        # An earlier incarnation ran with another layout: a new segment under the name;
        # peers that still map the old one keep it until they open the new handle.
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(name)
    private = f"{name}.new{os.getpid()}"
    Segment.create(private, nbytes).close()
    try:
        os.link(_shm_file(private), _shm_file(name))
    except FileExistsError:
        if _segment_size(name) != nbytes:
            raise SegmentLayoutError(
                f"KV segment {name} was made by another process with {_segment_size(name)} "
                f"bytes; this layout needs {nbytes}"
            ) from None
    finally:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(private)


def _map(name: str, layout: KVLayout) -> Tensor:
    # torch maps the file itself (MAP_SHARED) and its storage owns the mapping, so the
    # memory lives exactly as long as some tensor views it. (A tensor made with
    # torch.frombuffer over our own mmap would not keep that mmap alive.)
    import torch

    count = layout.nbytes // ITEMSIZE[layout.dtype]
    flat = torch.from_file(str(_shm_file(name)), shared=True, size=count, dtype=layout.torch_dtype)
    return flat.view(layout.shape)


def _export_cuda(tensor: Tensor) -> str:
    # torch's own CUDA IPC record (device, memory handle, offsets, reference counter,
    # event): the same route torch.multiprocessing takes, sent as plain data (JSON),
    # never as a pickle: a message field must not be able to name code to run.
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    rebuild, args = reduce_tensor(tensor)  # type: ignore[no-untyped-call]
    if rebuild is not rebuild_cuda_tensor:
        raise RuntimeError(f"torch shared a CUDA tensor with {rebuild.__name__}, not IPC")
    return cuda_record(args)


def _import_cuda(record: str) -> Tensor:
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = cuda_args(record)  # checked before torch touches anything
    tensor = rebuild_cuda_tensor(*args)  # type: ignore[no-untyped-call]
    assert isinstance(tensor, torch.Tensor)
    return tensor


# The fields of torch's rebuild_cuda_tensor, in order, with how each travels as JSON.
_CUDA_FIELDS: Final = (
    ("tensor_cls", "class"),
    ("size", "ints"),
    ("stride", "ints"),
    ("offset", "int"),
    ("storage_cls", "class"),
    ("dtype", "dtype"),
    ("device", "int"),
    ("handle", "bytes"),
    ("storage_size", "int"),
    ("storage_offset", "int"),
    ("requires_grad", "bool"),
    ("ref_handle", "bytes"),
    ("ref_offset", "int"),
    ("event_handle", "bytes"),
    ("event_sync", "bool"),
)


def _classes() -> dict[str, type]:
    import torch

    return {
        "Tensor": torch.Tensor,
        "TypedStorage": torch.TypedStorage,
        "UntypedStorage": torch.UntypedStorage,
    }


def cuda_record(args: Sequence[Any]) -> str:
    """The JSON of the arguments torch's ``reduce_tensor`` gives ``rebuild_cuda_tensor``."""
    if len(args) != len(_CUDA_FIELDS):
        raise RuntimeError(
            f"torch's CUDA IPC record has {len(args)} fields; this runtime knows one of "
            f"{len(_CUDA_FIELDS)}: check the torch version"
        )
    known = {cls: name for name, cls in _classes().items()}
    record: dict[str, Any] = {}
    for (field, kind), value in zip(_CUDA_FIELDS, args, strict=True):
        if kind == "class":
            if value not in known:
                raise RuntimeError(f"CUDA IPC record: {field} {value!r} is not a known class")
            record[field] = known[value]
        elif kind == "dtype":
            record[field] = str(value).removeprefix("torch.")
        elif kind == "bytes":
            record[field] = None if value is None else base64.b64encode(value).decode("ascii")
        elif kind == "ints":
            record[field] = [int(v) for v in value]
        else:
            record[field] = value
    return orjson.dumps(record).decode()


def cuda_args(record: str) -> tuple[Any, ...]:
    """The arguments of ``rebuild_cuda_tensor`` from :func:`cuda_record`'s JSON, every field
    checked; ValueError naming the first that is wrong. Nothing in it can name code."""
    import torch

    try:
        fields = orjson.loads(record)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"KV handle cuda_ipc is not a JSON record: {e}") from None
    if not isinstance(fields, dict) or set(fields) != {f for f, _ in _CUDA_FIELDS}:
        raise ValueError(
            f"KV handle cuda_ipc must hold exactly the fields {[f for f, _ in _CUDA_FIELDS]}"
        )
    classes = _classes()
    args: list[Any] = []
    for field, kind in _CUDA_FIELDS:
        value = fields[field]
        bad = ValueError(f"KV handle cuda_ipc field {field} is not a valid {kind}: {value!r:.80}")
        if kind == "class":
            if value not in classes:
                raise bad
            args.append(classes[value])
        elif kind == "dtype":
            if value not in ITEMSIZE:
                raise bad
            args.append(getattr(torch, value))
        elif kind == "bytes":
            if value is None:
                args.append(None)
                continue
            try:
                args.append(base64.b64decode(value, validate=True))
            except (TypeError, ValueError):
                raise bad from None
        elif kind == "ints":
            if not isinstance(value, list) or not all(_is_int(v) and v >= 0 for v in value):
                raise bad
            args.append(torch.Size(value) if field == "size" else tuple(value))
        elif kind == "int":
            if not (_is_int(value) and value >= 0):
                raise bad
            args.append(value)
        else:
            if not isinstance(value, bool):
                raise bad
            args.append(value)
    return tuple(args)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
