"""start_send (gateway/sse_relay.py): an ASGI send run in place when it does not wait, and finished by a task
when it does, with the send's own result, failure or cancellation intact."""

from __future__ import annotations

import asyncio

import pytest

from render_service.gateway.sse_relay import start_send


def test_a_send_that_does_not_wait_finishes_in_place():
    log = []

    async def send(message):
        log.append(message)

    async def run():
        assert start_send(send, {"n": 1}) is None
        assert log == [{"n": 1}]  # no task switch happened in between

    asyncio.run(run())


def test_a_send_that_waits_is_finished_by_the_awaitable_it_hands_back():
    log = []

    async def run():
        gate = asyncio.Event()

        async def send(message):
            log.append(("start", message["n"]))
            await gate.wait()  # uvicorn's flow control: the client's socket is full
            log.append(("done", message["n"]))

        rest = start_send(send, {"n": 2})
        assert rest is not None and log == [("start", 2)]
        task = asyncio.ensure_future(rest)
        await asyncio.sleep(0.01)
        assert not task.done() and log == [("start", 2)]
        gate.set()
        await asyncio.wait_for(task, 5)
        assert log == [("start", 2), ("done", 2)]

    asyncio.run(run())


def test_a_failure_after_the_wait_reaches_the_awaiting_task():
    async def run():
        async def send(message):
            await asyncio.sleep(0.001)
            raise ConnectionResetError("client gone")

        rest = start_send(send, {})
        with pytest.raises(ConnectionResetError):
            await rest

    asyncio.run(run())


def test_an_exception_set_on_the_awaited_future_is_seen_by_the_send():
    seen = []

    async def run():
        future = asyncio.get_running_loop().create_future()

        async def send(message):
            try:
                await future
            except RuntimeError as exc:
                seen.append(str(exc))  # the send handles it itself, as it would under a task

        rest = start_send(send, {})
        future.set_exception(RuntimeError("write failed"))
        await rest

    asyncio.run(run())
    assert seen == ["write failed"]


def test_cancelling_the_finishing_task_cancels_the_send():
    cleaned = []

    async def run():
        async def send(message):
            try:
                await asyncio.Event().wait()
            finally:
                cleaned.append(True)

        task = asyncio.ensure_future(start_send(send, {}))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert cleaned == [True]
