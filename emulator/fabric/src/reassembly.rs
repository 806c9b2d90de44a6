//! Datagrams addressed to a switch that arrive in fragments (`ping -s 3000 spine1` over
//! 1500-byte links), put back together as a host's IP layer does (RFC 791) so that the
//! switch can answer them. Bounded as Linux bounds it: a datagram waits at most
//! `TIMEOUT` for its missing fragments (`ipfrag_time`), and at most `MAX_DATAGRAMS`
//! wait at once (the oldest goes first).

use crate::units::{Duration, Instant};

/// How long a datagram's fragments wait for the rest (Linux's `ipfrag_time`).
pub const TIMEOUT: Duration = Duration::from_millis(30_000);
/// Datagrams in pieces at once, over every switch.
pub const MAX_DATAGRAMS: usize = 16;
/// The largest IPv4 datagram.
const MAX_DATAGRAM: usize = 65_535;
/// Disjoint runs of bytes a datagram in pieces may have (a 65,535-byte datagram over
/// 1500-byte links is 45 pieces); a datagram with more holes is dropped, so that a GPU
/// sending pieces that never join cannot make each one cost more.
const MAX_RUNS: usize = 64;

/// A datagram in pieces: which switch it is for, and the fields that name it (source,
/// destination, identification, protocol).
type Key = (u32, [u8; 4], [u8; 4], u16, u8);

#[derive(Debug)]
struct Partial {
    key: Key,
    since: Instant,
    /// The first fragment's header, once it came.
    header: Option<Vec<u8>>,
    payload: Vec<u8>,
    /// Byte ranges of the payload received, sorted and merged.
    have: Vec<(usize, usize)>,
    /// The payload's length, once the last fragment came.
    total: Option<usize>,
}

/// The datagrams in pieces of a fabric's switches.
#[derive(Debug, Default)]
pub struct Reassembly {
    partial: Vec<Partial>,
}

impl Reassembly {
    /// Takes fragment `frag` (an IPv4 packet with "more fragments" set or an offset, its
    /// header checked) arriving at switch `at` at `now`: the whole datagram, unfragmented,
    /// once its last missing piece came; `None` until then, and for a fragment that cannot
    /// be part of a datagram (beyond 65,535 bytes, or not the last and not a multiple of 8
    /// bytes long), which is dropped.
    pub fn add(&mut self, now: Instant, at: u32, frag: &[u8]) -> Option<Vec<u8>> {
        self.partial
            .retain(|p| now.saturating_since(p.since) < TIMEOUT);
        let ihl = (frag[0] & 0x0f) as usize * 4;
        let len = (u16::from_be_bytes([frag[2], frag[3]]) as usize).min(frag.len());
        let field = u16::from_be_bytes([frag[6], frag[7]]);
        let (more, offset) = (field & 0x2000 != 0, (field & 0x1fff) as usize * 8);
        let data = frag.get(ihl..len)?;
        let end = offset + data.len();
        if ihl + end > MAX_DATAGRAM || (more && data.len() % 8 != 0) || data.is_empty() {
            return None;
        }
        let key: Key = (
            at,
            frag[12..16].try_into().expect("4"),
            frag[16..20].try_into().expect("4"),
            u16::from_be_bytes([frag[4], frag[5]]),
            frag[9],
        );
        let i = match self.partial.iter().position(|p| p.key == key) {
            Some(i) => i,
            None => {
                if self.partial.len() >= MAX_DATAGRAMS {
                    // The oldest is the first: they are added at the end.
                    self.partial.remove(0);
                }
                self.partial.push(Partial {
                    key,
                    since: now,
                    header: None,
                    payload: Vec::new(),
                    have: Vec::new(),
                    total: None,
                });
                self.partial.len() - 1
            }
        };
        let p = &mut self.partial[i];
        if p.payload.len() < end {
            p.payload.resize(end, 0);
        }
        p.payload[offset..end].copy_from_slice(data);
        // The runs received, kept sorted and merged.
        p.have.push((offset, end));
        p.have.sort_unstable();
        let mut runs: Vec<(usize, usize)> = Vec::with_capacity(p.have.len());
        for &(s, e) in &p.have {
            match runs.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => runs.push((s, e)),
            }
        }
        p.have = runs;
        if p.have.len() > MAX_RUNS {
            self.partial.remove(i);
            return None;
        }
        if offset == 0 {
            p.header = Some(frag[..ihl].to_vec());
        }
        if !more {
            p.total = Some(end);
        }
        let total = p.total?;
        p.header.as_ref()?;
        // Whole once one run covers it from its start.
        let (start, end) = p.have[0];
        if start != 0 || end < total {
            return None;
        }
        let p = self.partial.remove(i);
        let header = p.header.expect("checked");
        let mut whole = header;
        whole.extend_from_slice(&p.payload[..total]);
        let n = whole.len() as u16;
        whole[2..4].copy_from_slice(&n.to_be_bytes());
        // Whole now: no offset, no "more fragments" (its "don't fragment" as it came).
        let df = u16::from_be_bytes([whole[6], whole[7]]) & 0x4000;
        whole[6..8].copy_from_slice(&df.to_be_bytes());
        crate::packet::set_header_checksum(&mut whole);
        Some(whole)
    }

    /// Datagrams waiting for fragments.
    pub fn waiting(&self) -> usize {
        self.partial.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet;
    use std::net::Ipv4Addr;

    fn ping(len: usize) -> Vec<u8> {
        let mut p = packet::build_echo_request(
            Ipv4Addr::new(198, 18, 0, 1),
            Ipv4Addr::new(198, 18, 0, 9),
            7,
            1,
            len,
        );
        p[4..6].copy_from_slice(&0x1234u16.to_be_bytes());
        // Sent in pieces: without "don't fragment".
        p[6..8].fill(0);
        packet::set_header_checksum(&mut p);
        p
    }

    #[test]
    fn fragments_in_any_order_make_the_datagram_again() {
        let whole = ping(3000);
        let pieces = packet::fragment(&whole, 1500);
        assert_eq!(pieces.len(), 3);
        for p in &pieces {
            assert!(p.len() <= 1500 && packet::checksum_ok(p) && packet::is_fragment(p));
        }
        // One that fits is sent as it is.
        assert!(packet::fragment(&ping(1000), 1500) == [ping(1000)]);
        for order in [[0, 1, 2], [2, 0, 1], [1, 2, 0]] {
            let mut r = Reassembly::default();
            let mut got = None;
            for (n, &i) in order.iter().enumerate() {
                got = r.add(Instant::ZERO, 3, &pieces[i]);
                assert_eq!(got.is_some(), n == 2, "{order:?}");
            }
            let got = got.unwrap();
            assert!(got == whole, "{order:?}: not the datagram sent");
            assert!(packet::checksum_ok(&got));
            assert_eq!(r.waiting(), 0);
        }
        // A piece twice, or overlapping: the same datagram.
        let mut r = Reassembly::default();
        assert!(r.add(Instant::ZERO, 3, &pieces[0]).is_none());
        assert!(r.add(Instant::ZERO, 3, &pieces[0]).is_none());
        assert!(r.add(Instant::ZERO, 3, &pieces[2]).is_none());
        assert!(r.add(Instant::ZERO, 3, &pieces[1]) == Some(whole.clone()));
    }

    #[test]
    fn datagrams_in_pieces_are_bounded_in_number_and_time() {
        let pieces = packet::fragment(&ping(3000), 1500);
        let mut r = Reassembly::default();
        // Another switch's, or another identification: another datagram.
        assert!(r.add(Instant::ZERO, 3, &pieces[0]).is_none());
        assert!(r.add(Instant::ZERO, 4, &pieces[1]).is_none());
        assert!(r.add(Instant::ZERO, 4, &pieces[2]).is_none());
        assert_eq!(r.waiting(), 2);
        // Too late: its first piece is gone.
        let late = Instant::ZERO + TIMEOUT;
        assert!(r.add(late, 3, &pieces[1]).is_none());
        assert!(r.add(late, 3, &pieces[2]).is_none());
        assert_eq!(r.waiting(), 1);
        for id in 0..100u16 {
            let mut p = pieces[0].clone();
            p[4..6].copy_from_slice(&id.to_be_bytes());
            r.add(late, 3, &p);
        }
        assert_eq!(r.waiting(), MAX_DATAGRAMS);
        // Beyond 65,535 bytes, or a middle piece not a multiple of 8: dropped.
        let mut big = pieces[1].clone();
        big[6..8].copy_from_slice(&(0x2000u16 | 0x1fff).to_be_bytes());
        packet::set_header_checksum(&mut big);
        assert!(r.add(late, 5, &big).is_none());
        let mut odd = pieces[0].clone();
        odd.truncate(odd.len() - 3);
        let n = odd.len() as u16;
        odd[2..4].copy_from_slice(&n.to_be_bytes());
        assert!(r.add(late, 6, &odd).is_none());
        assert_eq!(r.waiting(), MAX_DATAGRAMS);
        // Pieces that never join: the datagram goes at its 65th hole, and the same piece
        // a thousand times costs one run.
        let mut r = Reassembly::default();
        let piece = |at: u16| {
            let mut p = pieces[1].clone();
            p.truncate(20 + 8);
            p[2..4].copy_from_slice(&28u16.to_be_bytes());
            p[6..8].copy_from_slice(&(0x2000 | at).to_be_bytes());
            packet::set_header_checksum(&mut p);
            p
        };
        for _ in 0..1000 {
            assert!(r.add(late, 7, &piece(1)).is_none());
        }
        assert_eq!(r.partial[0].have, [(8, 16)]);
        for k in 1..=MAX_RUNS as u16 {
            r.add(late, 7, &piece(2 * k + 1));
        }
        assert_eq!(r.waiting(), 0, "dropped with more than {MAX_RUNS} holes");
    }
}
