"""How image workers hand their items back: msgpack written around the pixel values (equal to msgspec's own
encoding of the whole item), and shared slots that carry the same bytes the pipe does and are all back after
every request, whether it succeeded, was refused by its worker or was given up mid-work, and closed at
shutdown. Real worker processes, real images."""

from __future__ import annotations

import asyncio
import base64
import os

import msgspec
import numpy as np
import pytest

from render_service.http.errors import ApiError
from render_service.multimodal.bounds import ImageBounds, decode_rgb, read_header
from render_service.multimodal.families import family_from_bundle
from render_service.multimodal.hashing import image_hash
from render_service.multimodal.pool import ImagePool, item_bound
from render_service.multimodal.qwen_vl import pixel_values
from render_service.multimodal.shared_slots import AttachedSlot, SharedSlots, SlotRef, SlotUnavailable
from render_service.multimodal.wire import item_layout
from tests.multimodal_images import VL_FIXTURE, encode, noise_image

QWEN25 = family_from_bundle(VL_FIXTURE)


def _memfds() -> int:
    """This process's open slot files."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "splitserve-image" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return count


def _decoded(item: bytes) -> dict:
    return msgspec.msgpack.decode(base64.b64decode(item.strip(b'"')))


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
@pytest.mark.parametrize("rows", [1, 4, 16, 1000, 11000])
def test_the_item_layout_is_msgspecs_encoding_of_the_whole_item(dtype: str, rows: int) -> None:
    """Sizes on every msgpack ext header form (fixext, ext8, ext16, ext32): the bytes decode to the item and
    encode back to themselves."""
    patch_dim = 4 if rows == 1 else 1176
    layout = item_layout(dtype, rows, patch_dim, (1, rows, 1))
    values = np.random.default_rng(rows).integers(0, 256, size=layout.size, dtype=np.uint8).tobytes()
    blob = layout.prefix + values + layout.suffix
    item = msgspec.msgpack.decode(blob)
    assert msgspec.msgpack.encode(item) == blob
    kind, shape, ext = item["pixel_values"]["data"]
    assert (kind, shape, ext.code, bytes(ext.data)) == (dtype, [rows, patch_dim], 3, values)
    assert item["image_grid_thw"]["data"][2].data == np.array([1, rows, 1], "<i8").tobytes()


@pytest.fixture(scope="module")
def pool():
    before = _memfds()
    pool = ImagePool(2, work_timeout_s=60)
    pool.warm_up()
    yield pool
    pool.shutdown()
    assert _memfds() == before


def _process(pool: ImagePool, key: str, data: bytes, normalize: bool = False):
    header = read_header(data, ImageBounds(), "img")
    assert QWEN25 is not None
    return pool.process(key, data, header, QWEN25, "m", True, normalize)


@pytest.mark.parametrize("normalize", [False, True])
def test_slots_carry_the_bytes_the_pipe_carries(pool: ImagePool, normalize: bool) -> None:
    assert QWEN25 is not None
    data = encode(noise_image(640, 480, seed=4), "JPEG")

    async def both() -> tuple[bytes | None, bytes | None]:
        shared = await _process(pool, f"shared-{normalize}", data, normalize)
        pool.slots.enabled = False
        try:
            piped = await _process(pool, f"piped-{normalize}", data, normalize)
        finally:
            pool.slots.enabled = True
        return shared.kwargs_item, piped.kwargs_item

    shared, piped = asyncio.run(both())
    assert shared is not None and shared == piped
    assert pool.slots.held == 0 and 0 < pool.slots.live <= pool.slots.limit
    values = _decoded(shared)["pixel_values"]["data"][2].data
    expected, _ = pixel_values(decode_rgb(data, read_header(data, ImageBounds(), "img"), "img")[0], QWEN25, normalize)
    assert bytes(values) == expected.tobytes()


def test_every_slot_is_back_after_refusals_and_abandoned_requests(pool: ImagePool) -> None:
    png = encode(noise_image(600, 400, seed=5), "PNG")
    truncated = png[: len(png) // 2]  # its header reads; its pixels do not: the worker refuses it
    big = encode(noise_image(5000, 3400, seed=6), "JPEG")  # long enough to give up on mid-work

    async def run() -> None:
        for round_ in range(3):
            with pytest.raises(ApiError) as refused:
                await _process(pool, f"bad-{round_}", truncated)
            assert refused.value.status == 400
            abandoned = asyncio.ensure_future(_process(pool, f"big-{round_}", big))
            await asyncio.sleep(0.2)
            abandoned.cancel()
            with pytest.raises(asyncio.CancelledError):
                await abandoned
            assert pool.slots.held == 1  # its worker still writes into it
            for _ in range(600):
                if pool.slots.held == 0:
                    break
                await asyncio.sleep(0.05)
            assert pool.slots.held == 0
        # many at once: more than there are slots, all served, all slots back
        results = await asyncio.gather(*(_process(pool, f"many-{i}", encode(noise_image(300 + i, 200, seed=i), "PNG"))
                                         for i in range(3 * pool.slots.limit)))
        assert all(result.kwargs_item for result in results)
        assert pool.slots.held == 0 and pool.slots.live <= pool.slots.limit

    asyncio.run(run())
    assert pool.pending == 0


def test_a_dead_workers_slot_is_dropped_not_reused() -> None:
    import signal

    pool = ImagePool(1, work_timeout_s=15)
    before = _memfds()
    try:
        pool.warm_up()
        big = encode(noise_image(5000, 3400, seed=8), "JPEG")  # a second or so of work

        async def kill_mid_work() -> None:
            task = asyncio.ensure_future(_process(pool, "big", big))
            await asyncio.sleep(0.3)
            assert pool._executor is not None
            for pid in list(pool._executor._processes):
                os.kill(pid, signal.SIGKILL)
            with pytest.raises(ApiError) as died:
                await task
            assert died.value.status == 503
            assert pool.slots.held == 0 and pool.slots.live == 0
            again = await _process(pool, "small", encode(noise_image(64, 64, seed=9), "PNG"))
            assert again.kwargs_item and pool.slots.live == 1

        asyncio.run(kill_mid_work())
    finally:
        pool.shutdown()
    assert _memfds() == before


def test_slots_are_reused_and_bounded() -> None:
    before = _memfds()
    slots = SharedSlots(2, keep_bytes=4 << 20)

    async def run() -> None:
        first = await slots.acquire(1000)
        second = await slots.acquire(3 << 20)
        assert first is not None and second is not None and slots.live == 2
        third = asyncio.ensure_future(slots.acquire(10))
        await asyncio.sleep(0.01)
        assert not third.done()  # both held: it waits
        slots.release(first)
        assert (await third) is first  # the same memory again
        slots.release(second)
        slots.release(first)
        big = await slots.acquire(8 << 20)  # over keep_bytes: made for one image, closed when released
        assert big is not None and not big.ref.kept and slots.live == 2
        slots.release(big)
        assert slots.live == 1 and slots.held == 0

    asyncio.run(run())
    assert _memfds() == before + 2  # (a slot's descriptor, and its mapping's own)
    slots.close()
    assert _memfds() == before


def test_a_worker_write_that_does_not_fit_takes_the_pipe() -> None:
    slots = SharedSlots(1, keep_bytes=0)  # (slots for one image: this process, as a worker, keeps no mapping)

    async def one() -> None:
        slot = await slots.acquire(10)
        assert slot is not None
        ref = slot.ref
        slot.memory[:5] = b"image"
        with AttachedSlot(ref) as shared:
            assert shared.read(5) == b"image"
            assert shared.write_quoted(b"x" * (ref.capacity - 2)) == ref.capacity
            assert shared.write_quoted(b"x" * (ref.capacity - 1)) is None
        assert slots.read(slot, 4) == b'"xxx'
        with pytest.raises(SlotUnavailable):
            AttachedSlot(SlotRef(ref.owner, 10**6, 10**6, ref.capacity, True))  # no such descriptor
        slots.release(slot)

    asyncio.run(one())
    slots.close()


def test_a_slot_its_worker_cannot_open_turns_slots_off_and_the_image_takes_the_pipe() -> None:
    assert QWEN25 is not None
    pool = ImagePool(1)
    try:
        pool.warm_up()
        slot = asyncio.run(pool.slots.acquire(1 << 20))
        assert slot is not None
        pool.slots.release(slot)
        null = os.open("/dev/null", os.O_RDONLY)  # the slot's descriptor now names a file no worker can map
        os.dup2(null, slot.ref.fd)
        os.close(null)
        data = encode(noise_image(200, 100, seed=11), "PNG")
        result = asyncio.run(_process(pool, "x", data))
        assert not pool.slots.enabled and pool.slots.held == 0
        assert result.kwargs_item is not None
        expected, _ = pixel_values(decode_rgb(data, read_header(data, ImageBounds(), "img"), "img")[0], QWEN25,
                                   False)
        assert bytes(_decoded(result.kwargs_item)["pixel_values"]["data"][2].data) == expected.tobytes()
    finally:
        pool.shutdown()


def test_a_large_image_reaches_its_worker_through_a_slot_without_tensors(pool: ImagePool) -> None:
    """A router's request (no tensors) for a PNG over the slot threshold: its bytes go through a slot and the
    worker hashes exactly them."""
    assert QWEN25 is not None
    data = encode(noise_image(400, 300, seed=12), "PNG")
    assert len(data) > 64 * 1024
    header = read_header(data, ImageBounds(), "img")
    result = asyncio.run(pool.process("router", data, header, QWEN25, "m", False))
    converted = decode_rgb(data, header, "img")[1]
    assert result.mm_hash == image_hash(data, "m", converted=converted) and result.kwargs_item is None
    assert pool.slots.held == 0 and pool.slots.live >= 1


def test_the_bound_covers_both_orientations() -> None:
    assert QWEN25 is not None
    for width, height in ((1920, 1080), (1080, 1920), (5, 900), (3001, 17)):
        image = noise_image(width, height, seed=1)
        data = encode(image, "PNG")
        header = read_header(data, ImageBounds(), "img")
        for turned in (image, image.transpose(method=5)):  # EXIF orientations 5-8 swap the sides
            for normalize in (False, True):
                values, grid = pixel_values(turned, QWEN25, normalize)
                layout = item_layout(str(values.dtype), *values.shape, grid)
                assert item_bound(header, QWEN25, normalize) >= len(base64.b64encode(bytes(layout.total))) + 2



def test_a_forked_process_gets_no_slot_from_its_parents_slots() -> None:
    """A process forked from the owner (``--workers N``) must not hand its workers the owner's slots."""
    slots = SharedSlots(2)
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when it got no slot
        os._exit(0 if asyncio.run(slots.acquire(10)) is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    got = asyncio.run(slots.acquire(10))  # the owner itself still does
    assert got is not None
    slots.release(got)
    slots.close()


def test_an_answer_in_pieces_joins_to_its_whole_encoding() -> None:
    """The render answer written as pieces (the items never copied into one body) is, joined, byte for byte
    the answer encoded whole: with items, with an image without one, with none at all."""
    from render_service.multimodal.features import answer_pieces, build_features
    from render_service.multimodal.pool import ProcessedImage
    from render_service.wire.protocol import GenerateRequest

    encode = msgspec.json.Encoder().encode
    items = [b'"' + base64.b64encode(bytes([i]) * (1000 + i)) + b'"' for i in range(3)]
    images = [ProcessedImage(f"h{i}", (1, 2, 2), 1, items[i], "meta") for i in range(3)]
    images.insert(1, ProcessedImage("none", (1, 2, 2), 1))
    for tensors, chosen in ((True, images), (True, images[:1]), (False, images)):
        answer = GenerateRequest(token_ids=[1, 2, 3], features=build_features(chosen, [(0, 1)] * len(chosen),
                                                                               tensors))
        pieces = answer_pieces(answer, encode)
        assert b"".join(pieces) == encode(answer)
        assert len(pieces) == 1 + 2 * sum(image.kwargs_item is not None for image in chosen) * tensors
    plain = GenerateRequest(token_ids=[1])
    assert answer_pieces(plain, encode) == [encode(plain)]
