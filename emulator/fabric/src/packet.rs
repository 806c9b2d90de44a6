//! IPv4 packet inspection: the 5-tuple the fabric routes on, the ECN field it marks.
//!
//! Views are zero-copy (`pnet_packet`). The header checksum is verified on the way in; the
//! only writes are setting CE and decrementing the TTL, each of which keeps the checksum
//! right. A packet the fabric cannot forward is classified, never a panic.

use std::net::Ipv4Addr;

use pnet_packet::ip::IpNextHeaderProtocols;
use pnet_packet::ipv4::{self, Ipv4Packet, MutableIpv4Packet};
use pnet_packet::Packet as _;

/// The fields ECMP hashes on. Ports are 0 for protocols without them; ICMP echo uses its
/// identifier as the source port so that pings of one process stay on one path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub proto: u8,
    pub sport: u16,
    pub dport: u16,
}

/// ECN codepoints (RFC 3168).
pub const ECN_NOT_ECT: u8 = 0b00;
pub const ECN_ECT0: u8 = 0b10;
pub const ECN_CE: u8 = 0b11;

/// What the fabric needs from a packet's headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Headers {
    pub key: FlowKey,
    pub ecn: u8,
    /// IP total length (bytes).
    pub len: u16,
}

/// Why a buffer is not a forwardable packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unforwardable {
    /// Too short, inconsistent lengths, bad IHL, bad header checksum, fragment of a
    /// transport header.
    Malformed,
    /// Not IPv4 (IPv6 is not modelled yet).
    NotIpv4,
}

/// The IPv4 "more fragments" flag (of the 3 flag bits `Ipv4Packet::get_flags` reads).
const MORE_FRAGMENTS: u8 = 0b001;

/// Reads the headers of an IPv4 packet as a TUN (without packet-info header) gives it.
pub fn inspect(buf: &[u8]) -> Result<Headers, Unforwardable> {
    inspect_head(buf, buf.len())
}

/// `inspect` for a packet of `frame_len` bytes of which `buf` holds the first ones (at
/// least its IP header and the start of its transport header).
pub fn inspect_head(buf: &[u8], frame_len: usize) -> Result<Headers, Unforwardable> {
    let Some(&first) = buf.first() else {
        return Err(Unforwardable::Malformed);
    };
    if first >> 4 != 4 {
        return Err(if first >> 4 == 6 {
            Unforwardable::NotIpv4
        } else {
            Unforwardable::Malformed
        });
    }
    let ip = Ipv4Packet::new(buf).ok_or(Unforwardable::Malformed)?;
    let ihl = ip.get_header_length() as usize * 4;
    let len = ip.get_total_length() as usize;
    if ihl < 20 || len < ihl || len > frame_len || buf.len() < ihl {
        return Err(Unforwardable::Malformed);
    }
    // A switch drops a packet whose header is corrupt, as real ones do.
    if header_checksum(&buf[..ihl]) != ip.get_checksum() {
        return Err(Unforwardable::Malformed);
    }
    let proto = ip.get_next_level_protocol();
    let payload = &buf[ihl..len.min(buf.len())];
    // Every fragment of a datagram hashes on addresses alone, the first (whose payload
    // starts with the ports) as the later ones (which have none): they take one path, as
    // a switch's ECMP (and Linux's multipath hash) keeps them, and are counted as one
    // flow. Hashed on its ports, a first fragment went one way and the rest of its
    // datagram another.
    let fragment = ip.get_fragment_offset() != 0 || ip.get_flags() & MORE_FRAGMENTS != 0;
    let (sport, dport) = match proto {
        _ if fragment => (0, 0),
        IpNextHeaderProtocols::Tcp | IpNextHeaderProtocols::Udp => {
            if payload.len() < 4 {
                return Err(Unforwardable::Malformed);
            }
            (
                u16::from_be_bytes([payload[0], payload[1]]),
                u16::from_be_bytes([payload[2], payload[3]]),
            )
        }
        IpNextHeaderProtocols::Icmp => {
            if payload.len() < 8 {
                return Err(Unforwardable::Malformed);
            }
            (u16::from_be_bytes([payload[4], payload[5]]), 0)
        }
        _ => (0, 0),
    };
    Ok(Headers {
        key: FlowKey {
            src: ip.get_source(),
            dst: ip.get_destination(),
            proto: proto.0,
            sport,
            dport,
        },
        ecn: ip.get_ecn(),
        len: len as u16,
    })
}

/// Sets CE on an IPv4 packet already accepted by `inspect` and fixes the header checksum.
pub fn mark_ce(buf: &mut [u8]) {
    MutableIpv4Packet::new(buf)
        .expect("inspected packet")
        .set_ecn(ECN_CE);
    set_header_checksum(buf);
}

/// A router's entry in the Record Route option (RFC 791, option 7) of an IPv4 packet
/// accepted by `inspect` (`buf` holds at least its whole header): `addr` written where
/// the option's pointer says and the pointer moved on, the header checksum fixed, as a
/// router does for a packet it forwards (`ping -R` shows the hops). False, and nothing
/// changed, where the packet has no such option, it is full, or its options are not well
/// formed (a router would answer some of those with a parameter problem; the fabric
/// forwards them untouched).
pub fn record_route(buf: &mut [u8], addr: Ipv4Addr) -> bool {
    let Some((at, len)) = ip_options(buf).find(|&(at, _)| buf[at] == 7) else {
        return false;
    };
    // The pointer counts from the option's first byte, from 1; the route data starts at
    // 4, an address every 4 bytes.
    if len < 3 {
        return false;
    }
    let ptr = buf[at + 2] as usize;
    if ptr < 4 || ptr + 3 > len {
        return false;
    }
    let slot = at + ptr - 1;
    buf[slot..slot + 4].copy_from_slice(&addr.octets());
    buf[at + 2] = (ptr + 4) as u8;
    set_header_checksum(buf);
    true
}

/// A router's entry in the Internet Timestamp option (RFC 791, option 68) of an IPv4
/// packet accepted by `inspect`, as Linux's IP layer makes it on a packet it forwards or
/// receives (`ping -T` shows the stamps): `ms`, milliseconds since midnight UT, where the
/// option's pointer says, and the pointer moved on; with flag 1 (`ping -T tsandaddr`)
/// `addr` before it; with flag 3 (prespecified, `ping -T tsprespec`) only in an entry
/// that names `addr`. A full option counts the router in its overflow nibble instead (not
/// prespecified ones). The header checksum fixed. False, and nothing changed, where the
/// packet has no such option, it is full and its overflow at 15, the entry names another
/// router, or the option is not well formed (a router would answer some of those with a
/// parameter problem; the fabric forwards them untouched).
pub fn timestamp(buf: &mut [u8], addr: Option<Ipv4Addr>, ms: u32) -> bool {
    let Some((at, len)) = ip_options(buf).find(|&(at, _)| buf[at] == 68) else {
        return false;
    };
    // Type, length, pointer (from 1 at the type; entries from 5), overflow and flag.
    if len < 4 || (buf[at + 2] as usize) < 5 {
        return false;
    }
    let ptr = buf[at + 2] as usize;
    let (overflow, flag) = (buf[at + 3] >> 4, buf[at + 3] & 0x0f);
    if ptr > len {
        // Full.
        if flag == 3 || overflow == 15 {
            return false;
        }
        buf[at + 3] = ((overflow + 1) << 4) | flag;
        set_header_checksum(buf);
        return true;
    }
    if ptr + 3 > len {
        return false;
    }
    let entry = at + ptr - 1;
    let stamp = ms.to_be_bytes();
    match flag {
        0 => {
            buf[entry..entry + 4].copy_from_slice(&stamp);
            buf[at + 2] = (ptr + 4) as u8;
        }
        1 | 3 => {
            let Some(addr) = addr else {
                return false;
            };
            if ptr + 7 > len || (flag == 3 && ipv4_at(buf, entry) != addr) {
                return false;
            }
            buf[entry..entry + 4].copy_from_slice(&addr.octets());
            buf[entry + 4..entry + 8].copy_from_slice(&stamp);
            buf[at + 2] = (ptr + 8) as u8;
        }
        _ => return false,
    }
    set_header_checksum(buf);
    true
}

/// Milliseconds since midnight UT (RFC 791's timestamp) at `ns` nanoseconds since the Unix
/// epoch.
pub fn ms_since_midnight(ns: u64) -> u32 {
    ((ns / 1_000_000) % 86_400_000) as u32
}

/// The options in IPv4 packet `pkt`'s header, as the offset and length of each (its type
/// and length bytes included), no-ops left out: up to End of Options, or to the first one
/// not well formed (a length under 2, or past the header). Every walk of the options
/// (`record_route`, `echo_reply`, `fragment`) goes through here.
fn ip_options(pkt: &[u8]) -> impl Iterator<Item = (usize, usize)> + '_ {
    let ihl = ((pkt[0] & 0x0f) as usize * 4).min(pkt.len());
    let mut i = 20;
    std::iter::from_fn(move || loop {
        match *pkt[..ihl].get(i)? {
            0 => return None,
            1 => i += 1,
            _ => {
                let len = *pkt[..ihl].get(i + 1)? as usize;
                if len < 2 || i + len > ihl {
                    return None;
                }
                i += len;
                return Some((i - len, len));
            }
        }
    })
}

/// Recomputes the header checksum of an IPv4 packet (`buf` holds at least its whole
/// header, as its IHL says).
pub fn set_header_checksum(buf: &mut [u8]) {
    let ihl = (buf[0] & 0x0f) as usize * 4;
    let sum = header_checksum(&buf[..ihl]);
    buf[10..12].copy_from_slice(&sum.to_be_bytes());
}

/// The IPv4 header checksum `header` should carry (RFC 791: its checksum field taken as
/// zero). What `pnet`'s `ipv4::checksum` computes, without its generic byte-at-a-time
/// walk: it runs on every frame a GPU sends, and on every frame cut or coalesced.
pub fn header_checksum(header: &[u8]) -> u16 {
    let mut sum = 0u32;
    for (i, w) in header.chunks_exact(2).enumerate() {
        if i != 5 {
            sum += u16::from_be_bytes([w[0], w[1]]) as u32;
        }
    }
    !fold(sum)
}

/// Folds a 32-bit sum of 16-bit words into their 16-bit ones'-complement sum (RFC 1071).
pub fn fold(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// Rewrites the TTL of an IPv4 packet already accepted by `inspect` to `ttl`, updating
/// the header checksum incrementally (RFC 1624, eqn. 3). The model counts a packet's
/// router hops without touching its bytes and applies them with this where the bytes are
/// seen again (delivery, captures).
pub fn rewrite_ttl(buf: &mut [u8], ttl: u8) {
    let old = buf[8];
    if old == ttl {
        return;
    }
    buf[8] = ttl;
    // The 16-bit word holding the TTL (with the protocol) went from m to m'.
    let m = u16::from_be_bytes([old, buf[9]]) as u32;
    let m2 = u16::from_be_bytes([ttl, buf[9]]) as u32;
    let hc = u16::from_be_bytes([buf[10], buf[11]]) as u32;
    let sum = (!hc & 0xffff) + (!m & 0xffff) + m2;
    buf[10..12].copy_from_slice(&(!fold(sum)).to_be_bytes());
}

/// The ICMP "time exceeded in transit" a router at `router` sends back for `expired` (the
/// start of an IPv4 packet accepted by `inspect`, as it arrived: at least its header and
/// the 8 bytes after it, when the packet has them), or `None` where a router sends none
/// (RFC 1812, 4.3.2.7): for an ICMP error, for a fragment other than the first. It quotes
/// the header and the first 8 bytes of the payload (RFC 792: what the sender's stack
/// needs to find the socket: ports, or an echo's id and sequence).
pub fn time_exceeded(router: Ipv4Addr, expired: &[u8]) -> Option<Vec<u8>> {
    let ihl = (expired[0] & 0x0f) as usize * 4;
    let offset = u16::from_be_bytes([expired[6], expired[7]]) & 0x1fff;
    if offset != 0 {
        return None;
    }
    if expired[9] == 1 {
        // Only queries (echo, timestamp, information, address mask requests and replies)
        // get an answer.
        let kind = *expired.get(ihl)?;
        if !matches!(kind, 0 | 8 | 13 | 14 | 15 | 16 | 17 | 18) {
            return None;
        }
    }
    // Type 11, code 0 (TTL exceeded in transit), 4 unused bytes, the quote.
    Some(icmp_error(
        router,
        11,
        0,
        &expired[..(ihl + 8).min(expired.len())],
    ))
}

/// What a switch answers a packet addressed to it with (it runs no services).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToSwitch {
    /// An echo request: an echo reply (`echo_reply`).
    Echo,
    /// An ICMP timestamp request (type 13, `clockdiff`): a timestamp reply
    /// (`timestamp_reply`), as Linux's IP layer answers it.
    Timestamp,
    /// A TCP segment other than a reset: a reset (`tcp_reset`), as a host with the port
    /// closed sends.
    Reset,
    /// UDP, or a protocol other than ICMP and TCP: ICMP destination unreachable with this
    /// code (3: port, 2: protocol; `unreachable`).
    Unreachable(u8),
    /// Nothing: an ICMP message other than an echo or timestamp request (an error or a
    /// reply; a timestamp request without its originate timestamp), a TCP reset, a
    /// fragment (put back together first: `reassembly`).
    Nothing,
}

/// How a switch answers `pkt` (an IPv4 packet accepted by `inspect`) addressed to it.
pub fn to_switch(pkt: &[u8]) -> ToSwitch {
    let ihl = (pkt[0] & 0x0f) as usize * 4;
    let frag = u16::from_be_bytes([pkt[6], pkt[7]]) & 0x3fff;
    if frag != 0 || pkt.len() < ihl + 8 {
        return ToSwitch::Nothing;
    }
    match pkt[9] {
        1 if pkt[ihl] == 8 && pkt[ihl + 1] == 0 => ToSwitch::Echo,
        1 if pkt[ihl] == 13 && pkt[ihl + 1] == 0 && icmp_len(pkt) >= 12 => ToSwitch::Timestamp,
        1 => ToSwitch::Nothing,
        6 if pkt.len() >= ihl + 20 && pkt[ihl + 13] & 0x04 == 0 => ToSwitch::Reset,
        6 => ToSwitch::Nothing,
        17 => ToSwitch::Unreachable(3),
        _ => ToSwitch::Unreachable(2),
    }
}

/// ICMP destination unreachable (type 3) with `code` from `router` for `pkt`, quoting its
/// header and the first 8 bytes of its payload (RFC 792), TTL 64.
pub fn unreachable(router: Ipv4Addr, code: u8, pkt: &[u8]) -> Vec<u8> {
    let ihl = (pkt[0] & 0x0f) as usize * 4;
    icmp_error(router, 3, code, &pkt[..(ihl + 8).min(pkt.len())])
}

/// The reset a host whose port is closed answers the TCP segment `seg` with (RFC 9293,
/// 3.10.7.1): to an ACK, sequence number its acknowledgment and no ACK; otherwise
/// sequence 0 and an ACK of everything the segment occupied (its data, SYN and FIN).
pub fn tcp_reset(from: Ipv4Addr, seg: &[u8]) -> Vec<u8> {
    let ihl = (seg[0] & 0x0f) as usize * 4;
    let t = &seg[ihl..];
    let total = (u16::from_be_bytes([seg[2], seg[3]]) as usize).min(seg.len());
    let thl = ((t[12] >> 4) as usize * 4).max(20);
    let flags = t[13];
    let seq = u32::from_be_bytes([t[4], t[5], t[6], t[7]]);
    let ack = u32::from_be_bytes([t[8], t[9], t[10], t[11]]);
    let mut buf = ip_packet(40, 6, from, ipv4_at(seg, 12));
    buf[20..22].copy_from_slice(&t[2..4]);
    buf[22..24].copy_from_slice(&t[0..2]);
    buf[32] = 5 << 4;
    if flags & 0x10 != 0 {
        buf[24..28].copy_from_slice(&ack.to_be_bytes());
        buf[33] = 0x04;
    } else {
        let occupied = total.saturating_sub(ihl + thl) as u32
            + u32::from(flags & 0x02 != 0)
            + u32::from(flags & 0x01 != 0);
        buf[28..32].copy_from_slice(&seq.wrapping_add(occupied).to_be_bytes());
        buf[33] = 0x14;
    }
    let mut pseudo = Vec::with_capacity(12 + 20);
    pseudo.extend_from_slice(&buf[12..20]);
    pseudo.extend_from_slice(&[0, 6, 0, 20]);
    pseudo.extend_from_slice(&buf[20..40]);
    let sum = !ones_complement_sum(&pseudo);
    buf[36..38].copy_from_slice(&sum.to_be_bytes());
    buf
}

/// A zeroed IPv4 packet of `len` bytes from `src` to `dst`: a 20-byte header with
/// `proto`, TTL 64 and its checksum.
fn ip_packet(len: usize, proto: u8, src: Ipv4Addr, dst: Ipv4Addr) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    buf[0] = 0x45;
    buf[2..4].copy_from_slice(&(len as u16).to_be_bytes());
    buf[8] = 64;
    buf[9] = proto;
    buf[12..16].copy_from_slice(&src.octets());
    buf[16..20].copy_from_slice(&dst.octets());
    set_header_checksum(&mut buf);
    buf
}

/// The IPv4 address at `at` in `pkt`.
fn ipv4_at(pkt: &[u8], at: usize) -> Ipv4Addr {
    Ipv4Addr::new(pkt[at], pkt[at + 1], pkt[at + 2], pkt[at + 3])
}

/// An ICMP error of `kind` and `code` from `router` quoting `quoted`, back to its sender.
fn icmp_error(router: Ipv4Addr, kind: u8, code: u8, quoted: &[u8]) -> Vec<u8> {
    let mut buf = ip_packet(20 + 8 + quoted.len(), 1, router, ipv4_at(quoted, 12));
    buf[20] = kind;
    buf[21] = code;
    buf[28..].copy_from_slice(quoted);
    let sum = !ones_complement_sum(&buf[20..]);
    buf[22..24].copy_from_slice(&sum.to_be_bytes());
    buf
}

/// The length of IPv4 packet `pkt`'s ICMP message (its total length less its header).
fn icmp_len(pkt: &[u8]) -> usize {
    let ihl = (pkt[0] & 0x0f) as usize * 4;
    (u16::from_be_bytes([pkt[2], pkt[3]]) as usize)
        .min(pkt.len())
        .saturating_sub(ihl)
}

/// An ICMP reply of `icmp` (its checksum field filled here) from `from` to `request`'s
/// sender, TTL 64. Record Route and Timestamp options of the request come back in it (RFC
/// 1122, 3.2.2.6), what they hold so far kept: the switch adds itself as it sends the
/// reply (`Fabric::forward`), and the switches on the way back after it. Other options
/// are not echoed.
fn icmp_reply(from: Ipv4Addr, request: &[u8], icmp: &[u8]) -> Vec<u8> {
    let kept: Vec<u8> = [7, 68]
        .into_iter()
        .filter_map(|kind| ip_option(request, kind))
        .flatten()
        .copied()
        .collect();
    let opts = kept.len().div_ceil(4) * 4;
    let mut buf = ip_packet(20 + opts + icmp.len(), 1, from, ipv4_at(request, 12));
    if opts > 0 {
        buf[0] = 0x40 | ((20 + opts) / 4) as u8;
        buf[20..20 + kept.len()].copy_from_slice(&kept);
        set_header_checksum(&mut buf);
    }
    let at = 20 + opts;
    buf[at..].copy_from_slice(icmp);
    buf[at + 2..at + 4].fill(0);
    let sum = !ones_complement_sum(&buf[at..]);
    buf[at + 2..at + 4].copy_from_slice(&sum.to_be_bytes());
    buf
}

/// The echo reply to `request` (a whole echo request: `ToSwitch::Echo`), from `from` back
/// to its sender: the same identifier, sequence number and data (RFC 792), IP options
/// but Record Route and Timestamp left out (`icmp_reply`), TTL 64.
pub fn echo_reply(from: Ipv4Addr, request: &[u8]) -> Vec<u8> {
    let ihl = (request[0] & 0x0f) as usize * 4;
    let mut icmp = request[ihl..ihl + icmp_len(request)].to_vec();
    // Type 0 (echo reply), code 0.
    icmp[0] = 0;
    icmp_reply(from, request, &icmp)
}

/// The timestamp reply to `request` (an ICMP timestamp request: `ToSwitch::Timestamp`),
/// from `from` back to its sender, as Linux's `icmp_timestamp` makes it (RFC 792): type
/// 14, the request's identifier, sequence number and originate timestamp, and `ms`
/// (milliseconds since midnight UT: `ms_since_midnight`) as both the receive and the
/// transmit timestamp; 20 bytes of ICMP whatever the request carried after its originate
/// timestamp.
pub fn timestamp_reply(from: Ipv4Addr, request: &[u8], ms: u32) -> Vec<u8> {
    let ihl = (request[0] & 0x0f) as usize * 4;
    let mut icmp = [0u8; 20];
    icmp[0] = 14;
    icmp[4..12].copy_from_slice(&request[ihl + 4..ihl + 12]);
    icmp[12..16].copy_from_slice(&ms.to_be_bytes());
    icmp[16..20].copy_from_slice(&ms.to_be_bytes());
    icmp_reply(from, request, &icmp)
}

/// The IP option of type `kind` in IPv4 packet `pkt` (its whole header in `pkt`), type and
/// length bytes included (`ip_options`).
fn ip_option(pkt: &[u8], kind: u8) -> Option<&[u8]> {
    ip_options(pkt)
        .find(|&(at, _)| pkt[at] == kind)
        .map(|(at, len)| &pkt[at..at + len])
}

/// The header of a fragment after the first of IPv4 packet `pkt`: its first 20 bytes and
/// the options marked to be copied into every fragment (RFC 791: the type's top bit; not
/// Record Route or Timestamp), padded to whole words.
fn later_fragment_header(pkt: &[u8]) -> Vec<u8> {
    let mut h = pkt[..20].to_vec();
    for (at, len) in ip_options(pkt) {
        if pkt[at] & 0x80 != 0 {
            h.extend_from_slice(&pkt[at..at + len]);
        }
    }
    h.resize(h.len().div_ceil(4) * 4, 0);
    h[0] = 0x40 | (h.len() / 4) as u8;
    h
}

/// Whether IPv4 packet `pkt` is a fragment of a datagram ("more fragments", or an offset).
pub fn is_fragment(pkt: &[u8]) -> bool {
    u16::from_be_bytes([pkt[6], pkt[7]]) & 0x3fff != 0
}

/// IPv4 packet `pkt` (not a fragment) cut into fragments of at most `mtu` bytes (RFC 791:
/// its header on each, payloads a multiple of 8 bytes but the last, "more fragments" on
/// all but the last), as a host's IP layer sends a datagram longer than its link's MTU
/// (a switch's answer to a long ping); `pkt` alone if it fits. Its "don't fragment" is
/// left off the pieces: the switch's own stack sends them.
pub fn fragment(pkt: &[u8], mtu: usize) -> Vec<Vec<u8>> {
    let ihl = (pkt[0] & 0x0f) as usize * 4;
    let total = (u16::from_be_bytes([pkt[2], pkt[3]]) as usize).min(pkt.len());
    if total <= mtu || mtu < ihl + 8 {
        return vec![pkt[..total].to_vec()];
    }
    let data = &pkt[ihl..total];
    let later = later_fragment_header(pkt);
    let mut out = Vec::new();
    let mut at = 0;
    while at < data.len() {
        let head = if at == 0 { &pkt[..ihl] } else { &later[..] };
        let step = (mtu - head.len()) / 8 * 8;
        let chunk = &data[at..(at + step).min(data.len())];
        let mut f = Vec::with_capacity(head.len() + chunk.len());
        f.extend_from_slice(head);
        f.extend_from_slice(chunk);
        let len = f.len() as u16;
        f[2..4].copy_from_slice(&len.to_be_bytes());
        let more = if at + chunk.len() < data.len() {
            0x2000
        } else {
            0
        };
        let field = more | ((at / 8) as u16 & 0x1fff);
        f[6..8].copy_from_slice(&field.to_be_bytes());
        set_header_checksum(&mut f);
        out.push(f);
        at += chunk.len();
    }
    out
}

/// The 16-bit ones'-complement sum of `bytes` (an odd last byte padded with zero): what
/// an Internet checksum is the complement of, and 0xffff over data whose checksum is
/// right (RFC 1071).
pub fn ones_complement_sum(bytes: &[u8]) -> u16 {
    let mut sum = 0u32;
    for w in bytes.chunks(2) {
        sum += u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]) as u32;
    }
    fold(sum)
}

/// Builds an ICMP echo request of `len` bytes (`ping`'s), identifier `id`, sequence
/// `seq`, data counting up: for tests.
pub fn build_echo_request(src: Ipv4Addr, dst: Ipv4Addr, id: u16, seq: u16, len: usize) -> Vec<u8> {
    assert!(
        (28..=65_535).contains(&len),
        "IPv4/ICMP packet length {len}"
    );
    let mut buf = ip_packet(len, 1, src, dst);
    buf[6] = 0x40; // DF, as ping sets it
    set_header_checksum(&mut buf);
    buf[20] = 8;
    buf[24..26].copy_from_slice(&id.to_be_bytes());
    buf[26..28].copy_from_slice(&seq.to_be_bytes());
    for (i, b) in buf[28..].iter_mut().enumerate() {
        *b = i as u8;
    }
    let sum = !ones_complement_sum(&buf[20..]);
    buf[22..24].copy_from_slice(&sum.to_be_bytes());
    buf
}

/// Builds a minimal IPv4/UDP packet of `len` bytes: for tests and benchmarks.
pub fn build_udp(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    sport: u16,
    dport: u16,
    ecn: u8,
    len: usize,
) -> Vec<u8> {
    assert!((28..=65_535).contains(&len), "IPv4/UDP packet length {len}");
    let mut buf = vec![0u8; len];
    {
        let mut ip = MutableIpv4Packet::new(&mut buf).expect("length checked");
        ip.set_version(4);
        ip.set_header_length(5);
        ip.set_ecn(ecn);
        ip.set_total_length(len as u16);
        ip.set_ttl(64);
        ip.set_next_level_protocol(IpNextHeaderProtocols::Udp);
        ip.set_source(src);
        ip.set_destination(dst);
        let sum = ipv4::checksum(&ip.to_immutable());
        ip.set_checksum(sum);
    }
    buf[20..22].copy_from_slice(&sport.to_be_bytes());
    buf[22..24].copy_from_slice(&dport.to_be_bytes());
    buf[24..26].copy_from_slice(&((len - 20) as u16).to_be_bytes());
    buf
}

/// Sets the TTL of an IPv4 packet and recomputes its header checksum (for tests).
pub fn set_ttl(buf: &mut [u8], ttl: u8) {
    let mut ip = MutableIpv4Packet::new(buf).expect("an IPv4 header");
    ip.set_ttl(ttl);
    let sum = ipv4::checksum(&ip.to_immutable());
    ip.set_checksum(sum);
}

/// True when the IPv4 header checksum verifies.
pub fn checksum_ok(buf: &[u8]) -> bool {
    Ipv4Packet::new(buf).is_some_and(|ip| ipv4::checksum(&ip) == ip.get_checksum())
}

/// The payload after the IPv4 header (for tests).
pub fn payload(buf: &[u8]) -> Vec<u8> {
    Ipv4Packet::new(buf)
        .map(|p| p.payload().to_vec())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
    const B: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);

    #[test]
    fn reads_udp_five_tuple() {
        let p = build_udp(A, B, 1234, 80, 0b10, 100);
        let h = inspect(&p).unwrap();
        assert_eq!(
            h.key,
            FlowKey {
                src: A,
                dst: B,
                proto: 17,
                sport: 1234,
                dport: 80
            }
        );
        assert_eq!((h.ecn, h.len), (0b10, 100));
        assert!(checksum_ok(&p));
    }

    #[test]
    fn fragments_of_a_datagram_share_one_key() {
        // A 3-fragment datagram: the first (MF, offset 0, starting with the UDP ports),
        // a middle one (MF, offset 185 × 8) and the last (offset 370 × 8).
        let keys: Vec<FlowKey> = [(0b001, 0), (0b001, 185), (0, 370)]
            .into_iter()
            .map(|(flags, offset)| {
                let mut p = build_udp(A, B, 1234, 80, 0, 1500);
                let fo: u16 = (flags as u16) << 13 | offset;
                p[6..8].copy_from_slice(&fo.to_be_bytes());
                set_header_checksum(&mut p);
                inspect(&p).unwrap().key
            })
            .collect();
        assert_eq!(keys[0], keys[1]);
        assert_eq!(keys[1], keys[2]);
        assert_eq!((keys[0].sport, keys[0].dport, keys[0].proto), (0, 0, 17));
        // An unfragmented datagram (DF, or no flags) keeps its ports.
        for flags in [0b010u16, 0] {
            let mut p = build_udp(A, B, 1234, 80, 0, 1500);
            p[6..8].copy_from_slice(&(flags << 13).to_be_bytes());
            set_header_checksum(&mut p);
            assert_eq!(inspect(&p).unwrap().key.sport, 1234);
        }
    }

    #[test]
    fn time_exceeded_quotes_the_packet_and_checks_out() {
        let r = Ipv4Addr::new(198, 18, 0, 9);
        let mut p = build_udp(A, B, 33434, 33435, 0, 60);
        set_ttl(&mut p, 1);
        let icmp = time_exceeded(r, &p).unwrap();
        assert_eq!(icmp.len(), 20 + 8 + 28);
        let h = inspect(&icmp).unwrap();
        assert_eq!((h.key.src, h.key.dst, h.key.proto), (r, A, 1));
        assert!(checksum_ok(&icmp));
        assert_eq!((icmp[20], icmp[21]), (11, 0));
        // The ICMP checksum covers the ICMP header and the quote.
        assert_eq!(ones_complement_sum(&icmp[20..]), 0xffff);
        assert_eq!(&icmp[28..], &p[..28]);
        // An odd-length quote (a packet shorter than header + 8).
        let mut short = p[..25].to_vec();
        short[2..4].copy_from_slice(&25u16.to_be_bytes());
        set_header_checksum(&mut short);
        let icmp = time_exceeded(r, &short).unwrap();
        assert_eq!(ones_complement_sum(&icmp[20..]), 0xffff);
        // None for a later fragment, or for an ICMP error; an echo request gets one.
        let mut frag = p.clone();
        frag[6..8].copy_from_slice(&185u16.to_be_bytes());
        assert!(time_exceeded(r, &frag).is_none());
        let mut err = icmp.clone();
        set_ttl(&mut err, 1);
        assert!(time_exceeded(r, &err).is_none());
        let mut echo = err;
        echo[20] = 8;
        assert!(time_exceeded(r, &echo).is_some());
    }

    #[test]
    fn an_echo_reply_answers_its_request() {
        let sw = Ipv4Addr::new(198, 18, 0, 9);
        let req = build_echo_request(A, sw, 0x1234, 7, 84);
        assert!(checksum_ok(&req));
        assert_eq!(ones_complement_sum(&req[20..]), 0xffff);
        assert_eq!(to_switch(&req), ToSwitch::Echo);
        let rep = echo_reply(sw, &req);
        assert_eq!(rep.len(), 84);
        let h = inspect(&rep).unwrap();
        assert_eq!((h.key.src, h.key.dst, h.key.proto), (sw, A, 1));
        assert!(checksum_ok(&rep));
        assert_eq!(ones_complement_sum(&rep[20..]), 0xffff);
        assert_eq!((rep[20], rep[21]), (0, 0));
        // Identifier, sequence number and data as sent.
        assert_eq!(&rep[24..], &req[24..]);
        // A reply or a fragment gets no answer; UDP a port unreachable.
        assert_eq!(to_switch(&rep), ToSwitch::Nothing);
        let mut frag = req.clone();
        frag[6..8].copy_from_slice(&0x2000u16.to_be_bytes());
        assert_eq!(to_switch(&frag), ToSwitch::Nothing);
        let udp = build_udp(A, sw, 1, 2, 0, 60);
        assert_eq!(to_switch(&udp), ToSwitch::Unreachable(3));
        let un = unreachable(sw, 3, &udp);
        let h = inspect(&un).unwrap();
        assert_eq!((h.key.src, h.key.dst, h.key.proto), (sw, A, 1));
        assert_eq!((un[20], un[21]), (3, 3));
        assert!(checksum_ok(&un));
        assert_eq!(ones_complement_sum(&un[20..]), 0xffff);
        assert_eq!(&un[28..], &udp[..28]);
        // Options in the request are not echoed in the reply's header.
        let mut opt = vec![0x46];
        opt.extend_from_slice(&req[1..20]);
        opt.extend_from_slice(&[1, 1, 1, 0]);
        opt.extend_from_slice(&req[20..]);
        opt[2..4].copy_from_slice(&(88u16).to_be_bytes());
        set_header_checksum(&mut opt);
        let rep = echo_reply(sw, &opt);
        assert_eq!(rep.len(), 84);
        assert_eq!(&rep[24..], &req[24..]);
        assert_eq!(ones_complement_sum(&rep[20..]), 0xffff);
        // A Record Route is: the route so far, its pointer where it was (the switch adds
        // itself as it sends the reply), padded to a word.
        let mut rr = vec![0x48];
        rr.extend_from_slice(&req[1..20]);
        rr.extend_from_slice(&[7, 11, 8, 198, 18, 0, 1, 0, 0, 0, 0, 0]);
        rr.extend_from_slice(&req[20..]);
        rr[2..4].copy_from_slice(&(96u16).to_be_bytes());
        set_header_checksum(&mut rr);
        let rep = echo_reply(sw, &rr);
        assert_eq!((rep.len(), rep[0]), (96, 0x48));
        assert!(checksum_ok(&rep));
        assert_eq!(&rep[20..31], &rr[20..31]);
        assert_eq!(rep[31], 0, "padding: end of options");
        assert_eq!(&rep[36..], &req[24..]);
        assert_eq!(ones_complement_sum(&rep[32..]), 0xffff);
        assert!(record_route(&mut rep.clone(), sw));
        // In fragments, only the first keeps it (RFC 791: not a copied option); the
        // pieces still join to the reply's data.
        let mut long = rr[..32].to_vec();
        long.extend(std::iter::repeat_n(7u8, 3000));
        let n = long.len() as u16;
        long[2..4].copy_from_slice(&n.to_be_bytes());
        set_header_checksum(&mut long);
        let pieces = fragment(&long, 1500);
        assert_eq!(pieces.len(), 3);
        assert_eq!(pieces[0][0], 0x48);
        assert!(pieces[1..].iter().all(|p| p[0] == 0x45 && checksum_ok(p)));
        let mut joined = Vec::new();
        for p in &pieces {
            let ihl = (p[0] & 0x0f) as usize * 4;
            let off = (u16::from_be_bytes([p[6], p[7]]) & 0x1fff) as usize * 8;
            assert_eq!(off, joined.len());
            assert!(p.len() <= 1500);
            joined.extend_from_slice(&p[ihl..]);
        }
        assert_eq!(joined, long[32..]);
        // A copied option (type 0x83, loose source route's kind with the top bit) goes
        // into every piece.
        let mut lsrr = long.clone();
        lsrr[20..24].copy_from_slice(&[0x83, 3, 4, 0]);
        set_header_checksum(&mut lsrr);
        let pieces = fragment(&lsrr, 1500);
        assert!(pieces[1..]
            .iter()
            .all(|p| p[0] == 0x46 && p[20..24] == [0x83, 3, 4, 0]));
    }

    /// A TCP segment of `data` bytes from A:40000 to `to`:22 with `flags`.
    fn tcp(to: Ipv4Addr, flags: u8, seq: u32, ack: u32, data: usize) -> Vec<u8> {
        let mut p = build_udp(A, to, 40000, 22, 0, 40 + data);
        p[9] = 6;
        set_header_checksum(&mut p);
        p[24..28].copy_from_slice(&seq.to_be_bytes());
        p[28..32].copy_from_slice(&ack.to_be_bytes());
        p[32] = 5 << 4;
        p[33] = flags;
        p
    }

    #[test]
    fn a_closed_port_answers_tcp_with_a_reset() {
        let sw = Ipv4Addr::new(198, 18, 0, 9);
        // A SYN: RST|ACK acknowledging it, sequence 0, ports swapped.
        let syn = tcp(sw, 0x02, 1000, 0, 0);
        assert_eq!(to_switch(&syn), ToSwitch::Reset);
        let rst = tcp_reset(sw, &syn);
        let h = inspect(&rst).unwrap();
        assert_eq!((h.key.src, h.key.dst, h.key.proto), (sw, A, 6));
        assert_eq!((h.key.sport, h.key.dport), (22, 40000));
        assert!(checksum_ok(&rst));
        assert_eq!(rst[33], 0x14);
        assert_eq!(u32::from_be_bytes([rst[24], rst[25], rst[26], rst[27]]), 0);
        assert_eq!(
            u32::from_be_bytes([rst[28], rst[29], rst[30], rst[31]]),
            1001
        );
        // The TCP checksum over the pseudo-header and the segment.
        let mut pseudo = rst[12..20].to_vec();
        pseudo.extend_from_slice(&[0, 6, 0, 20]);
        pseudo.extend_from_slice(&rst[20..]);
        assert_eq!(ones_complement_sum(&pseudo), 0xffff);
        // An ACK with 100 bytes: a bare RST at the acknowledged sequence number.
        let seg = tcp(sw, 0x18, 5000, 777, 100);
        let rst = tcp_reset(sw, &seg);
        assert_eq!(rst[33], 0x04);
        assert_eq!(
            u32::from_be_bytes([rst[24], rst[25], rst[26], rst[27]]),
            777
        );
        // A FIN with 10 bytes and no ACK: acknowledged through the FIN.
        let rst = tcp_reset(sw, &tcp(sw, 0x01, 5000, 0, 10));
        assert_eq!(
            u32::from_be_bytes([rst[28], rst[29], rst[30], rst[31]]),
            5011
        );
        // A reset is never answered; another protocol gets a protocol unreachable.
        assert_eq!(to_switch(&tcp(sw, 0x04, 1, 0, 0)), ToSwitch::Nothing);
        let mut gre = build_udp(A, sw, 1, 2, 0, 60);
        gre[9] = 47;
        set_header_checksum(&mut gre);
        assert_eq!(to_switch(&gre), ToSwitch::Unreachable(2));
    }

    #[test]
    fn marking_ce_keeps_checksum_right() {
        let mut p = build_udp(A, B, 1, 2, 0b01, 60);
        mark_ce(&mut p);
        assert_eq!(inspect(&p).unwrap().ecn, ECN_CE);
        assert!(checksum_ok(&p));
    }

    #[test]
    fn ttl_rewrite_keeps_checksum_right() {
        for ttl in [2u8, 64, 128, 255] {
            for proto_len in [28usize, 60, 1500] {
                let mut p = build_udp(A, B, 1, 2, 0b10, proto_len);
                set_ttl(&mut p, ttl);
                rewrite_ttl(&mut p, ttl - 1);
                assert_eq!(p[8], ttl - 1);
                assert!(checksum_ok(&p), "ttl {ttl}");
            }
        }
        // Several hops at once give the bytes hop by hop gives.
        for (from, to) in [(64u8, 61u8), (255, 1), (2, 1), (128, 0)] {
            let mut a = build_udp(A, B, 7, 9, 0b10, 100);
            set_ttl(&mut a, from);
            let mut b = a.clone();
            rewrite_ttl(&mut a, to);
            for _ in to..from {
                let t = b[8] - 1;
                rewrite_ttl(&mut b, t);
            }
            assert_eq!((a[8], checksum_ok(&a)), (to, true));
            assert_eq!(a, b, "{from} -> {to}");
        }
    }

    /// A UDP packet with IP options `opts` (a multiple of 4 bytes) after its 20 bytes.
    fn udp_with_options(opts: &[u8]) -> Vec<u8> {
        let mut p = build_udp(
            Ipv4Addr::new(198, 18, 0, 1),
            Ipv4Addr::new(198, 18, 0, 2),
            1,
            2,
            0,
            36,
        );
        let body = p.split_off(20);
        p.extend_from_slice(opts);
        p.extend_from_slice(&body);
        p[0] = 0x40 | (5 + opts.len() / 4) as u8;
        let total = p.len() as u16;
        p[2..4].copy_from_slice(&total.to_be_bytes());
        set_header_checksum(&mut p);
        assert!(inspect(&p).is_ok());
        p
    }

    #[test]
    fn a_timestamp_request_gets_the_switchs_clock() {
        let sw = Ipv4Addr::new(198, 18, 0, 9);
        // Type 13, code 0, id 0x1234, seq 7, originate 1000, receive and transmit 0.
        let mut req = ip_packet(40, 1, A, sw);
        req[20] = 13;
        req[24..28].copy_from_slice(&[0x12, 0x34, 0, 7]);
        req[28..32].copy_from_slice(&1000u32.to_be_bytes());
        let sum = !ones_complement_sum(&req[20..]);
        req[22..24].copy_from_slice(&sum.to_be_bytes());
        assert_eq!(to_switch(&req), ToSwitch::Timestamp);
        let rep = timestamp_reply(sw, &req, 86_399_999);
        let h = inspect(&rep).unwrap();
        assert_eq!((h.key.src, h.key.dst, h.key.proto), (sw, A, 1));
        assert!(checksum_ok(&rep));
        assert_eq!(ones_complement_sum(&rep[20..]), 0xffff);
        assert_eq!((rep.len(), rep[20], rep[21]), (40, 14, 0));
        assert_eq!(
            &rep[24..32],
            &req[24..32],
            "identifier, sequence, originate"
        );
        assert_eq!(&rep[32..36], &86_399_999u32.to_be_bytes(), "receive");
        assert_eq!(&rep[36..40], &86_399_999u32.to_be_bytes(), "transmit");
        // A reply gets nothing; nor a request without its originate timestamp.
        assert_eq!(to_switch(&rep), ToSwitch::Nothing);
        let mut short = ip_packet(28 + 3, 1, A, sw);
        short[20] = 13;
        assert_eq!(to_switch(&short), ToSwitch::Nothing);
    }

    #[test]
    fn timestamp_stamps_as_a_linux_router_does() {
        let a = Ipv4Addr::new(198, 18, 0, 9);
        let b = Ipv4Addr::new(198, 18, 0, 10);
        // Timestamps only, room for 2 (length 12), as `ping -T tsonly` sends it (shorter).
        let mut p = udp_with_options(&[68, 12, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert!(timestamp(&mut p, Some(a), 0x0102_0304));
        assert_eq!((&p[24..28], p[22]), (&[1, 2, 3, 4][..], 9));
        assert!(timestamp(&mut p, None, 7));
        assert_eq!((&p[28..32], p[22]), (&[0, 0, 0, 7][..], 13));
        assert!(checksum_ok(&p));
        // Full: the overflow counts the router, up to 15, then untouched.
        for n in 1..=15u8 {
            assert!(timestamp(&mut p, Some(a), 9));
            assert_eq!(p[23], n << 4);
        }
        let full = p.clone();
        assert!(!timestamp(&mut p, Some(a), 9));
        assert_eq!(p, full);
        assert!(checksum_ok(&p));
        // Addresses and timestamps: both, 8 bytes an entry; none without an address.
        let mut p =
            udp_with_options(&[68, 20, 5, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        let before = p.clone();
        assert!(!timestamp(&mut p, None, 5));
        assert_eq!(p, before);
        assert!(timestamp(&mut p, Some(a), 5));
        assert_eq!(
            (&p[24..28], &p[28..32], p[22]),
            (&a.octets()[..], &[0, 0, 0, 5][..], 13)
        );
        assert!(timestamp(&mut p, Some(b), 6));
        assert_eq!(
            (&p[32..36], &p[36..40], p[22]),
            (&b.octets()[..], &[0, 0, 0, 6][..], 21)
        );
        assert!(checksum_ok(&p));
        // Prespecified: only the router named next stamps; full ones count no overflow.
        let mut o = vec![68, 20, 5, 3];
        o.extend_from_slice(&b.octets());
        o.extend_from_slice(&[0; 4]);
        o.extend_from_slice(&a.octets());
        o.extend_from_slice(&[0; 4]);
        let mut p = udp_with_options(&o);
        let before = p.clone();
        assert!(!timestamp(&mut p, Some(a), 5));
        assert_eq!(p, before);
        assert!(timestamp(&mut p, Some(b), 5));
        assert!(timestamp(&mut p, Some(a), 6));
        assert_eq!(
            (&p[28..32], &p[36..40], p[22]),
            (&[0, 0, 0, 5][..], &[0, 0, 0, 6][..], 21)
        );
        let full = p.clone();
        assert!(!timestamp(&mut p, Some(a), 7));
        assert_eq!(p, full);
        // Not well formed (a pointer below the entries, a length under 4, a half entry
        // left), other flags, no option: untouched.
        for opts in [
            vec![68, 12, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            vec![68, 3, 5, 0],
            vec![68, 10, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            vec![68, 16, 13, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            vec![68, 12, 5, 2, 0, 0, 0, 0, 0, 0, 0, 0],
            vec![1, 1, 1, 1],
        ] {
            let mut p = udp_with_options(&opts);
            let before = p.clone();
            assert!(!timestamp(&mut p, Some(a), 5), "{opts:?}");
            assert_eq!(p, before, "{opts:?}");
        }
        assert_eq!(ms_since_midnight(86_400_000_000_000 + 1_500_000), 1);
    }

    #[test]
    fn record_route_takes_a_routers_address_where_the_option_has_room() {
        let a = Ipv4Addr::new(198, 18, 0, 9);
        // IHL 8: NOP, then Record Route with room for 2 (length 11), then End.
        let mut p = build_udp(
            Ipv4Addr::new(198, 18, 0, 1),
            Ipv4Addr::new(198, 18, 0, 2),
            1,
            2,
            0,
            36,
        );
        let body = p.split_off(20);
        p.extend_from_slice(&[1, 7, 11, 4, 0, 0, 0, 0, 0, 0, 0, 0]);
        p.extend_from_slice(&body);
        p[0] = 0x48;
        let total = p.len() as u16;
        p[2..4].copy_from_slice(&total.to_be_bytes());
        set_header_checksum(&mut p);
        assert!(inspect(&p).is_ok());
        assert!(record_route(&mut p, a));
        assert_eq!((&p[24..28], p[23]), (&a.octets()[..], 8));
        assert!(record_route(&mut p, Ipv4Addr::new(198, 18, 0, 10)));
        assert_eq!((p[28..32].to_vec(), p[23]), (vec![198, 18, 0, 10], 12));
        assert!(checksum_ok(&p));
        // Full: forwarded untouched.
        let full = p.clone();
        assert!(!record_route(&mut p, a));
        assert_eq!(p, full);
        // No options, other options, options that run past the header, a pointer below
        // the route data: untouched.
        let mut plain = build_udp(
            Ipv4Addr::new(198, 18, 0, 1),
            Ipv4Addr::new(198, 18, 0, 2),
            1,
            2,
            0,
            36,
        );
        let before = plain.clone();
        assert!(!record_route(&mut plain, a));
        assert_eq!(plain, before);
        for opts in [
            [68, 12, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0], // timestamp: not ours to fill
            [1, 7, 40, 4, 0, 0, 0, 0, 0, 0, 0, 0],  // longer than the header
            [1, 7, 11, 3, 0, 0, 0, 0, 0, 0, 0, 0],  // pointer into the option's head
            [1, 7, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0],   // a length of 0
            [0, 7, 11, 4, 0, 0, 0, 0, 0, 0, 0, 0],  // after End of Options
            [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 7, 2],   // no room for a pointer, at the end
        ] {
            let mut q = full.clone();
            q[20..32].copy_from_slice(&opts);
            set_header_checksum(&mut q);
            let before = q.clone();
            assert!(!record_route(&mut q, a), "{opts:?}");
            assert_eq!(q, before, "{opts:?}");
            // The header alone (a packet of a protocol without ports may carry nothing
            // after it; a switch forwards it): nothing read past it.
            let mut bare = q[..32].to_vec();
            bare[2..4].copy_from_slice(&32u16.to_be_bytes());
            bare[9] = 253;
            set_header_checksum(&mut bare);
            assert!(inspect(&bare).is_ok());
            assert!(!record_route(&mut bare, a), "{opts:?}");
        }
    }

    #[test]
    fn header_checksum_is_pnets_for_any_header() {
        let mut rng = crate::rng::Rng::new(7, 0);
        for ihl in 5..=15usize {
            for _ in 0..200 {
                let mut h: Vec<u8> = (0..ihl * 4).map(|_| rng.below(256) as u8).collect();
                h[0] = 0x40 | ihl as u8;
                let ip = Ipv4Packet::new(&h).unwrap();
                assert_eq!(header_checksum(&h), ipv4::checksum(&ip), "{h:02x?}");
            }
        }
    }

    #[test]
    fn bad_header_checksum_is_malformed() {
        let mut p = build_udp(A, B, 1, 2, 0, 60);
        p[11] ^= 0x01;
        assert_eq!(inspect(&p), Err(Unforwardable::Malformed));
        // Corrupting a header field (not the checksum) is caught as well.
        let mut p = build_udp(A, B, 1, 2, 0, 60);
        p[15] ^= 0x10; // source address
        assert_eq!(inspect(&p), Err(Unforwardable::Malformed));
    }

    #[test]
    fn rejects_what_it_cannot_forward() {
        assert_eq!(inspect(&[]), Err(Unforwardable::Malformed));
        assert_eq!(inspect(&[0x60; 40]), Err(Unforwardable::NotIpv4));
        let mut p = build_udp(A, B, 1, 2, 0, 60);
        p[3] = 200; // total length beyond the buffer
        assert_eq!(inspect(&p), Err(Unforwardable::Malformed));
        let p = build_udp(A, B, 1, 2, 0, 60);
        assert_eq!(inspect(&p[..22]), Err(Unforwardable::Malformed));
        let mut p = build_udp(A, B, 1, 2, 0, 60);
        p[0] = 0x43; // IHL 3
        assert_eq!(inspect(&p), Err(Unforwardable::Malformed));
    }
}
