"""Whether a ZMQ connection to another machine still holds: heartbeats on the socket (a peer whose machine went
silent drops within the timeout) and a monitor of its connect and disconnect events. For the processes of a
deployment that spans machines (executor/multiproc.py's ranks, engine/dp_client.py's replicas, lmserve/headless.py)."""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

HEARTBEAT_MS = 2_000
HEARTBEAT_TIMEOUT_MS = 10_000


def heartbeats(sock: zmq.Socket) -> None:
    """ZMQ pings on the socket's connections (set before it binds or connects)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


class ConnectionWatch:
    """Whether a socket's connection, once made, dropped (nothing connected yet is not dropped: machines start in
    any order). Made before the socket binds or connects, so that it sees the first connection."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.connected = False
        self.dropped = False

    def poll(self) -> bool:
        """True once the connection dropped."""
        while not self.dropped and not self._monitor.closed and self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.dropped = True
        return self.dropped

    def close(self) -> None:
        if not self._monitor.closed:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
