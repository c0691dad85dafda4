"""serve_deployment.until_client_gone: a handler's work is cancelled when, and only when, the
client's next ASGI message says it disconnected."""

from __future__ import annotations

import asyncio

import pytest

from folio.deploy.serve_deployment import ClientGone, until_client_gone


class FakeRequest:
    def __init__(self, receive):
        self.receive = receive


def run(receive, work_s=0.2, state=None):
    state = {"cancelled": False} if state is None else state

    async def work():
        try:
            await asyncio.sleep(work_s)
            return "answer"
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise

    async def main():
        return await until_client_gone(FakeRequest(receive), work())

    return asyncio.run(main()), state


def test_a_disconnect_cancels_the_work():
    async def receive():
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    state = {"cancelled": False}
    with pytest.raises(ClientGone) as e:
        run(receive, state=state)
    assert e.value.status == 499 and state["cancelled"]


@pytest.mark.parametrize("message", [{"type": "http.request", "body": b"", "more_body": False}, None, "junk"])
def test_any_other_message_lets_the_work_finish(message):
    async def receive():
        await asyncio.sleep(0.01)
        return message

    assert run(receive) == ("answer", {"cancelled": False})


def test_a_receive_that_fails_lets_the_work_finish():
    """Serve's proxy raises an unexpected fetch error on the next receive: not a disconnect."""
    async def receive():
        await asyncio.sleep(0.01)
        raise RuntimeError("the proxy went away")

    assert run(receive) == ("answer", {"cancelled": False})


def test_work_that_ends_first_stops_the_watch():
    watched = {"cancelled": False}

    async def receive():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            watched["cancelled"] = True
            raise

    assert run(receive, work_s=0.01)[0] == "answer"
    assert watched["cancelled"]
