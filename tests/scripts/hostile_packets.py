"""Hostile packets from a GPU onto its interface through AF_PACKET, so any bytes at all
reach the fabric, not only what the kernel's IP stack builds: cut headers, lengths that
lie, bad checksums, options past the header, fragments, odd addresses, then 2,000 random
byte strings and 2,000 mutated packets (seeded). Usage: hostile_packets.py SRC DST.
Prints "sent N of M" (the kernel refuses a few, e.g. an empty one)."""
import socket, struct, random, sys

def csum(b):
    if len(b) % 2: b += b"\0"
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    while s >> 16: s = (s & 0xffff) + (s >> 16)
    return (~s) & 0xffff

def ip(src, dst, proto, payload, ihl=5, tot=None, ttl=64, flags_frag=0, ver=4, opts=b"", good_csum=True):
    tot = tot if tot is not None else ihl * 4 + len(payload)
    h = struct.pack("!BBHHHBBH4s4s", (ver << 4) | ihl, 0, tot & 0xffff, 1, flags_frag, ttl, proto, 0,
                    socket.inet_aton(src), socket.inet_aton(dst)) + opts
    h = h[: max(ihl * 4, 20)].ljust(ihl * 4, b"\0")
    c = csum(h) if good_csum else 0x1234
    h = h[:10] + struct.pack("!H", c) + h[12:]
    return h + payload

src, dst = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0800))
addr = ("cb0", 0x0800)
pk = []
pk.append(b"")                                   # nothing
pk.append(b"\x45")                               # one byte
pk.append(b"\x00" * 19)                          # short of a header
pk.append(b"\xff" * 60)                          # version 15
pk.append(ip(src, dst, 17, b"x" * 8, ver=6))     # version 6 in an IPv4 frame
pk.append(ip(src, dst, 6, b"\x00" * 5))          # TCP header cut short
pk.append(ip(src, dst, 6, b"\x00" * 12 + b"\xf0" + b"\x00" * 7))  # TCP offset 60 > 20
pk.append(ip(src, dst, 17, b"\x00\x01\x00\x02\xff\xff\x00\x00"))  # UDP length 65535
pk.append(ip(src, dst, 17, b"\x00\x01\x00\x02\x00\x03\x00\x00"))  # UDP length 3
pk.append(ip(src, dst, 17, b"x" * 8, ihl=15, opts=b"\x01" * 40))   # NOPs as options
pk.append(ip(src, dst, 17, b"x" * 8, ihl=6, opts=b"\x44\xff\x00\x00"))  # option longer than header
pk.append(ip(src, dst, 17, b"x" * 8, ihl=4))      # IHL below 5
pk.append(ip(src, dst, 17, b"x" * 8, ihl=15))     # IHL past the packet
pk.append(ip(src, dst, 17, b"x" * 40, tot=20))    # total length short of the bytes
pk.append(ip(src, dst, 17, b"x" * 8, tot=9000))   # total length past the bytes
pk.append(ip(src, dst, 17, b"x" * 8, tot=0))      # total length 0
pk.append(ip(src, dst, 17, b"x" * 8, good_csum=False))   # bad checksum
pk.append(ip(src, dst, 17, b"x" * 8, ttl=0))      # TTL 0
pk.append(ip(src, dst, 17, b"x" * 8, ttl=1))      # TTL 1
pk.append(ip(src, dst, 0, b"x" * 8))              # protocol 0
pk.append(ip(src, dst, 255, b"x" * 8))            # protocol 255
pk.append(ip(src, dst, 1, b"\x08"))               # ICMP cut short
pk.append(ip(src, dst, 17, b"x" * 8, flags_frag=0x2000))       # MF, offset 0
pk.append(ip(src, dst, 17, b"x" * 8, flags_frag=0x1fff))       # last offset, no MF
pk.append(ip(src, dst, 6, b"x" * 8, flags_frag=0x0001))        # TCP later fragment
pk.append(ip("10.0.0.1", dst, 17, b"x" * 8))      # source outside the pool
pk.append(ip(src, "255.255.255.255", 17, b"x" * 8))  # broadcast
pk.append(ip(src, "224.0.0.1", 17, b"x" * 8))     # multicast
pk.append(ip(src, "0.0.0.0", 17, b"x" * 8))       # zero
pk.append(ip(src, src, 17, b"x" * 8))             # to itself
pk.append(ip(dst, dst, 17, b"x" * 8))             # from the destination, to it
pk.append(ip(src, dst, 17, b"x" * 70000)[:65535]) # 64 KiB, total length wrapped
rnd = random.Random(1)
for _ in range(2000):                             # random bytes
    pk.append(bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(0, 200))))
for _ in range(2000):                             # random mutations of a good one
    b = bytearray(ip(src, dst, rnd.choice([1, 6, 17]), bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(0, 100)))))
    for _ in range(rnd.randrange(1, 4)):
        b[rnd.randrange(len(b))] = rnd.getrandbits(8)
    pk.append(bytes(b))
sent = 0
for p in pk:
    try:
        s.sendto(p, addr); sent += 1
    except OSError:
        pass
print("sent", sent, "of", len(pk))
