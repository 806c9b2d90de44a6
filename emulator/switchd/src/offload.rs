//! TUN offload: GPUs hand the daemon TCP super-packets of up to 64 KiB (TSO) and take
//! coalesced ones, while the fabric model keeps per-frame semantics.
//!
//! - **Ingress**: a super-packet (`virtio_net_hdr` with `gso_type` TCPv4) is cut into the
//!   frames the GPU's NIC would have sent (`segment`): MTU-sized, IP ids counting up, TCP
//!   sequence numbers advancing, FIN/PSH only on the last frame and CWR only on the first,
//!   each frame's IP header checksum recomputed and its TCP checksum left *partial* (the
//!   pseudo-header sum, as the sending kernel left it). The model then queues, serializes,
//!   drops and marks each frame on its own.
//! - **Egress**: frames due to the same GPU at once that continue one another (same flow,
//!   consecutive sequence numbers, same headers and ECN codepoint, full-sized but the last,
//!   no SYN/FIN/RST/URG) are written as one super-packet (`Coalesced`), as a NIC's GRO
//!   would hand them to the stack; a frame dropped or marked differently ends a run, so the
//!   receiver sees exactly the frames that survived, as they were.
//! - **Checksums**: TCP and UDP packets are written with `VIRTIO_NET_HDR_F_NEEDS_CSUM`
//!   (`CHECKSUM_PARTIAL`): the receiving stack, local to the box, trusts them, as it trusts
//!   a packet from loopback; no checksum is ever computed over payload bytes. The fabric
//!   does not corrupt packets (loss drops whole frames), so nothing is lost by that.
//!   Captures fill in real checksums on their copies (`fill_checksum`).

use std::fmt;
use std::io::IoSlice;
use std::ops::Range;
use std::sync::Arc;

use closbox_fabric::packet::{fold, set_header_checksum};
use closbox_fabric::Frame;

/// `struct virtio_net_hdr` (10 bytes, the host's byte order, as TUNs use it without
/// `TUNSETVNETLE`).
pub const VNET_HDR_LEN: usize = 10;

pub const F_NEEDS_CSUM: u8 = 1;
pub const GSO_NONE: u8 = 0;
pub const GSO_TCPV4: u8 = 1;
pub const GSO_ECN: u8 = 0x80;

const TCP: u8 = 6;
const UDP: u8 = 17;
const CWR: u8 = 0x80;
const URG: u8 = 0x20;
const ACK: u8 = 0x10;
const PSH: u8 = 0x08;
const RST: u8 = 0x04;
const SYN: u8 = 0x02;
const FIN: u8 = 0x01;

/// Largest IPv4 packet.
const MAX_IP: usize = 65535;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VnetHdr {
    pub flags: u8,
    pub gso_type: u8,
    pub hdr_len: u16,
    pub gso_size: u16,
    pub csum_start: u16,
    pub csum_offset: u16,
}

impl VnetHdr {
    pub fn parse(b: &[u8]) -> Option<VnetHdr> {
        let b: &[u8; VNET_HDR_LEN] = b.get(..VNET_HDR_LEN)?.try_into().ok()?;
        let u16_at = |i: usize| u16::from_ne_bytes([b[i], b[i + 1]]);
        Some(VnetHdr {
            flags: b[0],
            gso_type: b[1],
            hdr_len: u16_at(2),
            gso_size: u16_at(4),
            csum_start: u16_at(6),
            csum_offset: u16_at(8),
        })
    }

    pub fn bytes(&self) -> [u8; VNET_HDR_LEN] {
        let mut b = [0u8; VNET_HDR_LEN];
        b[0] = self.flags;
        b[1] = self.gso_type;
        b[2..4].copy_from_slice(&self.hdr_len.to_ne_bytes());
        b[4..6].copy_from_slice(&self.gso_size.to_ne_bytes());
        b[6..8].copy_from_slice(&self.csum_start.to_ne_bytes());
        b[8..10].copy_from_slice(&self.csum_offset.to_ne_bytes());
        b
    }
}

/// Why a super-packet could not be cut into frames (counted as malformed).
#[derive(Debug, PartialEq, Eq)]
pub enum SegmentError {
    /// A GSO type closbox does not take (it offers the TUNs TCPv4 only).
    GsoType(u8),
    /// Not an IPv4 TCP packet with whole headers, or a zero segment size.
    Headers,
}

impl fmt::Display for SegmentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SegmentError::GsoType(t) => write!(f, "GSO type {t} not offered"),
            SegmentError::Headers => f.write_str("not an IPv4/TCP super-packet"),
        }
    }
}

fn be16(b: &[u8], i: usize) -> u16 {
    u16::from_be_bytes([b[i], b[i + 1]])
}

fn be32(b: &[u8], i: usize) -> u32 {
    u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// The folded pseudo-header sum of an IPv4 packet's transport part of `len` bytes (what
/// a `CHECKSUM_PARTIAL` packet carries in its checksum field).
fn pseudo(ip: &[u8], proto: u8, len: usize) -> u16 {
    let sum = be16(ip, 12) as u32
        + be16(ip, 14) as u32
        + be16(ip, 16) as u32
        + be16(ip, 18) as u32
        + proto as u32
        + len as u32;
    fold(sum)
}

/// The header lengths of an IPv4 TCP packet that is not a fragment: (IP, TCP).
fn tcp_headers(p: &[u8]) -> Option<(usize, usize)> {
    if p.len() < 20 || p[0] >> 4 != 4 || p[9] != TCP {
        return None;
    }
    let ihl = (p[0] & 0x0f) as usize * 4;
    // A fragment (MF set or an offset) has no whole TCP header to speak of.
    if ihl < 20 || be16(p, 6) & 0x3fff != 0 || p.len() < ihl + 20 {
        return None;
    }
    let thl = (p[ihl + 12] >> 4) as usize * 4;
    (thl >= 20 && p.len() >= ihl + thl).then_some((ihl, thl))
}

/// Cuts what a TUN handed over (`buf[pkt]`, after its virtio header `hdr`) into the
/// frames the fabric carries, appended to `out`: each frame's headers are copied and
/// fixed up, its payload stays where it was read (a slice of `buf`, shared). A packet
/// without GSO (most often an ACK) is one frame, as it is (copied: it is at most an MTU).
/// A frame's headers, or such a packet, go into a buffer taken from `heads` when it has
/// one (`Frame::into_head`).
pub fn segment(
    hdr: &VnetHdr,
    buf: &Arc<Vec<u8>>,
    pkt: Range<usize>,
    out: &mut Vec<Frame>,
    heads: &mut Vec<Vec<u8>>,
) -> Result<(), SegmentError> {
    match hdr.gso_type & !GSO_ECN {
        GSO_NONE => {
            // An ACK or another packet without GSO, copied whole: into a reused head (one
            // longer than the head grows it, and is not kept for reuse after).
            let mut f = heads.pop().unwrap_or_default();
            f.clear();
            f.extend_from_slice(&buf[pkt]);
            out.push(Frame::from(f));
            return Ok(());
        }
        GSO_TCPV4 => {}
        t => return Err(SegmentError::GsoType(t)),
    }
    let p = &buf[pkt.clone()];
    let (ihl, thl) = tcp_headers(p).ok_or(SegmentError::Headers)?;
    let hl = ihl + thl;
    let mss = hdr.gso_size as usize;
    if mss == 0 {
        return Err(SegmentError::Headers);
    }
    let payload = pkt.start + hl..pkt.end;
    let n = payload.len().div_ceil(mss).max(1);
    // The whole buffer lives as long as any of its frames: each is charged a share.
    let share = buf.capacity().div_ceil(n);
    let (id0, seq0, flags) = (be16(p, 4), be32(p, ihl + 4), p[ihl + 13]);
    for i in 0..n {
        let start = (payload.start + i * mss).min(payload.end);
        let end = (start + mss).min(payload.end);
        let len = end - start;
        let mut f = heads.pop().unwrap_or_default();
        f.clear();
        f.extend_from_slice(&p[..hl]);
        f[2..4].copy_from_slice(&((hl + len) as u16).to_be_bytes());
        f[4..6].copy_from_slice(&id0.wrapping_add(i as u16).to_be_bytes());
        set_header_checksum(&mut f);
        let seq = seq0.wrapping_add((i * mss) as u32);
        f[ihl + 4..ihl + 8].copy_from_slice(&seq.to_be_bytes());
        let mut fl = flags;
        if i > 0 {
            fl &= !CWR;
        }
        if i + 1 < n {
            fl &= !(FIN | PSH);
        }
        f[ihl + 13] = fl;
        let check = pseudo(&f, TCP, thl + len);
        f[ihl + 16..ihl + 18].copy_from_slice(&check.to_be_bytes());
        out.push(Frame::split(f, Arc::clone(buf), start..end, share));
    }
    Ok(())
}

/// The virtio header for writing one frame: TCP and UDP (not fragments) as
/// `NEEDS_CSUM`, so that a partial checksum (from `segment`, or a GPU's own offload) is
/// taken as it is; anything else as complete.
pub fn single_hdr(p: &[u8]) -> VnetHdr {
    let mut h = VnetHdr::default();
    if p.len() >= 20 && p[0] >> 4 == 4 && be16(p, 6) & 0x3fff == 0 {
        let ihl = (p[0] & 0x0f) as usize * 4;
        let off: u16 = match p[9] {
            TCP => 16,
            UDP => 6,
            _ => return h,
        };
        if p.len() >= ihl + off as usize + 2 {
            h.flags = F_NEEDS_CSUM;
            h.csum_start = ihl as u16;
            h.csum_offset = off;
        }
    }
    h
}

/// How many of `frames` (all to one GPU, in order) continue the first one as one TCP
/// super-packet: at least 1.
pub fn mergeable_run<F: AsRef<Frame>>(frames: &[F]) -> usize {
    let first = frames[0].as_ref().head();
    let Some((ihl, thl)) = tcp_headers(first) else {
        return 1;
    };
    let hl = ihl + thl;
    let mss = frames[0].as_ref().len() - hl;
    let flags = first[ihl + 13];
    if mss == 0 || flags & (SYN | FIN | RST | URG | PSH) != 0 || flags & ACK == 0 {
        return 1;
    }
    let mut total = frames[0].as_ref().len();
    let mut seq = be32(first, ihl + 4).wrapping_add(mss as u32);
    let mut n = 1;
    for frame in &frames[1..] {
        let frame = frame.as_ref();
        let f = frame.head();
        // Headers of another size end the run before anything is read at the first
        // frame's offsets (a frame with fewer header bytes may be shorter than them).
        if tcp_headers(f) != Some((ihl, thl)) {
            break;
        }
        let len = frame.len() - hl;
        let fl = f[ihl + 13];
        let same = len > 0
            && len <= mss
            && total + len <= MAX_IP
            && be32(f, ihl + 4) == seq
            // TOS (ECN codepoint included), TTL, protocol, addresses, IP options (a
            // route recorded by other switches: `packet::record_route`).
            && f[1] == first[1]
            && f[8..10] == first[8..10]
            && f[12..ihl] == first[12..ihl]
            && f[6] & 0x40 == first[6] & 0x40
            // Ports, ack, window, options.
            && f[ihl..ihl + 4] == first[ihl..ihl + 4]
            && f[ihl + 8..ihl + 12] == first[ihl + 8..ihl + 12]
            && f[ihl + 14..ihl + 16] == first[ihl + 14..ihl + 16]
            && f[ihl + 20..hl] == first[ihl + 20..hl]
            && fl & !PSH == ACK;
        if !same {
            break;
        }
        n += 1;
        total += len;
        seq = seq.wrapping_add(len as u32);
        // A short frame or a push ends the run (it is its last frame).
        if len < mss || fl & PSH != 0 {
            break;
        }
    }
    n
}

/// The virtio header and the IP/TCP header of the super-packet that carries `frames` (a
/// run from `mergeable_run`, more than one): the first frame's headers with the total
/// length, the last frame's PSH, a partial checksum. The payloads (`payloads`) follow.
pub fn coalesced_headers<F: AsRef<Frame>>(frames: &[F]) -> (VnetHdr, Vec<u8>) {
    let first = frames[0].as_ref().head();
    let (ihl, thl) = tcp_headers(first).expect("a run starts with a TCP frame");
    let hl = ihl + thl;
    let total: usize = hl + frames.iter().map(|f| f.as_ref().len() - hl).sum::<usize>();
    let mut h = first[..hl].to_vec();
    h[2..4].copy_from_slice(&(total as u16).to_be_bytes());
    set_header_checksum(&mut h);
    let last = frames[frames.len() - 1].as_ref().head();
    h[ihl + 13] |= last[ihl + 13] & PSH;
    let check = pseudo(&h, TCP, total - ihl);
    h[ihl + 16..ihl + 18].copy_from_slice(&check.to_be_bytes());
    let mut gso_type = GSO_TCPV4;
    if first[ihl + 13] & CWR != 0 {
        gso_type |= GSO_ECN;
    }
    let v = VnetHdr {
        flags: F_NEEDS_CSUM,
        gso_type,
        hdr_len: hl as u16,
        gso_size: (frames[0].as_ref().len() - hl) as u16,
        csum_start: ihl as u16,
        csum_offset: 16,
    };
    (v, h)
}

/// The bytes of `frames` after their first `hl` (their payloads, in a run), appended to
/// `out` as slices: payloads that lie next to each other in one shared buffer (frames
/// cut from one read) become one slice.
pub fn payloads<'a, F: AsRef<Frame>>(frames: &'a [F], hl: usize, out: &mut Vec<IoSlice<'a>>) {
    // The shared buffer and range of the last slice pushed, if it was a shared body.
    let mut last: Option<(&'a Arc<Vec<u8>>, Range<usize>)> = None;
    for f in frames {
        let f: &'a Frame = f.as_ref();
        let head = f.head();
        if head.len() > hl {
            out.push(IoSlice::new(&head[hl..]));
            last = None;
        }
        let Some((buf, r)) = f.shared() else {
            continue;
        };
        // A head shorter than `hl` (not made by `segment`) ends in the body.
        let r = r.start + hl.saturating_sub(head.len()).min(r.len())..r.end;
        match &mut last {
            Some((b, lr)) if Arc::ptr_eq(b, buf) && lr.end == r.start => {
                lr.end = r.end;
                *out.last_mut().expect("the slice extended") = IoSlice::new(&buf[lr.clone()]);
            }
            _ => {
                out.push(IoSlice::new(&buf[r.clone()]));
                last = Some((buf, r));
            }
        }
    }
}

/// Writes the real TCP or UDP checksum into a whole packet whose checksum may be partial
/// (for captures: what the wire would carry). Leaves other packets, fragments and
/// truncated copies alone.
pub fn fill_checksum(p: &mut [u8]) {
    if p.len() < 20 || p[0] >> 4 != 4 || be16(p, 6) & 0x3fff != 0 {
        return;
    }
    let ihl = (p[0] & 0x0f) as usize * 4;
    let total = be16(p, 2) as usize;
    if total != p.len() || total < ihl + 8 {
        return;
    }
    let off = match p[9] {
        TCP if total >= ihl + 20 => 16,
        UDP => 6,
        _ => return,
    };
    if p[9] == UDP && be16(p, ihl + 6) == 0 {
        return; // no checksum
    }
    let addr = |i: usize| std::net::Ipv4Addr::new(p[i], p[i + 1], p[i + 2], p[i + 3]);
    let (src, dst) = (addr(12), addr(16));
    let proto = pnet_packet::ip::IpNextHeaderProtocol(p[9]);
    // pnet skips the checksum word itself (`off / 2` in 16-bit words).
    let mut c = pnet_packet::util::ipv4_checksum(&p[ihl..], off / 2, &[], &src, &dst, proto);
    if p[9] == UDP && c == 0 {
        c = 0xffff;
    }
    p[ihl + off..ihl + off + 2].copy_from_slice(&c.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An IPv4/TCP packet 10.0.0.1:1000 -> 10.0.0.2:2000 with `payload`, TCP timestamps
    /// (12 bytes of options), flags `flags`, sequence `seq`, a full checksum.
    fn tcp(seq: u32, flags: u8, tos: u8, payload: &[u8]) -> Vec<u8> {
        let thl = 32;
        let mut p = vec![0u8; 20 + thl];
        p[0] = 0x45;
        p[1] = tos;
        p[2..4].copy_from_slice(&((20 + thl + payload.len()) as u16).to_be_bytes());
        p[4..6].copy_from_slice(&0x1234u16.to_be_bytes());
        p[6] = 0x40; // DF
        p[8] = 64;
        p[9] = TCP;
        p[12..16].copy_from_slice(&[10, 0, 0, 1]);
        p[16..20].copy_from_slice(&[10, 0, 0, 2]);
        p[20..22].copy_from_slice(&1000u16.to_be_bytes());
        p[22..24].copy_from_slice(&2000u16.to_be_bytes());
        p[24..28].copy_from_slice(&seq.to_be_bytes());
        p[28..32].copy_from_slice(&77u32.to_be_bytes());
        p[32] = (thl as u8 / 4) << 4;
        p[33] = flags;
        p[34..36].copy_from_slice(&512u16.to_be_bytes());
        p[40..52].copy_from_slice(&[1, 1, 8, 10, 0, 0, 0, 9, 0, 0, 0, 3]);
        p.extend_from_slice(payload);
        set_header_checksum(&mut p);
        fill_checksum(&mut p);
        p
    }

    fn checksums_ok(p: &[u8]) -> bool {
        let mut q = p.to_vec();
        set_header_checksum(&mut q);
        fill_checksum(&mut q);
        q == p
    }

    fn gso(mss: u16, cwr: bool) -> VnetHdr {
        VnetHdr {
            flags: F_NEEDS_CSUM,
            gso_type: GSO_TCPV4 | if cwr { GSO_ECN } else { 0 },
            hdr_len: 52,
            gso_size: mss,
            csum_start: 20,
            csum_offset: 16,
        }
    }

    /// `segment` on `sp` as a TUN read holds it (after a virtio header).
    fn cut(h: &VnetHdr, sp: &[u8]) -> Result<Vec<Frame>, SegmentError> {
        let mut buf = vec![0u8; VNET_HDR_LEN];
        buf.extend_from_slice(sp);
        let buf = Arc::new(buf);
        let mut out = Vec::new();
        segment(h, &buf, VNET_HDR_LEN..buf.len(), &mut out, &mut Vec::new()).map(|()| out)
    }

    /// What `write_job` writes for a run: headers, then the payloads.
    fn joined(frames: &[&Frame]) -> Vec<u8> {
        let (_, mut h) = coalesced_headers(frames);
        let hl = h.len();
        let mut parts = Vec::new();
        payloads(frames, hl, &mut parts);
        for p in parts {
            h.extend_from_slice(&p);
        }
        h
    }

    #[test]
    fn the_virtio_header_round_trips() {
        let h = gso(1448, true);
        assert_eq!(VnetHdr::parse(&h.bytes()), Some(h));
        assert_eq!(VnetHdr::parse(&[0; 9]), None);
    }

    #[test]
    fn a_super_packet_becomes_the_frames_a_nic_would_send() {
        let payload: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let sp = tcp(1_000_000, ACK | PSH | FIN | CWR, 0x02, &payload);
        let frames = cut(&gso(4000, true), &sp).unwrap();
        // Payloads are not copied: each frame's lies in the buffer that was read.
        assert!(frames
            .iter()
            .all(|f| f.head().len() == 52 && f.shared().is_some()));
        assert_eq!(frames.len(), 3);
        let mut joined = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            let f = &f.to_vec();
            let len = [4000, 4000, 2000][i];
            assert_eq!(f.len(), 52 + len);
            assert_eq!(be16(f, 2) as usize, f.len(), "IP total length");
            assert_eq!(be16(f, 4), 0x1234 + i as u16, "IP id counts up");
            assert_eq!(be32(f, 24), 1_000_000 + 4000 * i as u32, "sequence");
            assert_eq!(f[1], 0x02, "TOS kept");
            let fl = f[33];
            assert_eq!(fl & CWR != 0, i == 0, "CWR on the first only");
            assert_eq!(
                fl & (FIN | PSH) != 0,
                i == 2,
                "FIN and PSH on the last only"
            );
            assert_eq!(f[40..52], sp[40..52], "options kept");
            // IP checksum right; TCP checksum partial: completing it gives the real one.
            let mut ip = f.clone();
            set_header_checksum(&mut ip);
            assert_eq!(ip[10..12], f[10..12]);
            assert_eq!(be16(f, 36), pseudo(f, TCP, f.len() - 20));
            let mut done = f.clone();
            fill_checksum(&mut done);
            assert!(checksums_ok(&done));
            joined.extend_from_slice(&f[52..]);
        }
        assert_eq!(joined, payload);
        // Without GSO: one frame, untouched. Unknown GSO types are refused.
        assert_eq!(
            cut(&VnetHdr::default(), &sp).unwrap(),
            vec![Frame::from(sp.clone())]
        );
        let udp = VnetHdr {
            gso_type: 5,
            ..gso(1000, false)
        };
        assert_eq!(cut(&udp, &sp), Err(SegmentError::GsoType(5)));
        assert_eq!(cut(&gso(0, false), &sp), Err(SegmentError::Headers));
        assert_eq!(cut(&gso(100, false), &sp[..30]), Err(SegmentError::Headers));
    }

    #[test]
    fn consecutive_frames_coalesce_back_and_differences_split_them() {
        let payload: Vec<u8> = (0..9000u32).map(|i| i as u8).collect();
        let sp = tcp(5, ACK | PSH, 0x02, &payload);
        let frames = cut(&gso(3000, false), &sp).unwrap();
        let refs: Vec<&Frame> = frames.iter().collect();
        assert_eq!(mergeable_run(&refs), 3);
        let (v, h) = coalesced_headers(&refs);
        assert_eq!(v.gso_type, GSO_TCPV4);
        assert_eq!(
            (v.gso_size, v.hdr_len, v.csum_start, v.csum_offset),
            (3000, 52, 20, 16)
        );
        // Headers + payloads = the super-packet the sender handed over (its checksum
        // field partial, as the sender's was before the NIC); the payloads, adjacent in
        // the buffer read, go as one slice.
        let mut parts = Vec::new();
        payloads(&refs, h.len(), &mut parts);
        assert_eq!(parts.len(), 1);
        let mut want = sp.clone();
        want[36..38].copy_from_slice(&pseudo(&sp, TCP, sp.len() - 20).to_be_bytes());
        assert_eq!(joined(&refs), want);
        // The same frames held whole (each its own buffer) write the same bytes.
        let whole: Vec<Frame> = frames.iter().map(|f| Frame::from(f.to_vec())).collect();
        let whole_refs: Vec<&Frame> = whole.iter().collect();
        assert_eq!(mergeable_run(&whole_refs), 3);
        assert_eq!(joined(&whole_refs), want);
        let mixed = [&frames[0], &whole[1], &frames[2]];
        assert_eq!(mergeable_run(&mixed), 3);
        assert_eq!(joined(&mixed), want);

        // A frame lost in the middle: the run stops before the gap.
        assert_eq!(mergeable_run(&[&frames[0], &frames[2]]), 1);
        // A CE mark on the second frame: not merged with the first.
        let mut marked = frames[1].clone();
        marked.head_mut()[1] |= 0x03;
        set_header_checksum(marked.head_mut());
        assert_eq!(mergeable_run(&[&frames[0], &marked, &frames[2]]), 1);
        // Another flow, a SYN, a short frame first: each alone.
        let mut other_port = tcp(3005, ACK, 0x02, &payload[..3000]);
        other_port[21] ^= 1;
        assert_eq!(mergeable_run(&[&frames[0], &other_port.into()]), 1);
        let syn: Frame = tcp(5, SYN | ACK, 0, &payload[..3000]).into();
        assert_eq!(mergeable_run(&[&syn, &frames[1]]), 1);
        assert_eq!(mergeable_run(&[&frames[2], &frames[2]]), 1);
        // A pure ACK (no payload) does not start a run.
        let ack: Frame = tcp(5, ACK, 0, &[]).into();
        assert_eq!(mergeable_run(&[&ack, &ack]), 1);
        // A frame with IP options (a 60-byte IP header) and then one without, shorter
        // than the first one's headers: not merged (this read past the second frame and
        // panicked the data plane, found by fuzzing the write path).
        let mut opts = tcp(5, ACK, 0, &payload[..3000]);
        opts.splice(20..20, [1u8; 40]);
        opts[0] = 0x4f;
        let total = opts.len() as u16;
        opts[2..4].copy_from_slice(&total.to_be_bytes());
        set_header_checksum(&mut opts);
        let short: Frame = tcp(3005, ACK, 0, &[]).into();
        assert_eq!(mergeable_run(&[&Frame::from(opts.clone()), &short]), 1);
        assert_eq!(mergeable_run(&[&Frame::from(opts.clone()), &ack]), 1);
        // Frames of one flow whose IP options differ (a route recorded over other
        // switches, as sprayed frames take): not merged, since a super-packet carries
        // one header; alike, they are.
        let mut rr = sp.clone();
        rr.splice(20..20, [7u8, 11, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        rr[0] = 0x48;
        let total = rr.len() as u16;
        rr[2..4].copy_from_slice(&total.to_be_bytes());
        set_header_checksum(&mut rr);
        let rr_frames = cut(&gso(3000, false), &rr).unwrap();
        assert_eq!(rr_frames.len(), 3);
        let refs: Vec<&Frame> = rr_frames.iter().collect();
        assert_eq!(mergeable_run(&refs), 3);
        let mut other = rr_frames[1].clone();
        assert!(closbox_fabric::packet::record_route(
            other.head_mut(),
            std::net::Ipv4Addr::new(198, 18, 0, 9)
        ));
        assert_eq!(mergeable_run(&[&rr_frames[0], &other, &rr_frames[2]]), 1);
    }

    #[test]
    fn singles_are_written_as_needing_a_checksum_when_they_can_be() {
        let p = tcp(1, ACK, 0, b"x");
        assert_eq!(single_hdr(&p).flags, F_NEEDS_CSUM);
        assert_eq!(
            (single_hdr(&p).csum_start, single_hdr(&p).csum_offset),
            (20, 16)
        );
        let mut frag = p.clone();
        frag[6] = 0x20; // MF
        assert_eq!(single_hdr(&frag), VnetHdr::default());
        let mut icmp = p.clone();
        icmp[9] = 1;
        assert_eq!(single_hdr(&icmp), VnetHdr::default());
    }
}
