"""The unit tests' guard (tests/unit/conftest.py) refuses sockets and processes."""

import socket
import subprocess
import sys

import pytest


def test_a_socket_is_refused():
    with pytest.raises(AssertionError, match="move it to tests/component"):
        socket.create_connection(("127.0.0.1", 9), timeout=1)
    with socket.socket() as sock, pytest.raises(AssertionError):
        sock.bind(("127.0.0.1", 0))


def test_a_process_is_refused():
    with pytest.raises(AssertionError, match="move it to tests/component"):
        subprocess.run([sys.executable, "-c", "pass"])
