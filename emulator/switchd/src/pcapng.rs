//! A pcapng writer for captures (`closbox capture`): one interface per captured port,
//! raw IPv4 packets (LINKTYPE_IPV4), nanosecond timestamps, drop reasons as packet
//! comments, capture drops in each interface's statistics block. Just the blocks
//! closbox writes (pcapng, draft-ietf-opsawg-pcapng): section header, interface
//! description, enhanced packet, interface statistics.

/// LINKTYPE_IPV4: the packet begins with its IPv4 header. (Not LINKTYPE_RAW, 101:
/// libpcap maps that to DLT_RAW for the first interface only and then refuses a file
/// whose other interfaces say 101.)
pub const LINKTYPE_IPV4: u16 = 228;

const SHB: u32 = 0x0A0D_0D0A;
const IDB: u32 = 0x0000_0001;
const ISB: u32 = 0x0000_0005;
const EPB: u32 = 0x0000_0006;
const BYTE_ORDER_MAGIC: u32 = 0x1A2B_3C4D;

const OPT_END: u16 = 0;
const OPT_COMMENT: u16 = 1;
const SHB_USERAPPL: u16 = 4;
const IF_NAME: u16 = 2;
const IF_DESCRIPTION: u16 = 3;
const IF_TSRESOL: u16 = 9;
const EPB_FLAGS: u16 = 2;
const ISB_STARTTIME: u16 = 2;
const ISB_ENDTIME: u16 = 3;
const ISB_IFRECV: u16 = 4;
const ISB_OSDROP: u16 = 7;
const ISB_USRDELIV: u16 = 8;

/// A block under construction: type, then body; `finish` adds the lengths.
struct Block(Vec<u8>);

impl Block {
    fn new(kind: u32) -> Block {
        let mut b = Vec::with_capacity(64);
        b.extend_from_slice(&kind.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        Block(b)
    }

    fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Bytes padded to 32 bits.
    fn padded(&mut self, data: &[u8]) -> &mut Self {
        self.0.extend_from_slice(data);
        self.0.resize(self.0.len().next_multiple_of(4), 0);
        self
    }

    fn option(&mut self, code: u16, value: &[u8]) -> &mut Self {
        self.u16(code).u16(value.len() as u16).padded(value)
    }

    /// A timestamp option: high and low 32 bits, in the interface's resolution.
    fn ts_option(&mut self, code: u16, ns: u64) -> &mut Self {
        self.u16(code).u16(8).u32((ns >> 32) as u32).u32(ns as u32)
    }

    fn finish(mut self, out: &mut Vec<u8>) {
        let total = self.0.len() as u32 + 4;
        self.0[4..8].copy_from_slice(&total.to_le_bytes());
        self.0.extend_from_slice(&total.to_le_bytes());
        out.extend_from_slice(&self.0);
    }
}

/// The section header and one interface per `(name, description)`, in order (packet
/// records name them by index), each with nanosecond timestamps and `snaplen`.
pub fn header(interfaces: &[(String, String)], snaplen: u32, out: &mut Vec<u8>) {
    let mut shb = Block::new(SHB);
    shb.u32(BYTE_ORDER_MAGIC)
        .u16(1)
        .u16(0)
        .u64(u64::MAX)
        .option(
            SHB_USERAPPL,
            concat!("closbox ", env!("CARGO_PKG_VERSION")).as_bytes(),
        )
        .u16(OPT_END)
        .u16(0);
    shb.finish(out);
    for (name, description) in interfaces {
        let mut idb = Block::new(IDB);
        idb.u16(LINKTYPE_IPV4)
            .u16(0)
            .u32(snaplen)
            .option(IF_NAME, name.as_bytes())
            .option(IF_DESCRIPTION, description.as_bytes())
            .option(IF_TSRESOL, &[9])
            .u16(OPT_END)
            .u16(0);
        idb.finish(out);
    }
}

/// One packet on interface `interface` at `ns` (since the epoch): `data` is what was
/// kept of `len` bytes; a dropped packet carries its reason as a comment.
pub fn packet(
    interface: u32,
    ns: u64,
    data: &[u8],
    len: u32,
    dropped: Option<&str>,
    out: &mut Vec<u8>,
) {
    let mut epb = Block::new(EPB);
    epb.u32(interface)
        .u32((ns >> 32) as u32)
        .u32(ns as u32)
        .u32(data.len() as u32)
        .u32(len)
        .padded(data)
        // Outbound: packets as a port sends them.
        .option(EPB_FLAGS, &2u32.to_le_bytes());
    if let Some(reason) = dropped {
        epb.option(
            OPT_COMMENT,
            format!("dropped by the fabric: {reason}").as_bytes(),
        );
    }
    epb.u16(OPT_END).u16(0);
    epb.finish(out);
}

/// What a capture saw on one interface, for its statistics block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Packets the tap saw (written or not).
    pub seen: u64,
    /// Packets the capture could not keep (its buffer was full).
    pub dropped: u64,
    pub written: u64,
}

/// The statistics of one interface at the capture's end; `ended` (why the capture
/// ended, when the fabric ended it) as the block's comment, "closbox: capture ended: …".
pub fn statistics(
    interface: u32,
    start_ns: u64,
    end_ns: u64,
    s: Stats,
    ended: Option<&str>,
    out: &mut Vec<u8>,
) {
    let mut isb = Block::new(ISB);
    isb.u32(interface)
        .u32((end_ns >> 32) as u32)
        .u32(end_ns as u32)
        .ts_option(ISB_STARTTIME, start_ns)
        .ts_option(ISB_ENDTIME, end_ns)
        .option(ISB_IFRECV, &s.seen.to_le_bytes())
        .option(ISB_OSDROP, &s.dropped.to_le_bytes())
        .option(ISB_USRDELIV, &s.written.to_le_bytes());
    if let Some(why) = ended {
        isb.option(OPT_COMMENT, format!("{ENDED}{why}").as_bytes());
    }
    isb.u16(OPT_END).u16(0);
    isb.finish(out);
}

/// How a statistics block's comment says why the capture ended.
const ENDED: &str = "closbox: capture ended: ";

/// Why a capture ended, from the end of its stream (at least its last block): the
/// comment `statistics` gave the last block, if it is a statistics block with one.
pub fn ended(tail: &[u8]) -> Option<&str> {
    let n = tail.len();
    let word = |i: usize| u32::from_le_bytes(tail[i..i + 4].try_into().expect("4 bytes"));
    // A block ends with its total length (a multiple of 4, at least 12).
    let total = word(n.checked_sub(4)?) as usize;
    if total < 12 + 12 || total % 4 != 0 || total > n {
        return None;
    }
    let at = n - total;
    if word(at) != ISB || word(at + 4) as usize != total {
        return None;
    }
    // Options after interface id and timestamp, up to the trailing length.
    let mut o = at + 8 + 12;
    while o + 4 <= n - 4 {
        let code = u16::from_le_bytes([tail[o], tail[o + 1]]);
        let len = u16::from_le_bytes([tail[o + 2], tail[o + 3]]) as usize;
        if code == OPT_END || o + 4 + len > n - 4 {
            return None;
        }
        if code == OPT_COMMENT {
            let text = std::str::from_utf8(&tail[o + 4..o + 4 + len]).ok()?;
            if let Some(why) = text.strip_prefix(ENDED) {
                return Some(why);
            }
        }
        o += 4 + len.next_multiple_of(4);
    }
    None
}

/// Counts what a pcapng byte stream holds: (packets, capture drops from statistics
/// blocks). Stops at the first malformed block.
pub fn summarize(bytes: &[u8]) -> (u64, u64) {
    let (mut packets, mut dropped) = (0, 0);
    let mut at = 0usize;
    while at + 12 <= bytes.len() {
        let word = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        let (kind, total) = (word(at), word(at + 4) as usize);
        if total < 12 || total % 4 != 0 || at + total > bytes.len() {
            break;
        }
        match kind {
            EPB => packets += 1,
            ISB => {
                // Options after interface id and timestamp.
                let mut o = at + 8 + 12;
                while o + 4 <= at + total - 4 {
                    let code = u16::from_le_bytes([bytes[o], bytes[o + 1]]);
                    let len = u16::from_le_bytes([bytes[o + 2], bytes[o + 3]]) as usize;
                    if code == OPT_END {
                        break;
                    }
                    if code == ISB_OSDROP && len == 8 && o + 12 <= bytes.len() {
                        dropped += u64::from_le_bytes(bytes[o + 4..o + 12].try_into().expect("8"));
                    }
                    o += 4 + len.next_multiple_of(4);
                }
            }
            _ => {}
        }
        at += total;
    }
    (packets, dropped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_aligned_and_summarized() {
        let mut out = Vec::new();
        header(&[("a->b".into(), "link a-b".into())], 65535, &mut out);
        packet(
            0,
            1_700_000_000_000_000_001,
            &[0x45; 21],
            1500,
            None,
            &mut out,
        );
        packet(
            0,
            1_700_000_000_000_000_002,
            &[0x45; 20],
            20,
            Some("buffer_full"),
            &mut out,
        );
        assert_eq!(ended(&out), None, "a packet block last");
        let stats = Stats {
            seen: 5,
            dropped: 3,
            written: 2,
        };
        statistics(0, 1, 2, stats, None, &mut out);
        assert_eq!(out.len() % 4, 0);
        assert_eq!(summarize(&out), (2, 3));
        assert_eq!(ended(&out), None, "no reason given");
        let last = out.len();
        statistics(0, 1, 2, stats, Some("the fabric went down"), &mut out);
        assert_eq!(out.len() % 4, 0);
        assert_eq!(summarize(&out), (2, 6));
        assert_eq!(ended(&out), Some("the fabric went down"));
        // From any tail that holds the last block, and from none shorter.
        for cut in 0..out.len() {
            let got = ended(&out[cut..]);
            assert_eq!(got.is_some(), cut <= last, "cut at {cut}");
        }
        assert_eq!(ended(&[]), None);
        // The byte-order magic where readers look for it.
        assert_eq!(&out[8..12], &BYTE_ORDER_MAGIC.to_le_bytes());
    }
}
