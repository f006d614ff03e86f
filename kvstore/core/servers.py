"""A plain `http.server` that serves a bounded number of connections: the worker's control endpoint
and `kvstore pd-proxy` take no web framework.

    server = BoundedServer((host, port), handler, max_connections)   # BoundedServer6 for IPv6
"""

from __future__ import annotations

import socket
import threading
from http.server import ThreadingHTTPServer


class BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` of them: the accept loop waits for a slot."""

    daemon_threads = True
    request_queue_size = 128  # connections waiting to be accepted (socketserver's 5 resets a burst of calls)

    def __init__(self, address, handler, max_connections: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request, client_address) -> None:
        self._slots.acquire()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class BoundedServer6(BoundedServer):
    address_family = socket.AF_INET6
