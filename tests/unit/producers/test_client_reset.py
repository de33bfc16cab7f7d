"""An engine that dies mid-request (kill -9: the kernel resets the connection) must surface
as ``EngineUnavailable``, which the rollout worker rides out by regenerating the group,
not as a raw ``httpx`` error that stops the worker (found by
``tests/system/rollstream/test_chaos.py``)."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from producers.engine.client import EngineClient, EngineUnavailable


async def _resetting_server() -> tuple[asyncio.Server, int]:
    """Reads a request, then closes with SO_LINGER 0: an RST, as from a killed process."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("call", ["generate", "update_weights_from_disk"])
def test_connection_reset_mid_request_is_engine_unavailable(call: str) -> None:
    async def scenario() -> None:
        server, port = await _resetting_server()
        async with server, EngineClient(f"http://127.0.0.1:{port}", retries=2) as client:
            with pytest.raises(EngineUnavailable):
                if call == "generate":
                    await client.generate([[1, 2]], {"max_new_tokens": 2})
                else:
                    await client.update_weights_from_disk("/nowhere", weight_version="3")

    asyncio.run(asyncio.wait_for(scenario(), 30))
