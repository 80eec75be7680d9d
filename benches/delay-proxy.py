#!/usr/bin/env python3
"""A TCP proxy that holds every byte for a fixed time in each direction.

    delay-proxy.py LISTEN_PORT TARGET_PORT DELAY_MS

Between a PostgreSQL primary and its synchronous standby on one machine, it makes a commit
wait for a round trip of twice DELAY_MS, as it does with the standby in another zone. Order
is kept: bytes leave in the order they came, each DELAY_MS after it arrived. (The event
loop's timers have a resolution of a millisecond, so the delay is rounded up to one.)
"""
import asyncio
import sys


async def pump(reader, writer, delay):
    loop = asyncio.get_running_loop()
    queue = asyncio.Queue()

    async def send():
        while True:
            due, data = await queue.get()
            if data is None:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(1 << 16):
            queue.put_nowait((loop.time() + delay, data))
    finally:
        queue.put_nowait((0, None))
        await sender


async def main(listen_port, target_port, delay):
    async def connect(client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            pump(client_reader, server_writer, delay),
            pump(server_reader, client_writer, delay),
            return_exceptions=True,
        )

    server = await asyncio.start_server(connect, "127.0.0.1", listen_port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    listen, target, delay_ms = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    asyncio.run(main(listen, target, delay_ms / 1000))
