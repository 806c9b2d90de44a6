"""Two TCP flows to one GPU at once, one of them with 40 bytes of IP options (a
60-byte IP header): `server FILE` writes to FILE what each port received; `client HOST`
sends for 2 s on each and prints the bytes it sent per port."""
import socket
import sys
import threading
import time

PORTS = (7001, 7002)


def serve(port, got):
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind(("0.0.0.0", port))
    lst.listen(1)
    c, _ = lst.accept()
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        got[port] += len(b)


def send(host, port, options, sent):
    s = socket.socket()
    if options:
        s.setsockopt(socket.IPPROTO_IP, socket.IP_OPTIONS, bytes([1] * 39 + [0]))
    s.connect((host, port))
    data = b"x" * 65536
    end = time.time() + 2
    while time.time() < end:
        s.sendall(data)
        sent[port] += len(data)
    s.close()


if sys.argv[1] == "server":
    got = {p: 0 for p in PORTS}
    ts = [threading.Thread(target=serve, args=(p, got)) for p in PORTS]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    with open(sys.argv[2], "w") as out:
        out.write(" ".join(f"{p}={got[p]}" for p in PORTS))
else:
    sent = {p: 0 for p in PORTS}
    ts = [threading.Thread(target=send, args=(sys.argv[2], p, p == PORTS[0], sent)) for p in PORTS]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print(" ".join(f"{p}={sent[p]}" for p in PORTS))
