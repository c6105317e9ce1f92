"""A TCP port forwarder, as Docker's userland proxy is one: listens on 127.0.0.1 and passes each
connection on to --to PORT. Run under the name docker-proxy (a symlink), it is what the process
listening on a published port looks like to the exporter.

    port_forwarder.py --to PORT      prints "port <n>" once it listens
"""
from __future__ import annotations

import argparse
import socket
import threading


def pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--to", type=int, required=True)
    to = parser.parse_args().to
    listener = socket.create_server(("127.0.0.1", 0))
    print("port", listener.getsockname()[1], flush=True)
    while True:
        client, _ = listener.accept()
        upstream = socket.create_connection(("127.0.0.1", to))
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pipe, args=(a, b), daemon=True).start()


if __name__ == "__main__":
    main()
