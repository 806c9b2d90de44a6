//! A frame's bytes as the fabric holds them: its headers, which the fabric reads and
//! rewrites (TTL, ECN), and its payload, which it only carries.
//!
//! A frame is either one buffer of its own, or headers of its own followed by a slice of
//! a buffer it shares with the other frames cut from the same super-packet (TUN offload):
//! cutting a 64 KiB read into frames then copies headers, not payloads, and frames that
//! leave together are written from the same memory they were read into.

use std::ops::Range;
use std::sync::Arc;

#[derive(Clone, Debug, Default)]
pub struct Frame {
    /// The frame's first bytes; all of them unless `body` is set.
    head: Vec<u8>,
    body: Option<Body>,
}

/// Compact (16 bytes: a frame moves through every queue of its path): a body is at most
/// a TUN read (65,545 bytes), so its length and charge fit 16 bits.
#[derive(Clone, Debug)]
struct Body {
    buf: Arc<Vec<u8>>,
    start: u32,
    len: u16,
    /// The memory this frame is charged for its part of `buf` (saturated at 65,535).
    charge: u16,
}

impl Frame {
    /// A frame whose bytes are `head` and then `buf[range]`; `charge`: its share of
    /// `buf`'s memory (the whole buffer lives as long as any frame cut from it).
    ///
    /// # Panics
    /// If `range` is not within `buf`, or longer than 65,535 bytes.
    pub fn split(head: Vec<u8>, buf: Arc<Vec<u8>>, range: Range<usize>, charge: usize) -> Frame {
        assert!(
            range.start <= range.end && range.end <= buf.len(),
            "range within buffer"
        );
        Frame {
            head,
            body: Some(Body {
                start: range.start as u32,
                len: u16::try_from(range.len()).expect("a body of at most 64 KiB"),
                charge: charge.min(u16::MAX as usize) as u16,
                buf,
            }),
        }
    }

    pub fn len(&self) -> usize {
        self.head.len() + self.body.as_ref().map_or(0, |b| b.len as usize)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first bytes: the whole frame, or at least its headers when split.
    pub fn head(&self) -> &[u8] {
        &self.head
    }

    pub fn head_mut(&mut self) -> &mut [u8] {
        &mut self.head
    }

    /// The bytes after `head` (empty unless split).
    pub fn body(&self) -> &[u8] {
        self.body.as_ref().map_or(&[][..], |b| &b.buf[b.range()])
    }

    /// The shared buffer and the range of it that `body` is.
    pub fn shared(&self) -> Option<(&Arc<Vec<u8>>, Range<usize>)> {
        self.body.as_ref().map(|b| (&b.buf, b.range()))
    }

    /// The frame's first `n` bytes (all of them if it is shorter), as one buffer.
    pub fn prefix(&self, n: usize) -> Vec<u8> {
        let n = n.min(self.len());
        let mut v = Vec::with_capacity(n);
        let h = n.min(self.head.len());
        v.extend_from_slice(&self.head[..h]);
        v.extend_from_slice(&self.body()[..n - h]);
        v
    }

    pub fn to_vec(&self) -> Vec<u8> {
        self.prefix(usize::MAX)
    }

    /// The bytes as one buffer (no copy unless split).
    pub fn into_vec(self) -> Vec<u8> {
        match self.body {
            None => self.head,
            Some(_) => self.to_vec(),
        }
    }

    /// Its head, emptied, for a frame made later (`split`): a frame cut from a super-packet
    /// is one small allocation, which a data plane moving ~10^6 frames a second reuses
    /// rather than returns to the allocator. A shared body is let go.
    pub fn into_head(self) -> Vec<u8> {
        let mut head = self.head;
        head.clear();
        head
    }

    /// The memory charged for holding it (its own buffer, and its share of a shared one).
    pub fn charge(&self) -> usize {
        self.head.capacity() + self.body.as_ref().map_or(0, |b| b.charge as usize)
    }
}

impl Body {
    fn range(&self) -> Range<usize> {
        self.start as usize..self.start as usize + self.len as usize
    }
}

impl AsRef<Frame> for Frame {
    fn as_ref(&self) -> &Frame {
        self
    }
}

impl From<Vec<u8>> for Frame {
    fn from(head: Vec<u8>) -> Frame {
        Frame { head, body: None }
    }
}

/// Frames are equal when their bytes are, however held.
impl PartialEq for Frame {
    fn eq(&self, other: &Frame) -> bool {
        self.len() == other.len()
            && self
                .head
                .iter()
                .chain(self.body())
                .eq(other.head.iter().chain(other.body()))
    }
}

impl Eq for Frame {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_frame_reads_as_its_bytes() {
        let buf = Arc::new((0u8..100).collect::<Vec<u8>>());
        let f = Frame::split(vec![7, 8, 9], Arc::clone(&buf), 10..20, 50);
        assert_eq!(f.len(), 13);
        assert_eq!(f.head(), &[7, 8, 9]);
        assert_eq!(f.body(), &buf[10..20]);
        assert_eq!(f.prefix(5), vec![7, 8, 9, 10, 11]);
        assert_eq!(f.prefix(2), vec![7, 8]);
        let whole: Vec<u8> = [7, 8, 9].into_iter().chain(10..20).collect();
        assert_eq!(f.to_vec(), whole);
        assert_eq!(f, Frame::from(whole.clone()));
        assert_eq!(f.charge(), 3 + 50);
        assert_eq!(f.clone().into_vec(), whole);
        assert_eq!(Frame::from(vec![1, 2]).into_vec(), vec![1, 2]);
        assert_ne!(f, Frame::from(vec![7, 8, 9]));
    }
}
