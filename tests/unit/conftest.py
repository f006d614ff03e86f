"""Unit tests run in this process alone: a test here that opens a network socket or starts a
process fails (such tests belong in tests/component)."""

from __future__ import annotations

import socket
import subprocess

import pytest


@pytest.fixture(autouse=True)
def no_sockets_or_processes(monkeypatch):
    def refused(*_args, **_kwargs):
        raise AssertionError("a unit test opened a socket or started a process: move it to tests/component")

    monkeypatch.setattr(socket.socket, "connect", refused)
    monkeypatch.setattr(socket.socket, "bind", refused)
    monkeypatch.setattr(subprocess.Popen, "__init__", refused)
