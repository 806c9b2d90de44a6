//! Reading a client's request head against a deadline for the whole of it: a read
//! timeout alone bounds each read, and a client sending a byte now and then (within every
//! timeout) would hold the thread serving it for as long as it liked.

use std::io::{self, Read};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// A stream whose reads can time out (the sockets the daemon serves).
pub trait TimedRead: Read {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()>;
}

impl TimedRead for TcpStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, t)
    }
}

impl TimedRead for UnixStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, t)
    }
}

/// Why no whole head was read.
#[derive(Debug)]
pub enum HeadError {
    /// `within` passed before the head ended.
    Late(Duration),
    /// More than `max` bytes without the head's end.
    TooLong(usize),
    Io(io::Error),
}

impl std::fmt::Display for HeadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeadError::Late(d) => write!(f, "request not complete within {d:?}"),
            HeadError::TooLong(max) => write!(f, "request longer than {max} bytes"),
            HeadError::Io(e) => write!(f, "reading the request: {e}"),
        }
    }
}

impl std::error::Error for HeadError {}

/// Reads from `conn` up to and including the first `end` (or until the peer closes: then
/// what came), at most `max` bytes, all of it within `within` of now. Bytes that came
/// after `end` in the same read are dropped (a request is all a connection carries).
pub fn read_head<S: TimedRead>(
    conn: &mut S,
    end: &[u8],
    max: usize,
    within: Duration,
) -> Result<Vec<u8>, HeadError> {
    debug_assert!(!end.is_empty(), "a head ends with something");
    let deadline = Instant::now() + within;
    let mut head = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(HeadError::Late(within));
        }
        conn.set_read_timeout(Some(left)).map_err(HeadError::Io)?;
        let n = match conn.read(&mut buf[..(max + 1 - head.len()).min(64 << 10)]) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(HeadError::Late(within))
            }
            Err(e) => return Err(HeadError::Io(e)),
        };
        if n == 0 {
            return Ok(head);
        }
        // Only the new bytes, and the end's length before them, can complete it.
        let from = head.len().saturating_sub(end.len() - 1);
        head.extend_from_slice(&buf[..n]);
        if let Some(at) = head[from..].windows(end.len()).position(|w| w == end) {
            head.truncate(from + at + end.len());
            return Ok(head);
        }
        if head.len() > max {
            return Err(HeadError::TooLong(max));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_trickled_head_is_cut_off_at_the_deadline() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        // A byte every 20 ms, each well within any per-read timeout, never the end.
        let sender = std::thread::spawn(move || {
            for _ in 0..100 {
                if b.write_all(b"x").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let r = read_head(&mut a, b"\n", 1 << 20, Duration::from_millis(200));
        assert!(matches!(r, Err(HeadError::Late(_))), "{r:?}");
        drop(a);
        sender.join().unwrap();
    }

    #[test]
    fn heads_end_where_they_say_or_at_the_limit() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        // The end split across two writes.
        b.write_all(b"GET / HTTP/1.0\r\n\r").unwrap();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            b.write_all(b"\n").unwrap();
            b
        });
        let h = read_head(&mut a, b"\r\n\r\n", 8192, Duration::from_secs(30)).unwrap();
        assert_eq!(h, b"GET / HTTP/1.0\r\n\r\n");
        // What follows the end in the same read is not part of the head.
        let (mut c, mut d) = UnixStream::pair().unwrap();
        d.write_all(b"{\"cmd\":\"status\"}\n{\"cmd\"").unwrap();
        let h = read_head(&mut c, b"\n", 4096, Duration::from_secs(30)).unwrap();
        assert_eq!(h, b"{\"cmd\":\"status\"}\n");
        let mut b = t.join().unwrap();
        b.write_all(&[b'y'; 5000]).unwrap();
        let r = read_head(&mut a, b"\n", 4096, Duration::from_secs(30));
        assert!(matches!(r, Err(HeadError::TooLong(4096))), "{r:?}");
        // A peer that closes: what it sent.
        let (mut a, mut b) = UnixStream::pair().unwrap();
        b.write_all(b"partial").unwrap();
        drop(b);
        let h = read_head(&mut a, b"\n", 4096, Duration::from_secs(30)).unwrap();
        assert_eq!(h, b"partial");
    }
}
