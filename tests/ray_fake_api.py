"""A job API that is no Ray cluster (issue 68's probe): a real HTTP and WebSocket server on
127.0.0.1 that answers Ray's job client as a dashboard does (its version, package uploads, job
submission, status, logs, the log stream, stop), and whose job's log is whatever a test writes
there. It runs nothing; launcher=ray must take what it says as data."""

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web


class FakeJobApi:
    def __init__(self, log: str = "", status: str = "SUCCEEDED"):
        self.log, self.status = log, status
        self.submitted: list[dict] = []  # the bodies of the job submissions it took
        self.address = ""

    def _app(self) -> web.Application:
        routes = web.RouteTableDef()

        @routes.get("/api/version")
        async def version(_):
            return web.json_response({"version": "4", "ray_version": "2.60.0", "ray_commit": "0"})

        @routes.get("/api/packages/{protocol}/{name}")
        async def package_exists(_):
            return web.Response(status=404)

        @routes.put("/api/packages/{protocol}/{name}")
        async def upload(request):
            await request.read()
            return web.Response()

        @routes.post("/api/jobs/")
        async def submit(request):
            body = await request.json()
            self.submitted.append(body)
            return web.json_response({"job_id": body["submission_id"], "submission_id": body["submission_id"]})

        @routes.get("/api/jobs/{id}")
        async def info(request):
            details = {"type": "SUBMISSION", "submission_id": request.match_info["id"], "entrypoint": "x"}
            return web.json_response({**details, "status": self.status, "message": "the fake job API's job"})

        @routes.get("/api/jobs/{id}/logs")
        async def logs(_):
            return web.json_response({"logs": self.log})

        @routes.get("/api/jobs/{id}/logs/tail")
        async def tail(request):
            ws = web.WebSocketResponse()
            await ws.prepare(request)
            await ws.send_str(self.log)
            await ws.close()
            return ws

        @routes.post("/api/jobs/{id}/stop")
        async def stop(_):
            self.status = "STOPPED"
            return web.json_response({"stopped": True})

        app = web.Application()
        app.add_routes(routes)
        return app

    @contextmanager
    def running(self) -> Iterator["FakeJobApi"]:
        """Serving on 127.0.0.1 (a free port) in a thread of its own, until the block ends."""
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(self._app())
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        self.address = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.run_until_complete(runner.cleanup())
            loop.close()


def message(**fields: object) -> str:
    """A line of the job's log as the driver writes a message (launchers/ray_messages.py)."""
    return "@titan_exp " + json.dumps(fields)
