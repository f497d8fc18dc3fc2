"""The gang's leader line (``bubbles.training.sdk.gang``): a follower obeys step commands only from a process of its
own user. The line is an abstract Unix socket, which has no file permissions: the kernel names each sender
(SO_PASSCRED), and ``sender_uid`` reads it. Real sockets, and a real process of another user (the tests run as root)."""

from __future__ import annotations

import os
import socket

import pytest

from bubbles.training.sdk.gang import CREDENTIALS_BYTES, follower_address, sender_uid


def follower(port: int) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    s.bind(follower_address(port, 1))
    s.settimeout(5)
    return s


def read(s: socket.socket) -> tuple[bytes, int | None]:
    data, ancdata, _flags, _addr = s.recvmsg(64, socket.CMSG_SPACE(CREDENTIALS_BYTES))
    return data, sender_uid(ancdata)


def test_a_command_from_this_user_names_this_user() -> None:
    port = 40000 + os.getpid() % 20000
    with follower(port) as s, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as leader:
        leader.sendto(b"step", follower_address(port, 1))
        assert read(s) == (b"step", os.getuid())


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to send as another user")
def test_a_command_from_another_users_process_names_that_user() -> None:
    port = 40001 + os.getpid() % 20000
    with follower(port) as s:
        pid = os.fork()
        if pid == 0:  # the child: another user, sending on the leader's line
            try:
                os.setgid(65534)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as other:
                    other.sendto(b"forged", follower_address(port, 1))
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert read(s) == (b"forged", 65534)  # the follower drops it: not its user (runtime._follow)


def test_no_credentials_is_no_user() -> None:
    assert sender_uid([]) is None
    assert sender_uid([(socket.SOL_SOCKET, socket.SCM_RIGHTS, b"\0" * 4)]) is None
