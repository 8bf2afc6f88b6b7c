"""The shared KV tensor: its layout, a named CPU segment mapped by peers, CUDA IPC, poisoning."""

from __future__ import annotations

import base64
import dataclasses
import os
import pickle

import orjson
import pytest
import torch
from peers import finish, start
from torch import Tensor

from ringfence.actors.kv.space import (
    KVHandle,
    KVLayout,
    SharedKV,
    create_kv,
    cuda_args,
    cuda_record,
    open_kv,
)
from ringfence.actors.model.dtypes import torch_dtype
from ringfence.actors.tools.testing.shm import reap
from ringfence.shm import names
from ringfence.shm.errors import NameMissing, SegmentLayoutError
from ringfence.shm.segment import Segment

# Children are spawned (peers.start), never forked: a child must not inherit the
# parent's CUDA context. The child functions below are module-level, so multiprocess
# pickles them by reference and the child imports this module afresh. Importing torch
# there initialises no CUDA context: torch does that lazily.

LAYOUT = KVLayout(num_blocks=4, layers=2, block_size=4, kv_heads=2, head_dim=8, dtype="float32")
# Same-width integer dtypes, to compare float tensors bit for bit (NaN != NaN otherwise).
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}
CHILD_BLOCK = 2  # the block a child writes
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the CUDA IPC path needs one"
)


def layout(**changes) -> KVLayout:
    return dataclasses.replace(LAYOUT, **changes)


def pattern(lay: KVLayout, block: int, salt: float = 0.0) -> Tensor:
    """Distinct, reproducible contents for one block (on CPU); both processes derive them."""
    values = torch.arange(lay.block_elements, dtype=torch.float64) + 1000.0 * block + salt
    return values.to(lay.torch_dtype).view(lay.shape[1:])


def bits(t: Tensor) -> Tensor:
    return t.view(BITS[t.dtype])


@pytest.fixture
def kv_name(run_id):
    """The KV segment's name in a fresh run; every name of the run is unlinked afterwards
    (the name belongs to the run, and nothing in kv.space unlinks it)."""
    yield names.posix_name(run_id, "kv.device.0")
    names.clean_run(run_id)


# -- child-process bodies (module-level: spawned children import them by reference) --


def child_checks_the_parents_blocks_and_writes_its_own(handle: KVHandle) -> None:
    assert handle.owner_pid != os.getpid()
    sk = open_kv(handle)
    kv = sk.kv
    assert tuple(kv.shape) == handle.layout.shape and kv.dtype == handle.layout.torch_dtype
    for b in range(handle.layout.num_blocks):
        if b != CHILD_BLOCK:
            assert torch.equal(kv[b], pattern(handle.layout, b)), f"block {b} differs"
    kv[CHILD_BLOCK].copy_(pattern(handle.layout, CHILD_BLOCK, salt=0.5))
    del kv
    sk.close()


def cuda_child_checks_the_parents_blocks_and_writes_its_own(handle: KVHandle) -> None:
    assert handle.cuda_ipc and not handle.shm
    sk = open_kv(handle)
    kv = sk.kv
    assert kv.is_cuda and str(kv.device) == handle.device
    assert tuple(kv.shape) == handle.layout.shape and kv.dtype == handle.layout.torch_dtype
    for b in range(handle.layout.num_blocks):
        if b != CHILD_BLOCK:
            assert torch.equal(kv[b].cpu(), pattern(handle.layout, b)), f"block {b} differs"
    kv[CHILD_BLOCK].copy_(pattern(handle.layout, CHILD_BLOCK, salt=0.5).to(kv.device))
    torch.cuda.synchronize(kv.device)
    del kv
    sk.close()


def child_closes_while_a_view_is_alive(handle: KVHandle) -> None:
    sk = open_kv(handle)
    block = sk.kv[1]
    sk.close()  # the docstring: the mapping then goes away with `block` instead
    sk.close()
    assert bool((block == 5.0).all())
    block.fill_(6.0)
    del block


# -- the layout --


@pytest.mark.parametrize(("dtype", "itemsize"), [("float32", 4), ("bfloat16", 2), ("float64", 8)])
def test_a_layout_is_block_major_and_knows_its_block_and_total_bytes(dtype, itemsize):
    lay = KVLayout(num_blocks=5, layers=3, block_size=16, kv_heads=2, head_dim=8, dtype=dtype)
    assert lay.shape == (5, 3, 2, 16, 2, 8)
    assert lay.torch_dtype == torch_dtype(dtype)
    assert lay.torch_dtype.itemsize == itemsize
    assert lay.block_elements == 3 * 2 * 16 * 2 * 8
    assert lay.block_bytes == 3 * 2 * 16 * 2 * 8 * itemsize
    assert lay.nbytes == 5 * lay.block_bytes


@pytest.mark.parametrize("field", ["num_blocks", "layers", "block_size", "kv_heads", "head_dim"])
@pytest.mark.parametrize("value", [0, -3])
def test_a_layout_field_below_one_is_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"KV layout: {field} must be >= 1, got {value}"):
        layout(**{field: value})


def test_an_unknown_dtype_is_a_value_error_naming_it_and_listing_the_known_ones():
    with pytest.raises(ValueError, match="unknown dtype 'float16'"):
        layout(dtype="float16")
    with pytest.raises(ValueError) as caught:
        torch_dtype("float16")
    assert str(caught.value) == "unknown dtype 'float16'; known: ['bfloat16', 'float32', 'float64']"
    assert torch_dtype("bfloat16") is torch.bfloat16


def test_a_handle_is_a_frozen_picklable_message_field(kv_name):
    handle = KVHandle(layout=LAYOUT, device="cpu", shm=kv_name, owner_pid=123)
    assert pickle.loads(pickle.dumps(handle)) == handle
    with pytest.raises(dataclasses.FrozenInstanceError):
        handle.shm = "/elsewhere"  # type: ignore[misc]


# -- CPU: a named segment --


def test_a_cpu_kv_in_a_named_segment_has_the_layouts_shape_and_dtype_and_a_named_handle(
    kv_name, run_id
):
    lay = layout(dtype="bfloat16")
    sk = create_kv(lay, "cpu", shm_name=kv_name)
    try:
        assert tuple(sk.kv.shape) == lay.shape
        assert sk.kv.dtype == torch.bfloat16
        assert sk.kv.device.type == "cpu"
        assert sk.layout == lay
        assert sk.handle == KVHandle(layout=lay, device="cpu", shm=kv_name, owner_pid=os.getpid())
        assert [e.name for e in names.list_names(run_id)] == [kv_name]
        seg = Segment.attach(kv_name)
        assert seg.size == lay.nbytes
        seg.close()
    finally:
        sk.close()


def test_one_block_is_one_contiguous_run_of_block_bytes_at_its_offset_in_the_segment(kv_name):
    sk = create_kv(LAYOUT, "cpu", shm_name=kv_name)
    seg = Segment.attach(kv_name)
    try:
        kv = sk.kv
        assert kv.is_contiguous()
        for b in range(LAYOUT.num_blocks):
            block = kv[b]
            assert block.is_contiguous()
            assert block.numel() * block.element_size() == LAYOUT.block_bytes
            assert block.data_ptr() - kv.data_ptr() == b * LAYOUT.block_bytes
            block.copy_(pattern(LAYOUT, b))
        # The bytes of block b sit at [b * block_bytes, (b + 1) * block_bytes) of the segment.
        for b in range(LAYOUT.num_blocks):
            lo = b * LAYOUT.block_bytes
            raw = bytes(seg.buf[lo : lo + LAYOUT.block_bytes])
            assert raw == pattern(LAYOUT, b).numpy().tobytes(), f"block {b} is not at {lo}"
        del kv, block
    finally:
        seg.close()
        sk.close()


@pytest.mark.parametrize("made_by", ["this process", "another process"])
def test_a_handle_opens_the_creators_own_tensor_in_its_process_and_a_mapping_elsewhere(
    kv_name, made_by
):
    # A lane hosted in the Worker's process (runtime/hosting.py) opens the Worker's tensor;
    # a lane in a process of its own maps the segment again. Writes show through either way.
    sk = create_kv(LAYOUT, "cpu", shm_name=kv_name)
    handle = sk.handle
    if made_by == "another process":
        handle = dataclasses.replace(handle, owner_pid=handle.owner_pid + 1)
    peer = open_kv(handle)
    try:
        mine, theirs = sk.kv, peer.kv
        assert (mine.data_ptr() == theirs.data_ptr()) is (made_by == "this process")
        mine[1].copy_(pattern(LAYOUT, 1))
        assert torch.equal(theirs[1], pattern(LAYOUT, 1))
        theirs[3].fill_(-2.5)
        assert bool((mine[3] == -2.5).all())
        del mine, theirs
    finally:
        peer.close()
        sk.close()


def test_once_the_creators_tensor_is_gone_its_handle_maps_the_segment_again(kv_name):
    sk = create_kv(LAYOUT, "cpu", shm_name=kv_name)
    sk.kv[2].copy_(pattern(LAYOUT, 2))
    handle = sk.handle
    sk.close()  # the last reference: the process holds the tensor no more
    peer = open_kv(handle)
    try:
        assert torch.equal(peer.kv[2], pattern(LAYOUT, 2))
    finally:
        peer.close()


def test_a_spawned_child_opens_the_handle_sees_the_parents_blocks_and_the_parent_sees_its_own(
    kv_name,
):
    sk = create_kv(LAYOUT, "cpu", shm_name=kv_name)
    kv = sk.kv
    try:
        for b in range(LAYOUT.num_blocks):
            kv[b].copy_(pattern(LAYOUT, b))
        proc = start(child_checks_the_parents_blocks_and_writes_its_own, sk.handle)
        try:
            assert finish(proc) == 0, "the child found other contents than the parent wrote"
        finally:
            reap(proc)
        assert torch.equal(kv[CHILD_BLOCK], pattern(LAYOUT, CHILD_BLOCK, salt=0.5))
        for b in range(LAYOUT.num_blocks):
            if b != CHILD_BLOCK:
                assert torch.equal(kv[b], pattern(LAYOUT, b)), f"the child changed block {b}"
    finally:
        del kv
        sk.close()


# -- CPU: creating again (a restarted Worker) --


def test_creating_the_kv_again_with_the_same_layout_maps_the_existing_segment_and_its_data(
    kv_name,
):
    first = create_kv(LAYOUT, "cpu", shm_name=kv_name)
    first.kv[0].copy_(pattern(LAYOUT, 0))
    again = create_kv(LAYOUT, "cpu", shm_name=kv_name)
    try:
        assert torch.equal(again.kv[0], pattern(LAYOUT, 0))
        again.kv[1].fill_(7.0)  # the same bytes, not a copy
        assert bool((first.kv[1] == 7.0).all())
    finally:
        again.close()
    # The first incarnation is gone; its successor still finds the data, and a peer's
    # handle from before the restart still opens the same segment.
    first.close()
    restarted = create_kv(LAYOUT, "cpu", shm_name=kv_name)
    peer = open_kv(first.handle)
    try:
        assert torch.equal(restarted.kv[0], pattern(LAYOUT, 0))
        assert bool((restarted.kv[1] == 7.0).all())
        restarted.kv[2].fill_(3.0)
        assert bool((peer.kv[2] == 3.0).all())
    finally:
        peer.close()
        restarted.close()


def test_creating_the_kv_again_with_another_num_blocks_recreates_the_segment_at_the_new_size(
    kv_name, run_id
):
    old = create_kv(LAYOUT, "cpu", shm_name=kv_name)
    old.kv.fill_(9.0)
    bigger = layout(num_blocks=LAYOUT.num_blocks + 3)
    new = create_kv(bigger, "cpu", shm_name=kv_name)
    try:
        assert tuple(new.kv.shape) == bigger.shape
        seg = Segment.attach(kv_name)
        assert seg.size == bigger.nbytes
        seg.close()
        assert not bool((new.kv == 9.0).any()), "the old segment's data survived the resize"
        assert bool((new.kv == 0).all()), "a fresh segment is zero-filled"
        # A peer still mapping the old segment keeps it, separate from the new one ...
        new.kv.fill_(1.0)
        assert bool((old.kv == 9.0).all())
        # ... and its old handle no longer fits the name's segment.
        with pytest.raises(SegmentLayoutError):
            open_kv(old.handle)
        assert [e.name for e in names.list_names(run_id)] == [kv_name]
    finally:
        new.close()
        old.close()


# -- opening what does not fit --


def test_opening_a_handle_whose_layout_disagrees_with_the_segment_is_a_layout_error_naming_sizes(
    kv_name,
):
    sk = create_kv(LAYOUT, "cpu", shm_name=kv_name)
    try:
        for wrong in (layout(num_blocks=5), layout(dtype="float64"), layout(num_blocks=2)):
            handle = dataclasses.replace(sk.handle, layout=wrong)
            with pytest.raises(SegmentLayoutError) as caught:
                open_kv(handle)
            assert str(caught.value) == (
                f"KV segment {kv_name} has {LAYOUT.nbytes} bytes; the layout needs {wrong.nbytes}"
            )
            assert isinstance(caught.value, ValueError)
    finally:
        sk.close()


def test_a_private_kv_has_no_name_and_opening_its_handle_is_a_value_error(run_id):
    sk = create_kv(LAYOUT, "cpu")
    try:
        assert tuple(sk.kv.shape) == LAYOUT.shape and sk.kv.dtype == torch.float32
        assert sk.handle == KVHandle(layout=LAYOUT, device="cpu", owner_pid=os.getpid())
        with pytest.raises(ValueError, match="private to its process"):
            open_kv(sk.handle)
    finally:
        sk.close()
    assert names.list_names(run_id) == []


def test_opening_a_name_that_does_not_exist_is_name_missing(run_id):
    missing = names.posix_name(run_id, "kv.device.9")
    with pytest.raises(NameMissing, match=missing):
        open_kv(KVHandle(layout=LAYOUT, device="cpu", shm=missing))
    assert names.list_names(run_id) == []


@pytest.mark.parametrize("name", ["/../etc/passwd", "/a/b", "no-slash", "/", "/..", "/x\0y"])
def test_a_handle_naming_something_other_than_one_shared_memory_object_is_refused(name):
    with pytest.raises(ValueError, match="is not a POSIX shared-memory name"):
        open_kv(KVHandle(layout=LAYOUT, device="cpu", shm=name))


def test_a_device_that_is_neither_cpu_nor_cuda_is_a_value_error():
    with pytest.raises(ValueError, match="KV device 'meta' is neither cpu nor cuda"):
        create_kv(LAYOUT, "meta")


# -- poison and close --


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_poison_fills_exactly_the_given_blocks_with_nan_and_leaves_the_rest_bitwise_alone(
    kv_name, dtype, rng
):
    lay = layout(num_blocks=6, dtype=dtype)
    sk = create_kv(lay, "cpu", shm_name=kv_name)
    peer = open_kv(sk.handle)
    try:
        kv = sk.kv
        gen = torch.Generator().manual_seed(rng.randrange(1 << 32))
        kv.copy_(torch.randn(lay.shape, generator=gen, dtype=torch.float64).to(kv.dtype))
        before = bits(kv).clone()
        sk.poison([])
        assert torch.equal(bits(kv), before), "poisoning no block changed something"
        poisoned = [1, 4]
        sk.poison(iter(poisoned))  # any iterable of ids
        for b in range(lay.num_blocks):
            if b in poisoned:
                assert bool(torch.isnan(kv[b]).all()), f"block {b} is not all NaN"
                assert bool(torch.isnan(peer.kv[b]).all()), "the peer does not see the poison"
            else:
                assert torch.equal(bits(kv[b]), before[b]), f"block {b} was touched"
        del kv
    finally:
        peer.close()
        sk.close()


def test_poison_works_on_a_private_kv_too():
    sk = create_kv(LAYOUT, "cpu")
    try:
        sk.kv.zero_()
        sk.poison([0, 3])
        nan_blocks = [b for b in range(LAYOUT.num_blocks) if bool(torch.isnan(sk.kv[b]).all())]
        assert nan_blocks == [0, 3]
        assert bool((sk.kv[1:3] == 0).all())
    finally:
        sk.close()


def test_close_is_idempotent_drops_the_tensor_and_leaves_the_name_to_the_run(kv_name):
    sk = create_kv(LAYOUT, "cpu", shm_name=kv_name)
    sk.kv[0].fill_(4.0)
    sk.close()
    sk.close()
    assert sk.tensor is None
    with pytest.raises(ValueError, match="the KV tensor is closed"):
        _ = sk.kv
    with pytest.raises(ValueError, match="the KV tensor is closed"):
        sk.poison([0])
    # close never unlinks: the segment and its data are still there for the run.
    peer = open_kv(sk.handle)
    try:
        assert bool((peer.kv[0] == 4.0).all())
    finally:
        peer.close()


def test_closing_while_a_block_view_is_still_alive_keeps_the_view_usable(kv_name):
    # In a child: the failure mode is a segmentation fault, which would take pytest down.
    sk = create_kv(LAYOUT, "cpu", shm_name=kv_name)
    try:
        sk.kv[1].fill_(5.0)
        proc = start(child_closes_while_a_view_is_alive, sk.handle)
        try:
            code = finish(proc)
        finally:
            reap(proc)
        assert code == 0, f"the child died with {code} using a view after close"
        assert bool((sk.kv[1] == 6.0).all())
    finally:
        sk.close()


# -- CUDA --


# The fields torch's reduce_tensor gives rebuild_cuda_tensor, with the types it gives them.
CUDA_ARGS = (
    torch.Tensor, torch.Size([4, 2, 2, 4, 2, 8]), (512, 256, 128, 32, 16, 1), 0,
    torch.TypedStorage, torch.float32, 0, b"\x01" * 64, 8192, 0, False, b"/torch_1_2", 16,
    b"\x02" * 64, True,
)  # fmt: skip


def test_a_cuda_ipc_record_is_plain_json_that_gives_back_torchs_rebuild_arguments() -> None:
    record = cuda_record(CUDA_ARGS)
    fields = orjson.loads(record)
    assert fields["tensor_cls"] == "Tensor" and fields["storage_cls"] == "TypedStorage"
    assert fields["dtype"] == "float32" and fields["size"] == [4, 2, 2, 4, 2, 8]
    assert cuda_args(record) == CUDA_ARGS
    assert cuda_args(cuda_record((*CUDA_ARGS[:13], None, False)))[13] is None


class Touch:
    """A pickle that would create ``path`` when loaded: what the pickled record allowed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda f: {**f, "tensor_cls": "os.system"}, "tensor_cls"),
        (lambda f: {**f, "storage_cls": "Module"}, "storage_cls"),
        (lambda f: {**f, "dtype": "complex128"}, "dtype"),
        (lambda f: {**f, "size": [4, -2]}, "size"),
        (lambda f: {**f, "device": True}, "device"),
        (lambda f: {**f, "handle": "not base64!"}, "handle"),
        (lambda f: {**f, "event_sync": 1}, "event_sync"),
        (lambda f: {k: v for k, v in f.items() if k != "offset"}, "exactly the fields"),
        (lambda f: {**f, "extra": 1}, "exactly the fields"),
    ],
    ids=["code-class", "unknown-storage", "dtype", "negative-size", "bool-device", "bad-base64",
         "int-bool", "missing-field", "extra-field"],
)  # fmt: skip
def test_a_wrong_cuda_ipc_field_is_a_value_error_naming_it(mutate, message) -> None:
    fields = orjson.loads(cuda_record(CUDA_ARGS))
    with pytest.raises(ValueError, match=message):
        cuda_args(orjson.dumps(mutate(fields)).decode())


def test_a_handle_whose_cuda_ipc_is_a_pickle_is_refused_and_runs_nothing(tmp_path) -> None:
    marker = tmp_path / "ran"
    payload = base64.b64encode(pickle.dumps(Touch(str(marker)))).decode("ascii")
    handle = KVHandle(layout=LAYOUT, device="cuda:0", cuda_ipc=payload, owner_pid=1)
    with pytest.raises(ValueError, match="cuda_ipc is not a JSON record"):
        open_kv(handle)
    assert not marker.exists()


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CUDA device is present: this checks the error without one"
)
def test_a_cuda_kv_without_a_cuda_device_is_a_runtime_error_naming_the_device():
    for device in ("cuda", "cuda:1"):
        with pytest.raises(
            RuntimeError, match=rf"model.device is '{device}' but torch sees no CUDA device"
        ):
            create_kv(LAYOUT, device)


@needs_cuda
def test_a_cuda_kv_is_a_device_tensor_exported_by_cuda_ipc_with_no_segment_name(run_id):
    sk = create_kv(LAYOUT, "cuda")
    try:
        kv = sk.kv
        assert kv.is_cuda
        assert tuple(kv.shape) == LAYOUT.shape and kv.dtype == torch.float32
        assert kv[CHILD_BLOCK].is_contiguous()
        assert kv[CHILD_BLOCK].data_ptr() - kv.data_ptr() == CHILD_BLOCK * LAYOUT.block_bytes
        assert sk.handle.cuda_ipc != ""
        assert sk.handle.shm == ""
        assert sk.handle.device == str(kv.device) == f"cuda:{torch.cuda.current_device()}"
        assert sk.handle.owner_pid == os.getpid()
        assert pickle.loads(pickle.dumps(sk.handle)) == sk.handle
        del kv
    finally:
        sk.close()
    assert names.list_names(run_id) == []


@needs_cuda
def test_a_cuda_handle_opened_in_the_process_that_made_it_is_its_own_tensor():
    # CUDA cannot open an IPC handle in the process that exported it: a lane hosted in the
    # Worker's process gets the Worker's tensor instead.
    sk = create_kv(LAYOUT, "cuda")
    peer = open_kv(sk.handle)
    try:
        assert peer.kv.data_ptr() == sk.kv.data_ptr()
        peer.kv[1].fill_(3.0)
        assert bool((sk.kv[1] == 3.0).all())
    finally:
        peer.close()
        sk.close()


@needs_cuda
def test_a_spawned_child_opens_the_cuda_handle_sees_the_parents_blocks_and_the_parent_its_own():
    sk = create_kv(LAYOUT, "cuda")
    assert isinstance(sk, SharedKV)
    kv = sk.kv
    try:
        for b in range(LAYOUT.num_blocks):
            kv[b].copy_(pattern(LAYOUT, b).to(kv.device))
        torch.cuda.synchronize(kv.device)  # the export's event predates these writes
        proc = start(cuda_child_checks_the_parents_blocks_and_writes_its_own, sk.handle)
        try:
            assert finish(proc) == 0, "the child found other contents than the parent wrote"
        finally:
            reap(proc)
        torch.cuda.synchronize(kv.device)
        assert torch.equal(kv[CHILD_BLOCK].cpu(), pattern(LAYOUT, CHILD_BLOCK, salt=0.5))
        for b in range(LAYOUT.num_blocks):
            if b != CHILD_BLOCK:
                assert torch.equal(kv[b].cpu(), pattern(LAYOUT, b)), f"the child changed block {b}"
    finally:
        del kv
        sk.close()
