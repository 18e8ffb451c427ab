import anyio


async def register():
    await anyio.sleep_forever()  # hangs on purpose: start-up must be bounded
