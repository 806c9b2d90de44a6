"""Bytes through the fabric, checked: `recv PORT SEED N` accepts one connection and
checks that it carries exactly the N pseudo-random bytes of SEED; `send HOST PORT SEED N`
sends them. The receiver prints what it got and exits 1 on any difference (TCP's own
checksum does not guard a fabric that writes partial checksums: the receiving stack
trusts them)."""
import hashlib
import random
import socket
import sys


def stream(seed, n):
    rng = random.Random(seed)
    left = n
    while left:
        k = min(left, 1 << 20)
        yield rng.randbytes(k)
        left -= k


def main():
    role = sys.argv[1]
    if role == "recv":
        port, seed, n = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
        want = hashlib.sha256()
        for chunk in stream(seed, n):
            want.update(chunk)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        s.listen(1)
        c, peer = s.accept()
        got = hashlib.sha256()
        total = 0
        while True:
            b = c.recv(1 << 20)
            if not b:
                break
            got.update(b)
            total += len(b)
        ok = total == n and got.digest() == want.digest()
        print(f"{'intact' if ok else 'CORRUPT'} {total} of {n} bytes from {peer[0]}")
        sys.exit(0 if ok else 1)
    host, port, seed, n = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    c = socket.create_connection((host, port))
    for chunk in stream(seed, n):
        c.sendall(chunk)
    c.close()


main()
