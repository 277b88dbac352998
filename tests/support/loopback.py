"""An aiohttp app on a free loopback port, served by a thread of its own (fake judges and servers in tests)."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


class LoopbackServer:
    """Subclasses add their routes in ``routes``; ``url`` is where they answer until ``close``."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self.port = 0
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self._thread.start()
        started.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def routes(self, router: web.UrlDispatcher) -> None:
        raise NotImplementedError

    async def before_close(self) -> None:
        """Release whatever a handler may wait on."""

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        self.routes(app.router)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = self._runner.addresses[0][1]
        started.set()
        self._loop.run_forever()

    def close(self) -> None:
        async def stop() -> None:
            await self.before_close()
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
